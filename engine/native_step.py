"""The step's native core: `llama_decode`, wait for the device, sample, in one ctypes call.

`engine/native/decode_sample.c` (built by `make`) says why this is C: the engine thread
takes Python's GIL back once per step instead of after each backend call and each sampler
(a server's event loop holds the GIL in between), and its scans sample a row of logits in
a fraction of what a llama.cpp sampler chain costs. This module loads it, owns the memory
it reads and writes (per-slot sampling settings and random states as numpy arrays, so
setting them costs no ctypes marshalling) and reports the step's times, among them how
long the engine thread waited for the GIL after the native code finished.
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import ModelLoadError
from engine.step_types import SamplingParams

LIBRARY = Path(__file__).parent / "native" / "libdecode_sample.so"
ROW_PYTHON, ROW_GREEDY, ROW_SAMPLE = 0, 1, 2
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment: one draw advances the state by it
MAX_THREADS = 8  # sampling threads; past this the logits' memory bandwidth is the limit
MAX_BIAS = 1024  # logit_bias entries a request may have (decode_sample.c's MAX_BIAS)


class _Slots(ctypes.Structure):  # mirrors struct slot_params
    _fields_ = [
        ("mode", ctypes.c_void_p),
        ("top_k", ctypes.c_void_p),
        ("top_p", ctypes.c_void_p),
        ("min_p", ctypes.c_void_p),
        ("temperature", ctypes.c_void_p),
        ("rng", ctypes.c_void_p),
        ("masked", ctypes.c_void_p),
        ("mask", ctypes.c_void_p),
        ("bias_n", ctypes.c_void_p),
        ("bias_id", ctypes.c_void_p),
        ("bias_val", ctypes.c_void_p),
        ("ban_eog", ctypes.c_void_p),
    ]


class _Call(ctypes.Structure):  # mirrors struct step_call
    _fields_ = [
        ("decode", ctypes.c_void_p),
        ("sync", ctypes.c_void_p),
        ("get_logits", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
        ("batch", ctypes.c_void_p),
        ("slots", _Slots),
        ("n_vocab", ctypes.c_int32),
        ("n_threads", ctypes.c_int32),
        ("scratch", ctypes.c_void_p),
        ("pool", ctypes.c_void_p),
        ("t_decoded", ctypes.c_double),
        ("t_sampled", ctypes.c_double),
        ("mask_words", ctypes.c_int32),
        ("mask_ready", ctypes.c_void_p),
        ("t_masked", ctypes.c_double),
        ("n_eog", ctypes.c_int32),
        ("eog", ctypes.c_void_p),
    ]


@dataclass(slots=True)
class NativeTimes:
    """One call's times in seconds: in llama_decode (through the device's finish),
    sampling the native rows, and waiting for the GIL after both."""

    decode_s: float
    sample_s: float
    gil_s: float
    mask_wait_s: float = 0.0  # after decoding, for the masks of constrained sequences


def seed_state(seed: int | None, skip: int = 0) -> int:
    """The splitmix64 state of a request: from its seed (random without one), advanced by
    `skip` draws — the tokens it already generated before a preemption."""
    base = int.from_bytes(os.urandom(8), "little") if seed is None else seed
    return (base + skip * _GAMMA) & 0xFFFFFFFFFFFFFFFF


def native_mode(p: SamplingParams) -> int:
    """Which rows the native code samples: everything but penalties (llama.cpp chains)."""
    if p.has_penalties:
        return ROW_PYTHON
    return ROW_GREEDY if p.is_greedy else ROW_SAMPLE


class NativeStep:
    """One context's decode-and-sample call, with sampling settings per sequence slot."""

    def __init__(
        self, ll: Any, ctx: Any, batch: Any, n_slots: int, n_vocab: int, n_threads: int
    ) -> None:
        if not LIBRARY.is_file():
            raise ModelLoadError(f"the engine needs {LIBRARY}: run `make`")
        self._lib = ctypes.CDLL(str(LIBRARY))
        ptr, i32 = ctypes.c_void_p, ctypes.c_int32
        self._lib.onegpu_decode_sample.restype = i32
        self._lib.onegpu_decode_sample.argtypes = (ptr, i32, ptr, ptr)
        self._lib.onegpu_sample.restype = None
        self._lib.onegpu_sample.argtypes = (ptr, ptr, i32, ptr, ptr)
        self._lib.onegpu_close.restype = None
        self._lib.onegpu_close.argtypes = (ptr,)
        self._lib.onegpu_scratch_floats.restype = ctypes.c_int64
        self._lib.onegpu_scratch_floats.argtypes = [ctypes.c_int32]
        self._lib.onegpu_mask_ready.restype = None
        self._lib.onegpu_mask_ready.argtypes = (ptr,)
        self.mode = np.zeros(n_slots, dtype=np.int32)
        self.top_k = np.zeros(n_slots, dtype=np.int32)
        self.top_p = np.ones(n_slots, dtype=np.float32)
        self.min_p = np.zeros(n_slots, dtype=np.float32)
        self.temperature = np.ones(n_slots, dtype=np.float32)
        self.rng = np.zeros(n_slots, dtype=np.uint64)
        # Token masks of constrained sequences (engine.grammar), one row per slot; pages of
        # rows never written are never resident.
        self.masked = np.zeros(n_slots, dtype=np.int32)
        self.mask = np.zeros((n_slots, (n_vocab + 31) // 32), dtype=np.uint32)
        self._ready = np.ones(1, dtype=np.int32)
        self.bias_n = np.zeros(n_slots, dtype=np.int32)
        self.bias_id = np.zeros((n_slots, MAX_BIAS), dtype=np.int32)
        self.bias_val = np.zeros((n_slots, MAX_BIAS), dtype=np.float32)
        self.ban_eog = np.zeros(n_slots, dtype=np.int32)
        self._eog = np.zeros(0, dtype=np.int32)
        threads = max(1, min(n_threads, MAX_THREADS))
        # Untouched pages of np.zeros are not resident: threads that never run cost nothing.
        self._scratch = np.zeros(
            threads * self._lib.onegpu_scratch_floats(n_vocab), dtype=np.float32
        )
        self._rows = np.zeros(n_slots, dtype=np.int32)  # row -> slot, per call
        self.out = np.zeros(n_slots, dtype=np.int32)  # row -> sampled token, -1 for Python
        c = self._call = _Call()
        if ll is not None:
            c.decode = ctypes.cast(ll._lib.llama_decode, ctypes.c_void_p).value
            c.sync = ctypes.cast(ll._lib.llama_synchronize, ctypes.c_void_p).value
            c.get_logits = ctypes.cast(ll._lib.llama_get_logits, ctypes.c_void_p).value
        c.ctx = ctypes.cast(ctx, ctypes.c_void_p).value if ctx is not None else None
        c.batch = ctypes.addressof(batch) if batch is not None else None
        s = c.slots
        s.mode, s.top_k, s.top_p = (
            self.mode.ctypes.data,
            self.top_k.ctypes.data,
            self.top_p.ctypes.data,
        )
        s.min_p, s.temperature = self.min_p.ctypes.data, self.temperature.ctypes.data
        s.rng = self.rng.ctypes.data
        s.masked, s.mask = self.masked.ctypes.data, self.mask.ctypes.data
        s.bias_n, s.bias_id = self.bias_n.ctypes.data, self.bias_id.ctypes.data
        s.bias_val, s.ban_eog = self.bias_val.ctypes.data, self.ban_eog.ctypes.data
        c.mask_words, c.mask_ready = self.mask.shape[1], self._ready.ctypes.data
        c.n_vocab, c.n_threads, c.scratch = n_vocab, threads, self._scratch.ctypes.data
        self._ptr = ctypes.addressof(c)

    def set_slot(self, slot: int, p: SamplingParams, mode: int, skip: int = 0) -> None:
        """Sampling settings of the sequence in `slot`; `skip`: tokens it already drew."""
        self.mode[slot] = mode
        self.top_k[slot] = min(p.top_k, 2**31 - 1)  # any k >= the vocabulary means off
        self.top_p[slot] = p.top_p
        self.min_p[slot] = p.min_p
        self.temperature[slot] = p.temperature if p.temperature > 0 else 1.0
        if mode == ROW_SAMPLE:  # only draws need a state (no urandom per greedy request)
            self.rng[slot] = seed_state(p.seed, skip)
        n = len(p.logit_bias)
        self.bias_n[slot] = n
        if n:
            self.bias_id[slot, :n] = [t for t, _ in p.logit_bias]
            self.bias_val[slot, :n] = [b for _, b in p.logit_bias]
        self.ban_eog[slot] = int(skip < p.min_tokens)

    def clear_slot(self, slot: int) -> None:
        self.mode[slot] = ROW_PYTHON
        self.masked[slot] = 0
        self.bias_n[slot] = 0
        self.ban_eog[slot] = 0

    def allow_only_end(self, slot: int) -> None:
        """The slot's mask row allows its end-of-generation tokens only."""
        row = self.mask[slot]
        row[:] = 0
        for t in self._eog.tolist():
            row[t // 32] |= np.uint32(1 << (t % 32))

    def set_eog(self, tokens: list[int]) -> None:
        """The vocabulary's end-of-generation tokens (banned while min_tokens is not met)."""
        self._eog = np.array(tokens, dtype=np.int32)
        self._call.n_eog, self._call.eog = len(tokens), self._eog.ctypes.data

    def masks_pending(self) -> None:
        """This step's masks are being written (by another thread): the step waits for
        `masks_ready` between decoding and sampling."""
        self._ready[0] = 0

    def masks_ready(self) -> None:
        self._lib.onegpu_mask_ready(self._ready.ctypes.data)

    def decode_sample(self, slots: list[int]) -> tuple[int, NativeTimes]:
        """Decode the bound batch and sample one row per entry of `slots` (row order) into
        `out`; returns llama_decode's code and the times."""
        n = len(slots)
        self._rows[:n] = slots
        t0 = time.perf_counter()
        rc = self._lib.onegpu_decode_sample(self._ptr, n, self._rows.ctypes.data,
                                            self.out.ctypes.data)  # fmt: skip
        t1 = time.perf_counter()  # CLOCK_MONOTONIC, as the C side's clock_gettime
        c = self._call
        return rc, NativeTimes(
            decode_s=c.t_decoded - t0, sample_s=c.t_sampled - c.t_masked,
            gil_s=max(0.0, t1 - c.t_sampled), mask_wait_s=max(0.0, c.t_masked - c.t_decoded),
        )  # fmt: skip

    def close(self) -> None:
        """Stop the sampling threads (the C side starts them on first use)."""
        self._lib.onegpu_close(self._ptr)

    def sample(self, logits: np.ndarray, slots: list[int]) -> np.ndarray:
        """Sample rows of a [rows, n_vocab] float32 matrix (tests and benchmarks)."""
        x = np.array(logits, dtype=np.float32, order="C")  # a copy: rows change in place
        n = len(slots)
        self._rows[:n] = slots
        out = np.zeros(n, dtype=np.int32)
        self._lib.onegpu_sample(self._ptr, x.ctypes.data, n, self._rows.ctypes.data,
                                out.ctypes.data)  # fmt: skip
        return out
