"""The engine's one step call: fill one `llama_batch`, `llama_decode`, sample.

The batch's memory is ours (numpy arrays allocated once for `n_batch` tokens), so filling
it is a few vectorised copies per chunk, not a Python loop per token.
"""

from __future__ import annotations

import ctypes
import logging
import time

import numpy as np

from engine.errors import InvalidBatch, raise_for_decode
from engine.model import Model
from engine.sampling import SamplerBank
from engine.step_types import StepBatch, StepResult

log = logging.getLogger(__name__)


class Engine:
    """Runs steps on one model. Not thread-safe: call `step` from one thread only."""

    def __init__(self, model: Model) -> None:
        self.model = model
        ll = model.ll
        self.ll = ll
        n = model.n_batch
        self.n_batch = n
        self._tok = np.zeros(n, dtype=np.int32)
        self._pos = np.zeros(n, dtype=np.int32)
        self._nseq = np.ones(n, dtype=np.int32)
        self._seq = np.zeros(n, dtype=np.int32)
        self._out = np.zeros(n, dtype=np.int8)
        seq_ptr_t = ctypes.POINTER(ll.llama_seq_id)
        base = self._seq.ctypes.data
        self._seq_ptrs = (seq_ptr_t * n)(*[ctypes.cast(base + 4 * i, seq_ptr_t) for i in range(n)])
        self._batch = ll.llama_batch()
        self._batch.token = self._tok.ctypes.data_as(ctypes.POINTER(ll.llama_token))
        self._batch.embd = None
        self._batch.pos = self._pos.ctypes.data_as(ctypes.POINTER(ll.llama_pos))
        self._batch.n_seq_id = self._nseq.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self._batch.seq_id = ctypes.cast(self._seq_ptrs, ctypes.POINTER(seq_ptr_t))
        self._batch.logits = self._out.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.sampler = SamplerBank(ll, model.ctx, model.n_vocab, model.cfg.threads()[1])

    def step(self, batch: StepBatch) -> StepResult:
        """Release finished sequences, start new ones, decode the batch, sample.

        Raises `InvalidBatch` before submitting anything llama.cpp would abort on, and the
        typed errors of `raise_for_decode` for the backend's return codes.
        """
        t_start = time.perf_counter()
        for seq_id in batch.released:
            self.model.seq_rm(seq_id)
            self.sampler.release(seq_id)
        for s in batch.starts:
            self.model.seq_rm(s.seq_id)
            self.sampler.start(s)
        n = batch.num_tokens
        if n == 0:
            return StepResult({})
        if n > self.n_batch:
            raise InvalidBatch(f"{n} tokens exceed n_batch={self.n_batch}")
        want: list[tuple[int, int]] = []  # (seq_id, batch index of its last token)
        toks: list[int] = []
        pos: list[int] = []
        seqs: list[int] = []
        for c in batch.chunks:  # plain lists, then one numpy copy per field
            k = len(c.tokens)
            toks += c.tokens
            pos += range(c.pos0, c.pos0 + k)
            seqs += [c.seq_id] * k
            if c.sample:
                want.append((c.seq_id, len(toks) - 1))
        self._tok[:n] = toks
        self._pos[:n] = pos
        self._seq[:n] = seqs
        self._out[:n] = 0
        self._out[[i for _, i in want]] = 1
        self._batch.n_tokens = n
        t0 = time.perf_counter()
        rc = self.ll.llama_decode(self.model.ctx, self._batch)
        raise_for_decode(rc)
        # GPU backends return before the graph has run; wait here so decode_s is the
        # compute and the rest of the step is truly ours.
        self.ll.llama_synchronize(self.model.ctx)
        t1 = time.perf_counter()
        sampled = self.sampler.sample_all(want)
        return StepResult(
            sampled, fill_s=t0 - t_start, decode_s=t1 - t0, sample_s=time.perf_counter() - t1
        )

    def close(self) -> None:
        self.sampler.close()
