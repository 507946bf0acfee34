"""A preempted sequence's KV, kept in host RAM until its request resumes.

Preemption used to throw a sequence's KV away and recompute its whole prompt and output on
resume. Saving it instead (`llama_state_seq_get_data_ext`: the sequence's cells, every
layer's K and V rows, copied off the device) and writing it back into whatever cells are
free on resume (`llama_state_seq_set_data_ext`, which finds them like a batch does, not
necessarily contiguous) keeps the work at the price of two copies — cheaper than
recomputing for all but short sequences; the scheduler decides which per victim
(scheduler.kv.SwapCost) and bounds the bytes held here (`--swap-space`).

The buffers are host memory owned by this store, keyed by the scheduler's swap keys:
plain memory, or page-locked memory lent by a `PinnedStaging` (engine.pinned) where the
store was given one, which goes back to its lender once the bytes are restored or dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.pinned import HostBytes, plain

log = logging.getLogger(__name__)

_FLAGS = 0  # the whole sequence state (not only the SWA part)


@dataclass(frozen=True, slots=True)
class SideDone:
    """A prompt another context prefilled (engine.side_prefill): its KV bytes, for this
    store to `put` under `key` (None: it failed, the request recomputes)."""

    key: int
    kv: HostBytes | None
    tokens: int


class SwapStore:
    """Saved sequences by key. Engine-thread only, like the context it reads and writes."""

    def __init__(self, ll: Any, ctx: Any) -> None:
        self._ll = ll
        self._ctx = ctx
        self._saved: dict[int, HostBytes] = {}
        self.alloc: Callable[[int], HostBytes] = plain  # where a save's bytes go

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self._saved.values())

    def __len__(self) -> int:
        return len(self._saved)

    def save(self, key: int, llama_seq: int) -> int:
        """Copy the sequence's KV to host RAM; the bytes saved, 0 when llama.cpp could not."""
        size = self._ll.llama_state_seq_get_size_ext(self._ctx, llama_seq, _FLAGS)
        if size <= 0:
            return 0
        buf = self.alloc(size)
        n = self._ll.llama_state_seq_get_data_ext(self._ctx, buf.view, size, llama_seq, _FLAGS)
        if n != size:
            log.warning("saving sequence %d: %d of %d bytes", llama_seq, n, size)
            buf.free()
            return 0
        self._saved[key] = buf
        return int(n)

    def restore(self, key: int, llama_seq: int) -> int:
        """Write a saved sequence back as `llama_seq` (which must hold no cells) and forget
        it; the bytes restored, 0 when it failed (no free cells: llama.cpp then leaves the
        sequence empty)."""
        buf = self._saved.pop(key, None)
        if buf is None:
            return 0
        n = self._ll.llama_state_seq_set_data_ext(self._ctx, buf.view, len(buf), llama_seq, _FLAGS)
        buf.free()
        if n != len(buf):
            log.warning("restoring sequence %d (%d bytes) failed", llama_seq, len(buf))
            return 0
        return int(n)

    def take(self, key: int) -> HostBytes | None:
        """A saved sequence's bytes, handed over (another context's store `put`s them)."""
        return self._saved.pop(key, None)

    def put(self, key: int, buf: HostBytes) -> None:
        """Bytes another context of the same model saved (`take`), restored like our own."""
        self._saved[key] = buf

    def drop(self, key: int) -> None:
        if (buf := self._saved.pop(key, None)) is not None:
            buf.free()

    def clear(self) -> None:
        for buf in self._saved.values():
            buf.free()
        self._saved.clear()
