"""The engine's one step call: fill one `llama_batch`, `llama_decode`, sample.

The batch's memory is ours (numpy arrays allocated once for `n_batch` tokens), so filling
it is a few vectorised copies per chunk, not a Python loop per token.

Sequence ids: the scheduler's ids are slots `[0, P)`. A request the device can sample (plain
greedy) runs under llama.cpp id `s + P`, whose greedy chain lives in the graph; the others
under `s` (see `engine.context`). The mapping is fixed when the sequence starts.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np

from engine.context import Context
from engine.errors import InvalidBatch, KVCacheFull, raise_for_decode
from engine.kv_swap import SideDone, SwapStore
from engine.model import Model
from engine.native_step import NativeStep
from engine.sampling import SamplerBank, prompt_logprobs
from engine.step_types import (
    KVOp,
    Release,
    Sampled,
    SamplingParams,
    SeqChunk,
    SeqStart,
    Share,
    StepBatch,
    StepResult,
    Trim,
)  # fmt: skip

log = logging.getLogger(__name__)


class SideContext(Protocol):
    """A second context prefilling prompts beside the steps (engine.side_prefill's): the
    longest prompt it holds is `n_ctx` - 1; `on_done` is called when one ends."""

    n_ctx: int
    on_done: Callable[[], None] | None

    def submit(self, key: int, tokens: list[int]) -> None: ...

    def finished(self) -> list[SideDone]: ...

    def close(self) -> None: ...


class Engine:
    """Runs steps on one model. Not thread-safe: call `step` from one thread only."""

    def __init__(self, model: Model, context: Context | None = None, solo: bool = False) -> None:
        """`solo`: every sequence of a step is decoded in a call of its own (the
        reproducible lane); otherwise all share one `llama_decode`."""
        self.model = model
        self.context = context or model.main
        self.solo = solo
        ll = model.ll
        self.ll = ll
        self._ctx = self.context.ctx
        self._llama_id: dict[int, int] = {}  # scheduler seq id -> llama.cpp seq id
        n = self.context.n_batch
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
        threads = model.cfg.threads()[1]
        self.native = NativeStep(
            ll, self._ctx, self._batch, self.context.n_slots, model.n_vocab, threads
        )
        self.native.set_eog(model.eog_ids)
        self.sampler = SamplerBank(
            ll, self._ctx, model.n_vocab, self.native, threads, self.context.device_greedy,
            model.grammars,
        )  # fmt: skip
        self.swap = SwapStore(ll, self._ctx)
        # A second context prefilling long prompts beside the steps (engine.side_prefill):
        # the step hands it `batch.side_prefill` and puts what it finished into `swap`.
        self.side: SideContext | None = None

    def step(self, batch: StepBatch) -> StepResult:
        """Save swapped-out sequences, release finished ones, start new ones, restore
        swapped-in ones, decode the batch, sample.

        Raises `InvalidBatch` before submitting anything llama.cpp would abort on, and the
        typed errors of `raise_for_decode` for the backend's return codes. A sequence whose
        KV could not be restored is left out of the step and named in the result.
        """
        t_start = time.perf_counter()
        for key, tokens in batch.side_prefill:
            if self.side is None:
                raise InvalidBatch("a side prefill asked of an engine without a side context")
            self.side.submit(key, tokens)
        ids = self._llama_id
        saved, lost_out = 0, []
        for seq_id, key in batch.swap_out:
            n = self.swap.save(key, ids.get(seq_id, seq_id))
            saved += n
            if not n:
                lost_out.append(key)
        t_saved = time.perf_counter()
        for seq_id in batch.released:
            self.context.seq_rm(ids.pop(seq_id, seq_id))
            self.sampler.release(seq_id)
        for s in batch.starts:
            self.context.seq_rm(ids.pop(s.seq_id, s.seq_id))
            on_device = self.sampler.start(s)
            ids[s.seq_id] = s.seq_id + self.context.n_slots if on_device else s.seq_id
        for seq_id in batch.retained:
            self.sampler.release(seq_id)
        for op in batch.kv_ops:
            self._apply(op)
        t_restore = time.perf_counter()
        restored, lost_in, chunks = 0, [], batch.chunks
        if batch.swap_in:
            lost = set()
            for key, seq_id in batch.swap_in:
                n = self.swap.restore(key, ids.get(seq_id, seq_id))
                restored += n
                if not n:
                    lost_in.append(key)
                    lost.add(seq_id)
            chunks = [c for c in chunks if c.seq_id not in lost]
        for key in batch.swap_drop:
            self.swap.drop(key)
        t_swapped = time.perf_counter()
        # the step's fill time excludes the copies (the stall cost model must not learn them)
        result = self._run(chunks, t_saved + (t_swapped - t_restore))
        result.swap_out_s, result.swap_in_s = t_saved - t_start, t_swapped - t_restore
        result.swap_out_bytes, result.swap_in_bytes = saved, restored
        result.swap_out_failed, result.swap_in_failed = lost_out, lost_in
        result.side_done = self._side_done()
        return result

    def _side_done(self) -> list[tuple[int, bool]]:
        """The side prefills that ended: their KV joins the swap store, from which the
        step that admits their requests again restores it."""
        if self.side is None:
            return []
        done = []
        for d in self.side.finished():
            if d.kv is not None:
                self.swap.put(d.key, d.kv)
            done.append((d.key, d.kv is not None))
        return done

    def _apply(self, op: KVOp) -> None:
        """One change the prefix index asked for, on llama.cpp sequence ids."""
        ids, mem = self._llama_id, self.context.memory
        if isinstance(op, Share):
            src, dst = ids.get(op.src, op.src), ids.get(op.dst, op.dst)
            self.ll.llama_memory_seq_cp(mem, src, dst, op.p0, op.p1)
        elif isinstance(op, Trim):
            self.ll.llama_memory_seq_rm(mem, ids.get(op.seq, op.seq), op.p0, op.p1)
        else:
            assert isinstance(op, Release)
            self.context.seq_rm(ids.pop(op.seq, op.seq))
            self.sampler.release(op.seq)

    def _run(self, chunks: list[SeqChunk], t_start: float) -> StepResult:
        scored: dict[int, list[Sampled]] = {}
        if not any(c.targets for c in chunks):
            return self._run_chunks(chunks, t_start)
        done: list[SeqChunk] = []  # chunks whose scoring call went into the KV
        try:
            rest = []
            for c in chunks:
                rest.append(self._score(c, scored))
                done.append(c)
            result = self._run_chunks([c for c in rest if c.tokens], t_start)
        except KVCacheFull:
            # the scheduler retries the step as it was: the scored positions go again
            for c in done:
                if c.targets:
                    self.ll.llama_memory_seq_rm(
                        self.context.memory, self._llama_id.get(c.seq_id, c.seq_id), c.pos0, -1
                    )
            raise
        result.prompt_logprobs = scored
        return result

    def _score(self, chunk: SeqChunk, scored: dict[int, list[Sampled]]) -> SeqChunk:
        """Prompt logprobs: the chunk's first len(targets) tokens in a call of their own
        with a logit row each (a step's main call has one row per sequence, and the native
        sampler reads rows in that order); returns what is left of the chunk for the main
        call (its last token when it samples, else nothing)."""
        targets = chunk.targets
        if not targets:
            return chunk
        k = len(targets)
        if k > self.context.n_outputs_max:
            raise InvalidBatch(
                f"{k} prompt logprob rows exceed the {self.context.n_outputs_max} outputs "
                "a call may have"
            )
        ids = self._llama_id
        self._tok[:k] = chunk.tokens[:k]
        self._pos[:k] = range(chunk.pos0, chunk.pos0 + k)
        self._seq[:k] = ids.get(chunk.seq_id, chunk.seq_id)
        self._out[:k] = 1
        self._batch.n_tokens = k
        rc, _ = self.native.decode_sample([])
        raise_for_decode(rc)
        ptr = self.ll.llama_get_logits(self._ctx)
        rows = np.ctypeslib.as_array(ptr, shape=(k, self.model.n_vocab))
        top = self.sampler.params(chunk.seq_id).prompt_logprobs or 0
        scored[chunk.seq_id] = prompt_logprobs(rows, targets, top)
        return SeqChunk(chunk.seq_id, chunk.tokens[k:], chunk.pos0 + k, chunk.sample)

    def _run_chunks(self, chunks: list[SeqChunk], t_start: float) -> StepResult:
        if not chunks:
            return StepResult({}, fill_s=time.perf_counter() - t_start)
        if not self.solo:
            return self._decode(chunks, t_start)
        # Reproducible lane: each sequence alone in its own llama_decode, so its numerics
        # depend on nothing but itself (FINDINGS, "Determinism").
        result = StepResult({}, fill_s=0.0)
        for c in chunks:
            part = self._decode([c], t_start)
            result.sampled.update(part.sampled)
            result.fill_s += part.fill_s
            result.decode_s += part.decode_s
            result.sample_s += part.sample_s
            result.gil_s += part.gil_s
            result.mask_wait_s += part.mask_wait_s
            result.masks += part.masks
            result.mask_s += part.mask_s
            t_start = time.perf_counter()
        return result

    def _decode(self, chunks: list[SeqChunk], t_start: float) -> StepResult:
        ids = self._llama_id
        n = sum(len(c.tokens) for c in chunks)
        if n > self.n_batch:
            raise InvalidBatch(f"{n} tokens exceed n_batch={self.n_batch}")
        want: list[tuple[int, int]] = []  # (seq_id, batch index of its last token)
        toks: list[int] = []
        pos: list[int] = []
        seqs: list[int] = []
        for c in chunks:  # plain lists, then one numpy copy per field
            if not 0 <= c.seq_id < self.context.n_slots:
                raise InvalidBatch(f"seq id {c.seq_id} outside [0, {self.context.n_slots})")
            k = len(c.tokens)
            toks += c.tokens
            pos += range(c.pos0, c.pos0 + k)
            seqs += [ids.get(c.seq_id, c.seq_id)] * k
            if c.sample:
                want.append((c.seq_id, len(toks) - 1))
        if len(want) > self.context.n_slots:
            raise InvalidBatch(
                f"{len(want)} sampled chunks exceed the {self.context.n_slots} outputs "
                "a step may have (one per sequence)"
            )
        self._tok[:n] = toks
        self._pos[:n] = pos
        self._seq[:n] = seqs
        self._out[:n] = 0
        self._out[[i for _, i in want]] = 1
        self._batch.n_tokens = n
        tap = self.context.tap
        if tap is not None:
            tap.before_decode()
        t0 = time.perf_counter()
        self.sampler.prepare(want)  # constrained sequences' masks, written while it decodes
        # Decode, wait for the device (so decode_s is the compute), sample: one native call.
        rc, times = self.native.decode_sample([seq_id for seq_id, _ in want])
        if rc != 0:
            self.sampler.abandon()
        raise_for_decode(rc)
        t1 = time.perf_counter()
        sampled = self.sampler.finish(want, self.native.out)
        masks, mask_s = self.sampler.mask_work
        return StepResult(
            sampled, fill_s=t0 - t_start, decode_s=times.decode_s,
            sample_s=times.sample_s + time.perf_counter() - t1, gil_s=times.gil_s,
            mask_wait_s=times.mask_wait_s, masks=masks, mask_s=mask_s,
        )  # fmt: skip

    def warm_up(self, prompt_tokens: int = 128, decode_steps: int = 2) -> float:
        """Run two sequences through the step call before anyone is served — a greedy and
        a sampled one, a prompt of `prompt_tokens` each, then `decode_steps` decode steps —
        and drop their KV and samplers. What a backend does the first time it meets a shape
        (a GPU backend loads each kernel at its first launch and builds graphs and buffers
        per batch shape; the step sizes its sampling rows) then happens here, not in the
        first user's time to first token (on an H100, one of the first two 128-token
        requests after a start waited 163 ms for it against 49 for the other). Returns the
        seconds it took."""
        t0 = time.perf_counter()
        n = max(1, min(prompt_tokens, self.n_batch // 2, self.context.n_ctx // 4))
        vocab = self.model.n_vocab
        prompt = [(100 + i) % vocab for i in range(n)]
        seqs = (0, 1) if self.context.n_slots > 1 else (0,)
        params = {0: SamplingParams(temperature=0.0), 1: SamplingParams(temperature=0.8)}
        starts = [SeqStart(s, params[s]) for s in seqs]
        res = self.step(StepBatch([SeqChunk(s, prompt, 0, True) for s in seqs], starts=starts))
        for pos in range(n, n + decode_steps):
            chunks = [SeqChunk(s, [res.sampled[s].token], pos, True) for s in seqs]
            res = self.step(StepBatch(chunks))
        self.step(StepBatch([], released=list(seqs)))
        return time.perf_counter() - t0

    def llama_seq(self, seq_id: int) -> int:
        """The llama.cpp sequence id a scheduler sequence id runs as."""
        return self._llama_id.get(seq_id, seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest KV position of a scheduler sequence id; -1 when it holds none."""
        return self.context.seq_pos_max(self._llama_id.get(seq_id, seq_id))

    def close(self) -> None:
        if self.side is not None:
            self.side.close()
        self.swap.clear()
        self.sampler.close()
        self.native.close()
