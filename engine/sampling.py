"""Per-sequence token sampling: native rows, llama.cpp sampler chains, logprobs.

Every request without penalties is sampled by the step's native code
(`engine.native_step`: greedy argmax, or top-k / top-p / min-p / temperature draws with
a per-request random state), inside the same ctypes call as `llama_decode`. Requests with
penalties run their own llama.cpp chain, one per sequence, spread over worker threads (a
chain over a 150K-260K vocabulary costs ~0.5 ms of CPU, ctypes releases the GIL for the
call). Plain greedy requests may instead be sampled on the device when the context
carries device greedy chains (`engine.context`). Logprobs come from the logits row
(log-softmax), as OpenAI reports the model's own distribution.

Constrained sequences (`SamplingParams.grammar`) have a matcher each (`engine.grammar`):
`prepare` writes their rows of token masks on a worker thread while `llama_decode` runs
(the matcher releases the GIL; the native step waits for them after decoding), the
native step sets disallowed logits to -inf in place before anything samples the row, and
`finish` gives each matcher its sampled token. Their logprobs are therefore over the
allowed tokens (vLLM does the same).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from engine.errors import BackendError, GrammarError
from engine.grammar import Constraint, Grammars
from engine.native_step import ROW_GREEDY, ROW_PYTHON, NativeStep, native_mode
from engine.step_types import Sampled, SamplingParams, SeqStart

log = logging.getLogger(__name__)

PENALTY_LAST_N = 64
_RANDOM_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: llama.cpp picks a random seed


class SamplerBank:
    """Per live sequence: its settings in the native step's slot arrays, and a llama.cpp
    chain only when it has penalties."""

    def __init__(
        self, ll: Any, ctx: Any, n_vocab: int, native: NativeStep, n_threads: int = 1,
        device_greedy: bool = False, grammars: Grammars | None = None,
    ) -> None:  # fmt: skip
        self.ll = ll
        self.grammars = grammars
        self._constraints: dict[int, Constraint] = {}
        self._dormant: dict[int, tuple[Constraint, int]] = {}  # lazy ones, and their trigger
        self._min_left: dict[int, int] = {}  # tokens until end tokens are allowed
        self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="masks")
        self._masks: Any = None  # this step's mask job (a future), if any
        self.mask_work = (0, 0.0)  # the last step's masks: how many, seconds on the thread
        self.native = native
        self.ctx = ctx
        self.n_vocab = n_vocab
        self.device_greedy = device_greedy
        self._on_device: set[int] = set()
        self._chains: dict[int, Any] = {}
        self._params: dict[int, SamplingParams] = {}
        self._pool = (
            ThreadPoolExecutor(n_threads, thread_name_prefix="sampler") if n_threads > 1 else None
        )

    def start(self, s: SeqStart) -> bool:
        """Set up a sequence's sampling; True when the device samples it (see `engine.context`)."""
        self.release(s.seq_id)
        p = s.params
        self._params[s.seq_id] = p
        mode = native_mode(p)
        if p.grammar is not None:
            if self.grammars is None:
                raise GrammarError("this engine has no grammar support")
            c = self.grammars.constraint(p.grammar)
            # a restarted sequence goes on where it was; a lazy grammar from its trigger
            trigger = p.grammar_trigger
            if trigger is not None and trigger not in s.history:
                self._dormant[s.seq_id] = (c, trigger)
            else:
                c.consume(
                    s.history[s.history.index(trigger) :] if trigger is not None else s.history
                )
                self._constraints[s.seq_id] = c
                self.native.masked[s.seq_id] = 1
        elif mode == ROW_GREEDY and self.device_greedy and not p.logprobs and not p.needs_host_row:
            self._on_device.add(s.seq_id)
            return True
        # A restarted sequence skips the draws its tokens took: a seeded request goes on
        # as if it had never been preempted.
        self.native.set_slot(s.seq_id, p, mode, skip=len(s.history))
        if len(s.history) < p.min_tokens:
            self._min_left[s.seq_id] = p.min_tokens - len(s.history)
        if mode == ROW_PYTHON:
            chain = self._build(p)
            for tok in s.history:
                self.ll.llama_sampler_accept(chain, tok)
            self._chains[s.seq_id] = chain
        return False

    def release(self, seq_id: int) -> None:
        self._constraints.pop(seq_id, None)
        self._dormant.pop(seq_id, None)
        self._min_left.pop(seq_id, None)
        self._on_device.discard(seq_id)
        self.native.clear_slot(seq_id)
        chain = self._chains.pop(seq_id, None)
        if chain is not None:
            self.ll.llama_sampler_free(chain)
        self._params.pop(seq_id, None)

    def close(self) -> None:
        for seq_id in list(self._chains):
            self.release(seq_id)
        self._constraints.clear()
        self._dormant.clear()
        self._mask_thread.shutdown()
        if self._pool is not None:
            self._pool.shutdown()

    def prepare(self, want: list[tuple[int, int]]) -> None:
        """Before the step's native call: start writing the masks of the constrained
        sequences it samples, on the mask thread (the native step waits for them after
        decoding, so they cost nothing while they take less than the decode)."""
        rows = [(seq_id, c) for seq_id, _ in want if (c := self._constraints.get(seq_id))]
        self.mask_work = (len(rows), 0.0)
        if not rows:
            return
        self.native.masks_pending()
        self._masks = self._mask_thread.submit(self._fill, rows)

    def abandon(self) -> None:
        """The step failed before sampling: let its mask job finish (it must not mark the
        next step's masks ready)."""
        if self._masks is not None:
            job, self._masks = self._masks, None
            job.exception()  # waits; the step's failure is what gets reported

    def _fill(self, rows: list[tuple[int, Constraint]]) -> None:
        t0 = time.perf_counter()
        try:
            for seq_id, c in rows:
                try:
                    c.fill(self.native.mask[seq_id])
                except Exception:  # one sequence's grammar failing ends that one only
                    log.exception("grammar mask of sequence %d failed: it ends", seq_id)
                    self.native.allow_only_end(seq_id)
        finally:
            self.mask_work = (len(rows), time.perf_counter() - t0)
            self.native.masks_ready()  # never leave the step waiting

    def _build(self, p: SamplingParams) -> Any:
        ll = self.ll
        chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        add = ll.llama_sampler_chain_add
        if p.has_penalties:
            add(
                chain,
                ll.llama_sampler_init_penalties(
                    self.n_vocab,
                    PENALTY_LAST_N,
                    p.repetition_penalty,
                    p.frequency_penalty,
                    p.presence_penalty,
                ),
            )
        if p.is_greedy:
            add(chain, ll.llama_sampler_init_greedy())
            return chain
        if p.top_k > 0:
            add(chain, ll.llama_sampler_init_top_k(p.top_k))
        if p.top_p < 1.0:
            add(chain, ll.llama_sampler_init_top_p(p.top_p, 1))
        if p.min_p > 0.0:
            add(chain, ll.llama_sampler_init_min_p(p.min_p, 1))
        add(chain, ll.llama_sampler_init_temp(p.temperature))
        # llama.cpp takes 0xFFFFFFFF as "pick a random seed": no seed may map there (a
        # reproducible request with seed -1 would draw differently every time)
        seed = _RANDOM_SEED if p.seed is None else p.seed % _RANDOM_SEED
        add(chain, ll.llama_sampler_init_dist(seed))
        return chain

    def params(self, seq_id: int) -> SamplingParams:
        return self._params[seq_id]

    def finish(self, want: list[tuple[int, int]], native_out: np.ndarray) -> dict[int, Sampled]:
        """The step's tokens: `native_out[j]` for row j of `want` ((seq_id, batch index), in
        batch order) where the native code sampled it, else the device's token or the
        sequence's chain; logprobs from the raw logits row where asked for.

        llama.cpp keeps output rows in batch order, so row j of `llama_get_logits` belongs
        to want[j].
        """
        if self._masks is not None:
            job, self._masks = self._masks, None
            job.result()  # the step waited for it: done; raises what it raised
        if not want:
            return {}
        tokens: list[int] = native_out[: len(want)].tolist()
        params = self._params
        rows: np.ndarray | None = None
        if self._chains or any(params[s].logprobs for s, _ in want):
            ptr = self.ll.llama_get_logits(self.ctx)
            rows = np.ctypeslib.as_array(ptr, shape=(len(want), self.n_vocab))  # [N, V]
        jobs: list[tuple[int, tuple[Any, int]]] = []  # (row, (chain, batch index))
        for j, (seq_id, i) in enumerate(want):
            if tokens[j] >= 0:
                continue
            if seq_id in self._on_device:
                tokens[j] = self._device_token(i)
            else:
                jobs.append((j, (self._chains[seq_id], i)))
        if jobs:
            if self._pool is not None and len(jobs) > 1:
                picks = list(self._pool.map(self._sample_chain, [job for _, job in jobs]))
            else:
                picks = [self._sample_chain(job) for _, job in jobs]
            for (j, _), tok in zip(jobs, picks, strict=True):
                tokens[j] = tok
        for j, (seq_id, _) in enumerate(want):
            lazy = self._dormant.get(seq_id)
            if lazy is not None and tokens[j] == lazy[1]:  # the call starts: masks from now
                self._constraints[seq_id] = lazy[0]
                del self._dormant[seq_id]
                self.native.masked[seq_id] = 1
            c = self._constraints.get(seq_id)
            if c is not None:
                c.consume([tokens[j]])
            left = self._min_left.get(seq_id)
            if left is not None:
                # (a grammar that is complete allows only end tokens: it wins)
                if left <= 1 or (c is not None and c.done):
                    del self._min_left[seq_id]
                    self.native.ban_eog[seq_id] = 0
                else:
                    self._min_left[seq_id] = left - 1
        out: dict[int, Sampled] = {}
        for j, (seq_id, _) in enumerate(want):
            p = params[seq_id]
            if p.logprobs and rows is not None:
                out[seq_id] = _with_logprobs(tokens[j], rows[j], p.top_logprobs)
            else:
                out[seq_id] = Sampled(tokens[j])
        return out

    def _device_token(self, batch_idx: int) -> int:
        tok = int(self.ll.llama_get_sampled_token_ith(self.ctx, batch_idx))
        if tok < 0:
            raise BackendError(f"no device-sampled token at batch index {batch_idx}")
        return tok

    def _sample_chain(self, job: tuple[Any, int]) -> int:
        chain, batch_idx = job
        return int(self.ll.llama_sampler_sample(chain, self.ctx, batch_idx))


