"""The scheduler core: which tokens go into the next step, and what a step's tokens mean.

Synchronous and pure (no I/O, asyncio, ctypes or metrics): `schedule()` builds the next
`StepBatch`, `postprocess()` folds the engine's `StepResult` back into request state and
returns each request's stream delta plus the step's stats. Time is passed in, never read.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.step_types import Sampled, SeqChunk, SeqStart, StepBatch, StepResult
from scheduler.budget import StepCostModel, StepTimeBudget
from scheduler.kv import GrowthEstimate, KVPool
from scheduler.request import Request, RequestOutput, RequestStatus
from scheduler.stats import FinishedStats, StepStats


class QueueFull(Exception):
    """The waiting queue, or the sender's share of it, is full; the caller should retry."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int  # sequences decoding at once (llama.cpp seq ids)
    kv_capacity: int  # KV cells shared by all sequences
    max_num_batched_tokens: int  # tokens per step, at most the context's n_batch
    max_waiting: int = 256  # queued sequences beyond which add_group() refuses
    max_prefill_chunk: int | None = None  # cap on one prompt chunk (None = the step budget)
    kv_watermark: int = 0  # cells kept free when admitting, so decoders are not preempted
    reserve_growth: bool = True  # admission keeps cells for the running requests' growth
    max_stall_s: float | None = None  # target step time while others decode (None = off)
    min_prefill_chunk: int = 32  # prompt tokens a step always grants: prefill progresses
    ubatch: int = 0  # llama.cpp's physical batch: bounded steps avoid a short last one
    attention_tile: int = 0  # query rows per attention tile (ggml CPU: 64), the same


