"""One llama.cpp context on a loaded model: a KV cache plus its own compute buffers.

A server holds one context for the shared (fast) lane and, when asked, a second one for
the reproducible lane; both read the same weights.

Device greedy: plain greedy requests (no penalties, no logprobs) are the common case, and
at 32 users taking `argmax` on the host means copying 32 rows of logits (19 MB at a 152K
vocabulary) off the GPU and scanning them each step. llama.cpp can instead run a sampler
chain inside the graph (backend sampling) and hand back one token id per row. Attaching a
sampler re-reserves the scheduler's graphs, so it is done once, at creation: seq ids
`[P, 2P)` carry a greedy chain for their whole life, `[0, P)` carry none. The engine gives
each request the id `s` or `s + P` by its sampling parameters; the scheduler never sees it.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

from engine.errors import ModelLoadError
from engine.expert_tap import ExpertTap

log = logging.getLogger(__name__)

LLAMA_MAX_SEQ = 256  # llama.cpp's compile-time bound on sequence ids
_FLASH = {"auto": -1, "off": 0, "on": 1}


class Context:
    """A llama.cpp context; `close()` frees it (the model stays loaded)."""

    def __init__(
        self,
        ll: Any,
        model: Any,
        *,
        n_ctx: int,
        n_seq_max: int,
        n_batch: int,
        n_ubatch: int,
        threads: tuple[int, int],
        flash_attn: str,
        unified: bool,
        device_greedy: bool,
        swa_full: bool = False,
        tap: ExpertTap | None = None,
        score_rows: int = 0,
    ) -> None:
        self.ll = ll
        self.tap = tap  # router-choice telemetry (engine.expert_tap); the context borrows it
        self.n_slots = n_seq_max  # sequences the scheduler may run at once
        if device_greedy and 2 * n_seq_max > LLAMA_MAX_SEQ:
            log.warning("device greedy off: 2 x %d sequences exceed %d", n_seq_max, LLAMA_MAX_SEQ)
            device_greedy = False
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = min(n_ubatch, n_batch)
        cparams.n_seq_max = 2 * n_seq_max if device_greedy else n_seq_max
        # A step outputs one row per sequence at most (its last token), and llama.cpp sizes
        # the compute buffer's logits for n_outputs_max rows (default: n_batch). At 512-row
        # ubatches and a 152K vocabulary that is 297 MiB of VRAM for 32 users' 19. llama.cpp
        # asserts (aborts) that a batch's outputs, and its own n_seq_max, stay within it:
        # the runner refuses a batch with more outputs than `n_outputs_max` first. (So the
        # prefix cache's holder ids, which never output, cost a row each too.) A prompt's
        # own logprobs need a row per token: `score_rows` of them in a call of their own.
        cparams.n_outputs_max = max(cparams.n_seq_max, score_rows)
        self.n_outputs_max = cparams.n_outputs_max
        cparams.n_threads, cparams.n_threads_batch = threads
        cparams.flash_attn_type = _FLASH[flash_attn]
        cparams.kv_unified = unified
        # Sliding-window layers keep whole prefixes for the prefix cache: cells shared by
        # two sequences are never overwritten, so the window cache may need every cell.
        cparams.swa_full = swa_full
        cparams.no_perf = True
        if tap is not None:
            tap.attach(cparams)
        self._chains: list[Any] = []
        if device_greedy:
            configs = (ll.llama_sampler_seq_config * n_seq_max)()
            for i in range(n_seq_max):
                chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
                ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_greedy())
                self._chains.append(chain)
                configs[i].seq_id = n_seq_max + i
                configs[i].sampler = ctypes.cast(chain, ctypes.c_void_p)
            cparams.samplers = ctypes.cast(configs, ctypes.POINTER(ll.llama_sampler_seq_config))
            cparams.n_samplers = n_seq_max
        self.ctx = ll.llama_init_from_model(model, cparams)
        if not self.ctx:
            self._free_chains()
            raise ModelLoadError("llama.cpp could not create a context (out of memory?)")
        if tap is not None:
            tap.bind(self.ctx)
        self.device_greedy = device_greedy
        self.memory = ll.llama_get_memory(self.ctx)
        self.n_ctx: int = ll.llama_n_ctx(self.ctx)
        self.n_batch: int = ll.llama_n_batch(self.ctx)

    def seq_rm(self, seq_id: int) -> None:
        """Drop every KV cell of a (llama.cpp) sequence id."""
        self.ll.llama_memory_seq_rm(self.memory, seq_id, -1, -1)

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position stored for a (llama.cpp) sequence id; -1 when it holds none."""
        return int(self.ll.llama_memory_seq_pos_max(self.memory, seq_id))

    def close(self) -> None:
        if self.ctx:
            self.ll.llama_free(self.ctx)
            self.ctx = None
        self._free_chains()

    def _free_chains(self) -> None:
        for chain in self._chains:  # the context only borrowed them
            self.ll.llama_sampler_free(chain)
        self._chains.clear()