def prompt_logprobs(rows: np.ndarray, targets: list[int], k: int) -> list[Sampled]:
    """Row i's logprob of targets[i] (the prompt token after row i's), with the `k` most
    likely: what OpenAI's echo + logprobs reports for a prompt. The rows at once, in
    float32 with float64 sums: a 512-token prompt of a 262K vocabulary is 134M logits."""
    n = len(targets)
    x = rows[:n]
    m = x.max(axis=1)
    lse = m.astype(np.float64) + np.log(np.exp(x - m[:, None]).sum(axis=1, dtype=np.float64))
    picked = x[np.arange(n), np.asarray(targets)].astype(np.float64) - lse
    top: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    if k > 0:
        idx = np.argpartition(-x, k - 1, axis=1)[:, :k]
        for i in range(n):
            order = idx[i][np.argsort(-x[i, idx[i]], kind="stable")]
            top[i] = [(int(j), float(x[i, j] - lse[i])) for j in order]
    return [Sampled(t, float(picked[i]), top[i]) for i, t in enumerate(targets)]


def _with_logprobs(token: int, row: np.ndarray, k: int) -> Sampled:
    """Log-softmax of the raw logits: the chosen token's logprob and the `k` most likely."""
    x = row.astype(np.float64)  # [V]
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    top: list[tuple[int, float]] = []
    if k > 0:
        idx = np.argpartition(-x, k - 1)[:k]
        idx = idx[np.argsort(-x[idx], kind="stable")]
        # (a constrained row's disallowed tokens are -inf: never among the likely ones)
        top = [(int(i), float(x[i] - lse)) for i in idx if np.isfinite(x[i])]
    return Sampled(token, float(x[token] - lse), top)
