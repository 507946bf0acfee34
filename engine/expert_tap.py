"""Sampled reads of the MoE router's choices: per-layer, per-expert pick counts.

The counting happens in a small C callback (`engine/native/expert_tap.c`, built by
`make`) that llama.cpp's graph scheduler calls for every node; see that file for why it
cannot be Python. This module loads it, owns the memory it writes into (numpy arrays, so
reading the counts costs no copy through ctypes) and decides which steps are sampled.

Off (rate 0) the context gets no callback at all, so telemetry off costs nothing. On, the
callback is given to the context (so that llama.cpp re-installs it whenever it rebuilds
the graph) but taken off its graph scheduler before every unarmed step, through
`ggml_backend_sched_set_eval_callback` on the scheduler `llama_context::get_sched()`
returns. That matters on the GPU: with any callback installed the scheduler runs each
split as a graph *view* without the graph's id and synchronises after it, which costs
ggml-cuda its CUDA-graph fast path (measured on the H200: 4-12% slower steps at one user
with the callback left on). An armed step is cut at each MoE layer's router output,
synchronised and read back, and the chunks make ggml-cuda re-capture its CUDA graph on
the next step or two: that, not the counting, is what a sampled step costs, so `rate` —
the share of steps armed — stays small (the server's default: docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import ModelLoadError
from engine.placement import libggml

log = logging.getLogger(__name__)

LIBRARY = Path(__file__).parent / "native" / "libexpert_tap.so"


class _TapState(ctypes.Structure):  # mirrors struct expert_tap in expert_tap.c
    _fields_ = [
        ("get_name", ctypes.c_void_p),
        ("nbytes", ctypes.c_void_p),
        ("tensor_get", ctypes.c_void_p),
        ("armed", ctypes.c_int32),
        ("n_layer", ctypes.c_int32),
        ("n_expert", ctypes.c_int32),
        ("buf_len", ctypes.c_int32),
        ("counts", ctypes.c_void_p),
        ("buf", ctypes.c_void_p),
        ("reads", ctypes.c_int64),
        ("skipped", ctypes.c_int64),
        ("calls", ctypes.c_int64),
    ]


# `ggml_backend_sched_t llama_context::get_sched() const`: exported by libllama; a const
# member function takes `this` (the C API's `llama_context *`) as its only argument.
_GET_SCHED = "_ZNK13llama_context9get_schedEv"


class ExpertTap:
    """Pick counts of one context's MoE layers; `attach` before the context is created."""

    def __init__(
        self, ll: Any, *, n_layer: int, n_expert: int, n_ubatch: int,
        rate: float,
    ) -> None:  # fmt: skip
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"expert sample rate must be in (0, 1], got {rate}")
        if not LIBRARY.is_file():
            raise ModelLoadError(
                f"expert telemetry needs {LIBRARY.name}: run `make` (or set the sample rate to 0)"
            )
        self._lib = ctypes.CDLL(str(LIBRARY))
        base = libggml(ll)  # its handle also finds libggml-base's symbols (dlsym searches deps)
        self.counts = np.zeros((n_layer, n_expert), dtype=np.int64)
        self._buf = np.zeros(n_expert * n_ubatch, dtype=np.int32)  # a view spans argsort rows
        s = self._state = _TapState()
        s.get_name = ctypes.cast(base.ggml_get_name, ctypes.c_void_p).value
        s.nbytes = ctypes.cast(base.ggml_nbytes, ctypes.c_void_p).value
        s.tensor_get = ctypes.cast(base.ggml_backend_tensor_get, ctypes.c_void_p).value
        s.n_layer, s.n_expert, s.buf_len = n_layer, n_expert, len(self._buf)
        s.counts = self.counts.ctypes.data
        s.buf = self._buf.ctypes.data
        self._callback = ll.ggml_backend_sched_eval_callback(
            ctypes.cast(self._lib.onegpu_expert_tap, ctypes.c_void_p).value
        )
        self.rate = rate
        self._credit = 1.0  # the first step is sampled
        self.sampled_steps = 0
        self._set_callback = base.ggml_backend_sched_set_eval_callback
        self._set_callback.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self._set_callback.restype = None
        self._get_sched: Any = getattr(ll._lib, _GET_SCHED, None)
        if self._get_sched is not None:
            self._get_sched.argtypes = [ctypes.c_void_p]
            self._get_sched.restype = ctypes.c_void_p
        self._ctx: ctypes.c_void_p | None = None  # set by `bind` when the scheduler is reachable
        self._callback_ptr = ctypes.cast(self._callback, ctypes.c_void_p).value

    def attach(self, cparams: Any) -> None:
        """Point a `llama_context_params` at the callback (keep this object alive)."""
        cparams.cb_eval = self._callback
        cparams.cb_eval_user_data = ctypes.addressof(self._state)

    def bind(self, ctx: Any) -> None:
        """Find the scheduler of the context created with `attach`ed params, so unarmed
        steps run without the callback. Without the symbol (another llama.cpp build) the
        callback stays installed: correct, only slower on the GPU."""
        if self._get_sched is None:
            log.warning("expert telemetry: %s not exported; the callback stays on", _GET_SCHED)
            return
        self._ctx = ctypes.cast(ctx, ctypes.c_void_p)

    def before_decode(self) -> None:
        """Arm this decode when the sampling rate says so (engine thread only), and install
        or remove the callback to match. A graph llama.cpp rebuilds inside the decode gets
        the callback back from the context params: armed steps are always counted, and an
        unarmed rebuilt step merely runs with it, unarmed."""
        self._credit += self.rate
        armed = self._credit >= 1.0
        if armed:
            self._credit -= 1.0
            self.sampled_steps += 1
        self._state.armed = int(armed)
        if self._ctx is not None:
            # Asked every step: llama.cpp replaces its scheduler when it must re-reserve.
            sched = self._get_sched(self._ctx)
            if armed:
                self._set_callback(sched, self._callback_ptr, ctypes.addressof(self._state))
            else:
                self._set_callback(sched, None, None)

    @property
    def calls(self) -> int:
        """Times ggml's scheduler called the callback (flat over steps it is taken off)."""
        return int(self._state.calls)
