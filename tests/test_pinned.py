"""Saved KV in lent host memory (engine.pinned): the lender gets its buffer back whichever
way the bytes leave the swap store — restored, dropped, cleared, or a save that failed —
and is asked again only once it has it back."""

from __future__ import annotations

import ctypes
from typing import Any

from engine.kv_swap import SwapStore
from engine.pinned import HostBytes, PinnedStaging, plain


class FakeLlama:
    """llama.cpp's sequence-state calls: a sequence's state is `size` bytes of its id."""

    def __init__(self, size: int = 64, short: bool = False) -> None:
        self.size, self.short = size, short
        self.restored: dict[int, bytes] = {}

    def llama_state_seq_get_size_ext(self, ctx: Any, seq: int, flags: int) -> int:
        return self.size

    def llama_state_seq_get_data_ext(self, ctx: Any, buf: Any, size: int, seq: int, f: int) -> int:
        ctypes.memset(buf, seq, size)
        return size - 1 if self.short else size

    def llama_state_seq_set_data_ext(self, ctx: Any, buf: Any, size: int, seq: int, f: int) -> int:
        self.restored[seq] = bytes(buf)
        return size


class Lender:
    def __init__(self) -> None:
        self.out = 0
        self.memory = (ctypes.c_uint8 * 1024)()

    def lend(self, size: int) -> HostBytes:
        assert self.out == 0, "lent twice"
        self.out += 1
        view = (ctypes.c_uint8 * size).from_buffer(self.memory)
        return HostBytes(view, self.back)

    def back(self) -> None:
        self.out -= 1


def test_lent_memory_goes_back_however_the_bytes_leave() -> None:
    ll, lender = FakeLlama(), Lender()
    store = SwapStore(ll, None)
    store.alloc = lender.lend
    assert store.save(1, 7) == 64 and lender.out == 1
    assert store.restore(1, 3) == 64 and lender.out == 0
    assert ll.restored[3] == bytes([7]) * 64
    store.save(2, 5)
    store.drop(2)
    assert lender.out == 0
    store.save(3, 5)
    moved = store.take(3)  # handed to another context's store, still lent
    assert moved is not None and lender.out == 1
    other = SwapStore(ll, None)
    other.put(3, moved)
    other.clear()
    assert lender.out == 0 and len(other) == 0
    failing = SwapStore(FakeLlama(short=True), None)
    failing.alloc = lender.lend
    assert failing.save(4, 1) == 0 and lender.out == 0


def test_without_a_gpu_nothing_is_pinned_and_plain_memory_is_used() -> None:
    from engine._capi import llama

    staging = PinnedStaging(llama(), 1 << 22)
    assert staging.capacity == 0 and staging.lend(1 << 20) is None  # (no GPU here)
    buf = plain(16)
    assert len(buf) == 16 and bytes(buf.view) == bytes(16)
    buf.free()  # (nothing to give back: a no-op)
