"""The scheduler core: which tokens go into the next step, and what a step's tokens mean.

Synchronous and pure (no I/O, asyncio, ctypes or metrics): `schedule()` builds the next
`StepBatch`, `postprocess()` folds the engine's `StepResult` back into request state and
returns each request's new tokens plus the step's stats (their text, and stop strings,
are `scheduler.output`'s). Time is passed in, never read.

The core decides what runs: the queues, the admission order and fair share, the chunk
policy, prompt sharing (`scheduler.sharing`), the choice of victims, and when to hand a
prompt to a side context beside the steps (`scheduler.side_handoff`). What that means
for the engine's KV — cells, the prefix cache, swap space — is the KV manager's books
(`scheduler.kv_manager`), asked in the core's words.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from engine.step_types import Sampled, SeqChunk, SeqStart, StepBatch, StepResult
from scheduler.chunk_grant import ChunkGrant
from scheduler.config import SchedulerConfig
from scheduler.fair_share import QueueFull, check_room, max_group
from scheduler.kv_manager import KVManager
from scheduler.kv_wait import KVWaitClock
from scheduler.request import Request, RequestOutput, RequestStatus
from scheduler.sharing import PromptSharing
from scheduler.side_handoff import SideHandoff
from scheduler.stats import FinishedStats, StepStats
from scheduler.step_outputs import finished_stats, keep_scored, request_output, take_token
from scheduler.step_plan import SchedulerOutput, StepPlan

__all__ = ["QueueFull", "Scheduler", "SchedulerConfig"]


class Scheduler:
    """One lane's queues and steps; its KV books are `self.kv`'s."""

    def __init__(self, cfg: SchedulerConfig) -> None:
        if cfg.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        self.cfg = cfg
        self.chunks = ChunkGrant(cfg)
        self.kv = KVManager(cfg, self.chunks.cost)
        self.sharing = PromptSharing(cfg.sliding_window) if cfg.prefix_cache else None
        self._kv_wait = KVWaitClock()
        self._now = 0.0  # the time of the last schedule()
        self._num_preempted = 0  # since the last stats, all kinds
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.side = SideHandoff(cfg, self.chunks)
        self._by_id: dict[str, Request] = {}
        self._aborts: set[str] = set()
        self._stops: set[str] = set()  # running requests their text stopped (`stop`)
        self._finished: list[FinishedStats] = []  # finished outside a step (aborts)

    # ---- inputs ----------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.add_group([req])

    @property
    def max_group(self) -> int:
        """The most sequences one client may ever queue (`fair_share.max_group`)."""
        return max_group(self.cfg.max_waiting)

    def add_group(self, reqs: Sequence[Request]) -> None:
        """Queue the sequences of one API call (its prompts × choices) together, or none
        (`QueueFull`, see `check_room`)."""
        self.check_room(reqs[0].client, len(reqs))
        for req in reqs:
            if req.params.prompt_logprobs is not None:
                # every prompt position needs its logit row: computed, never read
                req.cache_prompt = False
            self.waiting.append(req)
            self._by_id[req.req_id] = req

    def check_room(self, client: str, k: int) -> None:
        """Raise `QueueFull` unless `client` may queue `k` more sequences now (its fair
        share of the queue, `fair_share.check_room`)."""
        check_room(self.waiting, self.cfg.max_waiting, client, k)

    def abort(self, req_id: str, now: float) -> None:
        """A waiting request leaves the queue at once (a refused or abandoned request must
        not hold a place others could use); a running one is removed at the next
        `schedule()`, since a step may be running it right now."""
        req = self._by_id.get(req_id)
        if req is None:
            return
        if req.status is RequestStatus.WAITING:
            self._dequeue(req)
            self._finish(req, RequestStatus.FINISHED_ABORTED, now, self._finished)
        else:
            self._aborts.add(req_id)

    def _dequeue(self, req: Request) -> None:
        """A waiting request leaves the queue, or the side context's hands."""
        if not self.side.release(req):
            self.waiting.remove(req)

    @property
    def aside(self) -> dict[str, Request]:
        """The new requests a side context is prefilling, by id (`scheduler.side_handoff`)."""
        return self.side.requests

    def side_woke(self) -> None:
        self.side.woke()

    @property
    def has_work(self) -> bool:
        return bool(
            self.waiting
            or self.running
            or self._aborts
            or self._stops
            or self.aside
            or self.kv.pending.needs_batch
        )

    # ---- schedule --------------------------------------------------------------------
    def schedule(self, now: float, others_waiting: bool = False) -> SchedulerOutput:
        """The next step. `others_waiting`: requests of another lane wait for this step to
        end (lanes step one after the other), so it is bounded by the stall target as if
        they decoded here, and never a burst's."""
        self._now = now
        self.kv.begin_step()
        self._apply_aborts(now)
        plan = StepPlan()
        self._continue_decoders(plan)
        prefilling = [r for r in self.running if not r.is_decoding and r.req_id not in plan.chunks]
        decoders = [r for r, _ in plan.chunks.values()]
        plan.draft = self.chunks.draft(decoders, bool(prefilling), others_waiting)
        joined = self._continue_prompts(plan, prefilling)
        self._admit_waiting(plan, joined, now)
        return self._assemble_batch(plan)

    def _continue_decoders(self, plan: StepPlan) -> None:
        """Decoders first: every running user gets its token before any prompt chunk."""
        budget = self.cfg.max_num_batched_tokens
        for req in [r for r in self.running if r.is_decoding]:
            if budget < 1:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            if self._reserve(req, 1, plan):
                plan.chunks[req.req_id] = (req, 1)
                budget -= 1

    def _continue_prompts(self, plan: StepPlan, prefilling: list[Request]) -> bool:
        """Chunks of the prompts under way, oldest first (FCFS), as the chunk policy grants
        them. False when one would not join this step: it waits for the next, and so does
        everyone behind it (no admission)."""
        draft = plan.draft
        budget = self.cfg.max_num_batched_tokens - plan.tokens
        for i, req in enumerate(prefilling):
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            req.split_at = self._offer_point(req, req.num_computed, req.shared)
            behind = len(prefilling) - i - 1 + len(self.waiting)
            n = self.chunks.running(draft, req, budget, behind)
            if n is None:
                return False
            if n < 1:
                break
            if self._reserve(req, n, plan):
                plan.chunks[req.req_id] = (req, n)
                draft.add(n, req.num_computed, n == req.num_uncomputed, req.max_tokens)
                budget -= n
        return True

    def _admit_waiting(self, plan: StepPlan, joined: bool, now: float) -> None:
        """Admission by what a request needs: its whole uncomputed prompt (a preempted
        one's output too) and its expected growth, beside what the running still need —
        never by its first chunk alone, which lets a prompt in that the pool cannot finish.
        A step that had to preempt admits nobody: the room it made is for the running.
        When the pool cannot hold everyone waiting, and sharing steps buys little
        (`batching_pays`), serve one after another: the running finish at their own pace
        and nobody's pace is halved for a newcomer that must wait anyway."""
        fresh = self.kv.admits_new(bool(self.running))  # (it ends a backoff: always asked)
        can_admit = plan.preempted == 0 and fresh and joined
        if plan.draft.n_decode:
            self.kv.decode_step()
        committed = self.kv.committed(self.running)
        kv_blocked = False
        if (
            can_admit and self.running and self.waiting
            and not self.chunks.cost.batching_pays()
            and self.kv.short_of_kv(self.waiting, committed)
        ):  # fmt: skip
            can_admit, kv_blocked = False, True
        if can_admit:
            kv_blocked = self._admit_in_order(plan, committed, now)
        self._kv_wait.blocked(kv_blocked, self.waiting, now)

    def _admit_in_order(self, plan: StepPlan, committed: int, now: float) -> bool:
        """Admit from the queue's head while the step, the sequence ids and KV have room
        (a request waiting for another's prompt to be offered lets those behind it by);
        True when KV kept the head out."""
        budget = self.cfg.max_num_batched_tokens - plan.tokens
        queue = list(self.waiting)
        for i, req in enumerate(queue):
            if not (
                budget > 0 and self.kv.num_free_seqs > 0
                and len(self.running) < self.cfg.max_num_seqs
            ):  # fmt: skip
                break
            cached = self.kv.cached_prefix(req)
            if self.sharing and self.sharing.waits_for_publish(
                req, self.running, plan.chunks, cached
            ):
                continue
            if self.side.wants(plan.draft, req, cached):
                if self.kv.num_aside:  # the side context is busy: it waits for it
                    continue
                if self._fits(req, 0, 1, committed) is None:
                    return True
                if self.kv.set_aside(req):
                    self._set_aside(req, now)
                    continue
            # others waiting share a stretch of this prompt: it offers that stretch first
            split = self._offer_point(req, cached, cached)
            n = self.chunks.first(plan.draft, req, cached, split, budget, len(queue) - i - 1)
            if n < 1:
                break
            need = self._fits(req, cached, n, committed)
            if need is None:
                return True
            committed += need - n
            self._start(plan, req, cached, split, n, now)
            budget -= n
        return False

    def _set_aside(self, req: Request, now: float) -> None:
        self.waiting.remove(req)
        self._kv_wait.note(req, now)
        self.side.hold(req, now)

    def _fits(self, req: Request, cached: int, n: int, committed: int) -> int | None:
        """The cells `req` will still take (its prompt's rest and expected growth) when its
        first chunk of `n` fits now, and all of it beside what the running still take
        (`committed`); None when KV keeps it out. A swapped-out request brings back the
        cells it held (`num_computed`; a new or recomputing one holds none)."""
        held, wm = req.num_computed, self.cfg.kv_watermark
        free = self.kv.room_for(req, cached)  # what it reads stays
        if free - held - n < wm or held + n > free:
            return None
        need = req.num_uncomputed - cached + self.kv.growth_cells(req)
        if self.running and free - committed - held - need < wm:
            return None
        return need

    def _start(
        self, plan: StepPlan, req: Request, cached: int, split: int | None, n: int, now: float
    ) -> None:
        """`req` leaves the queue with a first chunk of `n` tokens after the `cached`."""
        held = req.num_computed
        self.waiting.remove(req)
        req.split_at = split
        self._kv_wait.note(req, now)
        seq = self.kv.start(req, cached, held + n)
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        self.running.append(req)
        plan.starts.append(SeqStart(seq, req.params, list(req.output_ids)))
        plan.chunks[req.req_id] = (req, n)
        plan.draft.add(n, req.num_computed, n == req.num_uncomputed, req.max_tokens)

    def _assemble_batch(self, plan: StepPlan) -> SchedulerOutput:
        """The planned chunks and the KV manager's ops as the engine's batch; the step as
        the chunk policy will judge it (a chunk of a decoder's one token is decode work)."""
        ops = self.kv.take_ops()
        batch = StepBatch(
            [], plan.starts, ops.released, ops.swap_out, ops.swap_in, ops.swap_drop,
            ops.retained, ops.kv_ops, ops.side_prefill, self.side.take_poll(),
        )  # fmt: skip
        out = SchedulerOutput(batch, num_preempted=plan.preempted)
        draft = plan.draft
        draft.chunks = []
        for req, n in plan.chunks.values():
            assert req.seq_id is not None
            pos0 = req.num_computed
            sample = pos0 + n == req.num_tokens and req.max_tokens > 0
            chunk = SeqChunk(
                req.seq_id, req.tokens_from(pos0, n), pos0, sample, req.targets(pos0, n)
            )
            out.batch.chunks.append(chunk)
            out.reqs.append(req)
            if not (n == 1 and req.output_ids and pos0 + 1 == req.num_tokens):
                draft.chunks.append((n, pos0))
        self.chunks.last = draft
        assert out.batch.num_tokens <= self.cfg.max_num_batched_tokens, "step over budget"
        self.kv.sanity_checks(len(self.running))
        return out

    # ---- chunks and victims ----------------------------------------------------------
    def _offer_point(self, req: Request, start: int, have: int) -> int | None:
        if self.sharing is None:
            return None
        return self.sharing.offer_point(req, self.waiting, start, have)

    def _reserve(self, req: Request, n: int, plan: StepPlan) -> bool:
        """Cells for `req`'s next `n` tokens: unread cache is evicted for them (once, before
        any preemption), then the running request that loses the least work is preempted
        (the fewest computed tokens, the newest among equals) until they fit. False when
        `req` was the one."""
        room = self.kv.make_room(n)
        while not room:
            self.kv.reserve_fell_short()
            victim = min(reversed(self.running), key=lambda r: r.num_computed)
            plan.chunks.pop(victim.req_id, None)
            self._preempt(victim)
            plan.preempted += 1
            if victim is req:
                return False
            room = self.kv.has_room(n)
        self.kv.reserve(req, n)
        return True

    def _preempt(self, req: Request) -> None:
        """Its KV goes (`KVManager.preempt`: to host RAM, or to be recomputed) and it is
        first in line again."""
        self.kv.preempt(req)
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        req.queued_time = self._now
        req.num_preemptions += 1
        self._num_preempted += 1
        self.waiting.appendleft(req)

    def _requeue(self, req: Request) -> None:
        """Its restore from host RAM failed (its id is released): it recomputes, first."""
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def rollback_kv_full(self, out: SchedulerOutput) -> None:
        """The backend found no KV slot despite our accounting (llama.cpp left its cache as
        before the call): undo the step's reservations and preempt the newest request."""
        self.kv.engine_refused(out.batch, out.reqs)
        if self.running:
            self._preempt(self.running[-1])

    # ---- finishing -------------------------------------------------------------------
    def stop(self, req_id: str, now: float) -> None:
        """Its text reached a stop string (scheduler.output): it ends as stopped — its KV
        kept for the prefix cache, like any finished request — before the next step."""
        req = self._by_id.get(req_id)
        if req is None:
            return
        if req.status is RequestStatus.WAITING:  # preempted: nothing runs it now
            self._dequeue(req)
            self._finish(req, RequestStatus.FINISHED_STOPPED, now, self._finished)
        else:
            self._stops.add(req_id)

    def _apply_aborts(self, now: float) -> None:
        for ids, status in ((self._aborts, RequestStatus.FINISHED_ABORTED),
                            (self._stops, RequestStatus.FINISHED_STOPPED)):  # fmt: skip
            for req_id in ids:
                req = self._by_id.get(req_id)
                if req is None or req.status.is_finished:
                    continue
                if req.status is RequestStatus.WAITING:
                    self._dequeue(req)
                self._finish(req, status, now, self._finished)
            ids.clear()

    def _finish(
        self, req: Request, status: RequestStatus, now: float, into: list[FinishedStats]
    ) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        if req.status is RequestStatus.WAITING:
            self._kv_wait.note(req, now)
        # ended by its tokens or text, its KV may stay as cache; aborted or failed, it goes
        self.kv.finish(req, keep=status in (RequestStatus.FINISHED_STOPPED,
                                            RequestStatus.FINISHED_LENGTH))  # fmt: skip
        req.status = status
        del self._by_id[req.req_id]
        into.append(finished_stats(req, status, now))

    # ---- postprocess -----------------------------------------------------------------
    def postprocess(
        self, out: SchedulerOutput, result: StepResult, now: float
    ) -> tuple[list[RequestOutput], StepStats]:
        """The one loop over a step's outputs: advance, append, finish by token."""
        for req in self.kv.swaps_ran(out.batch.swap_in, result):
            self._requeue(req)
        for req in self.side.returned(self.kv.aside_ran(result.side_done), now):
            self.waiting.appendleft(req)  # first in line, as it left
        stats = self.chunks.observe(out.batch, result)
        outputs: list[RequestOutput] = []
        for req, chunk in zip(out.reqs, out.batch.chunks, strict=True):
            if req.status is not RequestStatus.RUNNING:
                continue
            req.num_computed += len(chunk.tokens)
            if chunk.targets:
                keep_scored(req, chunk, result.prompt_logprobs[chunk.seq_id])
            self.kv.chunk_ran(req)
            if chunk.sample:
                outputs.append(self._append(req, result.sampled[chunk.seq_id], now, stats))
            elif req.max_tokens == 0 and req.num_computed == req.num_prompt:
                # only the prompt was asked for (echo with logprobs): it is done
                self._finish(req, RequestStatus.FINISHED_LENGTH, now, stats.finished)
                outputs.append(request_output(req, [], "length"))
        return outputs, self._close_stats(stats)

    def fail(self, out: SchedulerOutput, now: float) -> tuple[list[RequestOutput], StepStats]:
        """The engine failed this step: end its requests with `error`, keep the rest going."""
        stats = StepStats()
        outputs = []
        for req in out.reqs:
            if req.status is RequestStatus.RUNNING:
                self._finish(req, RequestStatus.FINISHED_ERROR, now, stats.finished)
                outputs.append(request_output(req, [], "error"))
        return outputs, self._close_stats(stats)

    def _append(self, req: Request, s: Sampled, now: float, stats: StepStats) -> RequestOutput:
        status = take_token(req, s, now, stats)
        logprobs = [s] if req.params.logprobs else []
        if status is not None:
            self._finish(req, status, now, stats.finished)
        return request_output(req, [s.token], status.finish_reason if status else None, logprobs)

    def _close_stats(self, stats: StepStats) -> StepStats:
        stats.finished.extend(self._finished)
        self._finished.clear()
        stats.num_running = len(self.running) + len(self.aside)  # (aside: being prefilled)
        stats.num_waiting = len(self.waiting)
        stats.num_preempted, self._num_preempted = self._num_preempted, 0
        self.kv.report(stats, self.running)
        return stats