@dataclass(slots=True)
class SchedulerOutput:
    """The step to run: `batch` for the engine, `reqs[i]` owning `batch.chunks[i]`."""

    batch: StepBatch
    reqs: list[Request] = field(default_factory=list)
    num_preempted: int = 0
    num_decode: int = 0  # decode tokens in the batch
    prompt_chunks: list[tuple[int, int]] = field(default_factory=list)  # (tokens, KV depth)
    bounded: bool = False  # its prompt chunks were sized for the stall target

    @property
    def is_empty(self) -> bool:
        b = self.batch
        return not (b.chunks or b.released or b.starts)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig) -> None:
        if cfg.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        self.cfg = cfg
        self.pool = KVPool(cfg.kv_capacity, cfg.max_num_seqs)
        self.growth = GrowthEstimate(cfg.reserve_growth)
        self._recomputed = 0  # tokens preemption threw away since the last stats
        self.cost = StepCostModel(cfg.ubatch, cfg.attention_tile)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._by_id: dict[str, Request] = {}
        self._aborts: set[str] = set()
        self._released: list[int] = []
        self._finished: list[FinishedStats] = []  # finished outside a step (aborts)
        # Set when the backend refused KV our accounting allowed: admit nobody new until a
        # request finishes (real room) or nothing runs, or the refusal repeats forever.
        self._kv_backoff = False

    # ---- inputs ----------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.add_group([req])

    @property
    def max_group(self) -> int:
        """The most sequences one client may ever hold in the queue: a larger request can
        never be queued (the API refuses it with a 400, not a 429 to retry)."""
        return max(1, self.cfg.max_waiting // 2)

    def add_group(self, reqs: Sequence[Request]) -> None:
        """Queue the sequences of one API call (its prompts × choices) together, or none
        (`QueueFull`, see `check_room`)."""
        self.check_room(reqs[0].client, len(reqs))
        for req in reqs:
            self.waiting.append(req)
            self._by_id[req.req_id] = req

    def check_room(self, client: str, k: int) -> None:
        """Raise `QueueFull` unless `client` may queue `k` more sequences now.

        Fair share: a client (its API key, else its connection) may hold at most
        `max_waiting // (n + 1)` waiting sequences, n being the clients with sequences
        waiting, itself included. One client alone can use half the queue, and a client
        over its share adds nothing while others wait, so a flood fills at most its share
        and delays its sender. What a client took under a larger share is not taken back:
        several clients that each filled their share can still fill the queue between
        them (evicting the newest waiting request of the largest holder would close that).
        """
        total = len(self.waiting)
        if total + k > self.cfg.max_waiting:
            raise QueueFull(f"{total} sequences already waiting (at most {self.cfg.max_waiting})")
        held = Counter(r.client for r in self.waiting)
        share = max(1, self.cfg.max_waiting // (len(held | {client: 1}) + 1))
        if held[client] + k > share:
            raise QueueFull(
                f"this client has {held[client]} sequences waiting; its share of the queue "
                f"is {share} while {len(held)} clients wait"
            )

    def abort(self, req_id: str, now: float) -> None:
        """A waiting request leaves the queue at once (a refused or abandoned request must
        not hold a place others could use); a running one is removed at the next
        `schedule()`, since a step may be running it right now."""
        req = self._by_id.get(req_id)
        if req is None:
            return
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
            self._finish(req, RequestStatus.FINISHED_ABORTED, now, self._finished)
        else:
            self._aborts.add(req_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborts or self._released)

    # ---- schedule --------------------------------------------------------------------
    def schedule(self, now: float, others_waiting: bool = False) -> SchedulerOutput:
        """The next step. `others_waiting`: requests of another lane wait for this step to
        end (lanes step one after the other), so it is bounded by the stall target as if
        they decoded here, and never a burst's."""
        self._apply_aborts(now)
        budget = self.cfg.max_num_batched_tokens
        plan: dict[str, tuple[Request, int]] = {}  # insertion order = batch order
        preempted = 0
        # Decoders first: every running user gets its token before any prompt chunk.
        for req in [r for r in self.running if r.is_decoding]:
            if budget < 1:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            ok, n_pre = self._reserve(req, 1, plan)
            preempted += n_pre
            if ok:
                plan[req.req_id] = (req, 1)
                budget -= 1
        n_decode = len(plan)
        budget = self.cfg.max_num_batched_tokens - n_decode
        # Prompt chunks, oldest first (FCFS), sized to keep the step under the stall target
        # — except for a burst: when every decoder has one token so far and no prefill is
        # under way, the decoders came with the prompts now waiting (a closed-loop wave: the
        # first arrival is prefilled alone while the rest arrive). Bounding the step for
        # them would stagger the burst over many steps, and every later step would mix
        # prompt work. A prefill already under way stays bounded for every decoder.
        prefilling = [r for r in self.running if not r.is_decoding and r.req_id not in plan]
        burst = (
            not prefilling
            and not others_waiting
            and all(len(r.output_ids) < 2 for r, _ in plan.values())
        )
        timer = StepTimeBudget(
            self.cost, self.cfg.max_stall_s, n_decode, self.cfg.min_prefill_chunk, burst,
            others_waiting,
        )  # fmt: skip
        for req in prefilling:
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = timer.grant(
                min(req.num_uncomputed, budget, self._chunk_cap()),
                req.num_computed,
                req.num_uncomputed,
            )
            if n < 1:
                break
            ok, n_pre = self._reserve(req, n, plan)
            preempted += n_pre
            if ok:
                plan[req.req_id] = (req, n)
                budget -= n
        budget = self.cfg.max_num_batched_tokens - sum(n for _, n in plan.values())
        starts: list[SeqStart] = []
        if not self.running:
            self._kv_backoff = False
        # A step that had to preempt admits nobody: the room it made is for the running.
        can_admit = preempted == 0 and not self._kv_backoff
        if n_decode:
            self.growth.step()
        # Admission by what a request needs: its whole uncomputed prompt (a preempted one's
        # output too) and its expected growth, beside what the running still need — never
        # by its first chunk alone, which lets a prompt in that the pool cannot finish.
        committed = self._committed()
        while can_admit and self.waiting and budget > 0 and self.pool.num_free_seqs > 0:
            req = self.waiting[0]
            n = timer.grant(
                min(req.num_uncomputed, budget, self._chunk_cap()),
                req.num_computed,
                req.num_uncomputed,
            )
            if n < 1 or self.pool.free - n < self.cfg.kv_watermark or n > self.pool.free:
                break
            need = req.num_uncomputed + self.growth.cells(req.max_tokens - len(req.output_ids))
            if self.running and self.pool.free - committed - need < self.cfg.kv_watermark:
                break
            committed += need - n
            self.waiting.popleft()
            req.seq_id = self.pool.open()
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            self.running.append(req)
            starts.append(SeqStart(req.seq_id, req.params, list(req.output_ids)))
            self.pool.grow(req.seq_id, n)
            plan[req.req_id] = (req, n)
            budget -= n

        out = SchedulerOutput(
            StepBatch([], starts, self._released), num_preempted=preempted, num_decode=n_decode,
            bounded=timer.bounded,
        )  # fmt: skip
        self._released = []
        for req, n in plan.values():
            assert req.seq_id is not None
            pos0 = req.num_computed
            chunk = SeqChunk(req.seq_id, req.tokens_from(pos0, n), pos0, pos0 + n == req.num_tokens)
            out.batch.chunks.append(chunk)
            out.reqs.append(req)
            if not (n == 1 and req.output_ids and pos0 + 1 == req.num_tokens):
                out.prompt_chunks.append((n, pos0))
        assert out.batch.num_tokens <= self.cfg.max_num_batched_tokens, "step over budget"
        self.pool.sanity_checks()
        return out

    def _committed(self) -> int:
        """Cells the running requests will still take beyond what they hold: the rest of
        their prompts and their expected growth."""
        total = 0
        for r in self.running:
            assert r.seq_id is not None
            total += max(0, r.num_tokens - self.pool.cells(r.seq_id))
            total += self.growth.cells(r.max_tokens - len(r.output_ids))
        return total

    def _chunk_cap(self) -> int:
        return self.cfg.max_prefill_chunk or self.cfg.max_num_batched_tokens

    def _reserve(
        self, req: Request, n: int, plan: dict[str, tuple[Request, int]]
    ) -> tuple[bool, int]:
        """Grow `req` by `n` cells, preempting the newest running requests if the pool is full.

        Returns (reserved, number preempted); `req` itself may be the one preempted.
        """
        preempted = 0
        while self.pool.free < n:
            self.growth.preempted()
            # the least work lost: the fewest computed tokens, the newest among equals
            victim = min(reversed(self.running), key=lambda r: r.num_computed)
            plan.pop(victim.req_id, None)
            self._preempt(victim)
            preempted += 1
            if victim is req:
                return False, preempted
        assert req.seq_id is not None
        self.pool.grow(req.seq_id, n)
        return True, preempted

    def _preempt(self, req: Request) -> None:
        """Free its KV and put it first in line; it recomputes prompt + output on resume."""
        self._release_seq(req)
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        self._recomputed += req.num_computed
        req.num_computed = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def rollback_kv_full(self, out: SchedulerOutput) -> None:
        """The backend found no KV slot despite our accounting (llama.cpp left its cache as
        before the call): undo the step's reservations and preempt the newest request."""
        for req, chunk in zip(out.reqs, out.batch.chunks, strict=True):
            if req.seq_id is not None:
                self.pool.shrink(req.seq_id, len(chunk.tokens))
        if self.running:
            self._preempt(self.running[-1])
        self._kv_backoff = True

    def _release_seq(self, req: Request) -> None:
        if req.seq_id is not None:
            self.pool.close(req.seq_id)
            self._released.append(req.seq_id)
            req.seq_id = None

    def _apply_aborts(self, now: float) -> None:
        for req_id in self._aborts:
            req = self._by_id.get(req_id)
            if req is None or req.status.is_finished:
                continue
            if req.status is RequestStatus.WAITING:
                self.waiting.remove(req)
            self._finish(req, RequestStatus.FINISHED_ABORTED, now, self._finished)
        self._aborts.clear()

    def _finish(
        self, req: Request, status: RequestStatus, now: float, into: list[FinishedStats]
    ) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self._kv_backoff = False
        self._release_seq(req)
        req.status = status
        del self._by_id[req.req_id]
        started = req.first_scheduled_time
        into.append(
            FinishedStats(
                finish_reason=status.finish_reason or "",
                num_prompt_tokens=req.num_prompt,
                num_output_tokens=len(req.output_ids),
                e2e_s=now - req.arrival_time,
                max_gap_s=req.max_gap_s if len(req.output_ids) > 1 else None,
                queue_s=None if started is None else started - req.arrival_time,
            )
        )

    # ---- postprocess -----------------------------------------------------------------
    def postprocess(
        self, out: SchedulerOutput, result: StepResult, now: float
    ) -> tuple[list[RequestOutput], StepStats]:
        """The one loop over a step's outputs: advance, append, detokenize, stop, finish."""
        engine_s = result.fill_s + result.decode_s + result.sample_s
        self.cost.observe(out.num_decode, out.prompt_chunks, engine_s, planned=out.bounded)
        stats = StepStats(
            num_step_tokens=out.batch.num_tokens,
            num_step_prompt_tokens=sum(n for n, _ in out.prompt_chunks),
            cost_model=self.cost.estimate(),
            cost_bias=self.cost.bias,
            cost_headroom=StepTimeBudget.headroom(self.cost),
            num_step_seqs=len(out.batch.chunks),
            num_preempted=out.num_preempted,
            fill_s=result.fill_s,
            decode_s=result.decode_s,
            sample_s=result.sample_s,
            gil_s=result.gil_s,
        )
        outputs: list[RequestOutput] = []
        for req, chunk in zip(out.reqs, out.batch.chunks, strict=True):
            if req.status is not RequestStatus.RUNNING:
                continue
            req.num_computed += len(chunk.tokens)
            if chunk.sample:
                outputs.append(self._append(req, result.sampled[chunk.seq_id], now, stats))
        return outputs, self._close_stats(stats)

    def fail(self, out: SchedulerOutput, now: float) -> tuple[list[RequestOutput], StepStats]:
        """The engine failed this step: end its requests with `error`, keep the rest going."""
        stats = StepStats()
        outputs = []
        for req in out.reqs:
            if req.status is RequestStatus.RUNNING:
                self._finish(req, RequestStatus.FINISHED_ERROR, now, stats.finished)
                outputs.append(self._output(req, "", [], "error"))
        return outputs, self._close_stats(stats)

    def _append(self, req: Request, s: Sampled, now: float, stats: StepStats) -> RequestOutput:
        tok = s.token
        req.output_ids.append(tok)
        stats.num_generated_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = now
            stats.ttft_s.append(now - req.arrival_time)
            if req.first_scheduled_time is not None:
                stats.queue_s.append(req.first_scheduled_time - req.arrival_time)
            stats.num_prompt_tokens += req.num_prompt
        elif req.last_token_time is not None:
            gap = now - req.last_token_time
            stats.itl_s.append(gap)
            req.max_gap_s = max(req.max_gap_s, gap)
        req.last_token_time = now

        status: RequestStatus | None = None
        hit = False
        if req.is_eog(tok):
            text = ""
            status = RequestStatus.FINISHED_STOPPED
        else:
            text, hit = req.stops.feed(req.detok.add(tok))
            if hit:
                status = RequestStatus.FINISHED_STOPPED
        if status is None and len(req.output_ids) >= req.max_tokens:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None and not hit:
            tail, hit = req.stops.feed(req.detok.flush())
            text += tail if hit else tail + req.stops.flush()
            if hit:
                status = RequestStatus.FINISHED_STOPPED
        logprobs = [s] if req.params.logprobs else []
        if status is not None:
            self._finish(req, status, now, stats.finished)
        return self._output(req, text, [tok], status.finish_reason if status else None, logprobs)

    @staticmethod
    def _output(
        req: Request,
        text: str,
        token_ids: list[int],
        finish_reason: str | None,
        logprobs: list[Sampled] | None = None,
    ) -> RequestOutput:
        return RequestOutput(
            req_id=req.req_id,
            text=text,
            token_ids=token_ids,
            logprobs=logprobs or [],
            finish_reason=finish_reason,
            num_prompt_tokens=req.num_prompt,
            num_output_tokens=len(req.output_ids),
        )

    def _close_stats(self, stats: StepStats) -> StepStats:
        stats.finished.extend(self._finished)
        self._finished.clear()
        stats.num_running = len(self.running)
        stats.num_waiting = len(self.waiting)
        stats.kv_used = self.pool.used
        stats.kv_capacity = self.pool.capacity
        stats.kv_reserved = self._committed()
        stats.num_recomputed_tokens, self._recomputed = self._recomputed, 0
        return stats
