"""The shell around the scheduler core: one engine thread, fed from the event loop.

The engine thread loops — schedule → engine step → postprocess — without coming back to
the event loop between steps, and hands each step's outputs to the event loop in one
callback. The event loop only adds and aborts requests and streams results, so HTTP,
streaming and /metrics keep answering during a step, and a busy event loop never delays
the next step (a hand-off per step through an executor cost ~1.5 ms of a 15 ms step).
The core is guarded by one lock: the engine thread holds it while scheduling and
postprocessing, never while llama.cpp runs or while it turns the step's tokens into text
(`scheduler.output`); add/abort take it briefly.

Lanes: besides the shared ("fast") lane, a server may run other lanes — a scheduler and an
engine step of their own, on another llama.cpp context (the reproducible lane). Each loop
iteration schedules every lane that has work, runs their steps one after the other, then
postprocesses them; so a lane's step adds its own time to everyone's step, and nothing
else: lanes share no KV, no batch and no sampler. A lane whose step others wait on (their
lane has running requests) sizes its prompt chunks for the stall target as if they
decoded in it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from engine.errors import KVCacheFull
from engine.step_types import StepBatch, StepResult
from scheduler.core import Scheduler
from scheduler.output import OutputProcessor
from scheduler.request import SHUTDOWN, Request, RequestOutput
from scheduler.stats import FAST, StepStats
from scheduler.step_plan import SchedulerOutput

log = logging.getLogger(__name__)

StepFn = Callable[[StepBatch], StepResult]
StatsSink = Callable[[StepStats], None]


@dataclass(frozen=True, slots=True)
class Lane:
    name: str
    scheduler: Scheduler
    step: StepFn


class EngineLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        step: StepFn,
        on_stats: StatsSink | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scheduler = scheduler  # the fast lane's
        self.lanes: dict[str, Lane] = {FAST: Lane(FAST, scheduler, step)}
        self._lane_of: dict[str, Scheduler] = {}  # req_id -> its lane's scheduler
        self._on_stats = on_stats
        self._clock = clock
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}  # event-loop side only
        self._text = OutputProcessor()  # engine thread, outside the lock (add/drop: inside)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._closed = False
        self._idle = asyncio.Event()
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Future[None] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._over_logged = -1.0  # when a step over the stall target was last logged
        self._over_unlogged = 0  # such steps since then (one line a second at most)
        self._decode_s = 0.0  # a decode-only step's usual time (weighted mean), debug log

    def add_lane(self, name: str, scheduler: Scheduler, step: StepFn) -> None:
        """Another lane, stepped after the fast one in every iteration (before `start`)."""
        self.lanes[name] = Lane(name, scheduler, step)

    def start(self) -> None:
        self._aloop = asyncio.get_running_loop()
        self._task = self._aloop.run_in_executor(self._executor, self._run)

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every request has finished, for at most `timeout_s`; True if they did."""
        if self._idle.is_set():
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def end_all(self) -> int:
        """End every request now (the drain window passed): each stream gets a last output
        with finish_reason `SHUTDOWN`, so its client sees an error, not a cut connection.
        Returns how many streams were ended."""
        ended = 0
        for req_id, q in list(self._streams.items()):
            q.put_nowait(RequestOutput(req_id, "", [], [], SHUTDOWN, 0, 0))
            self.abort(req_id)
            ended += 1
        return ended

    async def stop(self, drain_s: float = 0.0) -> None:
        """Let running requests finish for up to `drain_s`, end the rest, stop stepping."""
        if drain_s > 0 and not await self.drain(drain_s):
            running = sum(len(lane.scheduler.running) for lane in self.lanes.values())
            log.warning("drain timed out with %d running", running)
        self.end_all()
        with self._work:
            self._closed = True
            self._work.notify()
        if self._task is not None:
            await self._task
        self._executor.shutdown(wait=True)

    def add(self, req: Request, lane: str = FAST) -> asyncio.Queue[RequestOutput]:
        """Queue a request; raises `QueueFull` at the bound. Returns its output stream."""
        return self.add_group([req], lane)[0]

    def add_group(
        self, reqs: list[Request], lane: str = FAST
    ) -> list[asyncio.Queue[RequestOutput]]:
        """Queue one API call's sequences, all or none (`QueueFull`); their streams."""
        sched = self.lanes[lane].scheduler
        with self._work:
            sched.add_group(reqs)
            for req in reqs:
                self._text.add(req)
            self._work.notify()
        queues = []
        for req in reqs:
            self._lane_of[req.req_id] = sched
            q: asyncio.Queue[RequestOutput] = asyncio.Queue()
            self._streams[req.req_id] = q
            queues.append(q)
        self._idle.clear()
        return queues

    def side_woke(self, lane: str = FAST) -> None:
        """A side prefill of `lane` ended (called on the side context's thread): its
        scheduler asks for it in the next batch, and an idle engine thread wakes to send it."""
        with self._work:
            self.lanes[lane].scheduler.side_woke()
            self._work.notify()

    def check_room(self, client: str, k: int, lane: str = FAST) -> None:
        """`QueueFull` unless `client` may queue `k` sequences now: asked before a request's
        prompt is tokenized, so a refused one costs nothing (`add_group` asks again)."""
        with self._lock:
            self.lanes[lane].scheduler.check_room(client, k)

    def max_group(self, lane: str = FAST) -> int:
        """The most sequences one request may queue in `lane` (larger: never fits)."""
        return self.lanes[lane].scheduler.max_group

    def abort(self, req_id: str) -> None:
        """Stop a request (client gone): out of the queue at once, or its KV freed at the
        next step."""
        self._leave(req_id, ended=False)

    def end(self, req_id: str) -> None:
        """Stop a request whose answer is over before its text is (api.pipeline.answer: a repeated
        tool call): it ends as stopped at the next step, its KV kept for the prefix cache
        as any finished request's; nothing more reaches its stream."""
        self._leave(req_id, ended=True)

    def _leave(self, req_id: str, ended: bool) -> None:
        """The request's stream closes now; its scheduler stops it (`ended`) or aborts it."""
        sched = self._lane_of.pop(req_id, None)
        if self._streams.pop(req_id, None) is not None and sched is not None:
            with self._work:
                (sched.stop if ended else sched.abort)(req_id, self._clock())
                self._text.drop(req_id)
                self._work.notify()

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    # ---- engine thread ----------------------------------------------------------------
    @property
    def _has_work(self) -> bool:
        return any(lane.scheduler.has_work for lane in self.lanes.values())

    def _run(self) -> None:
        while True:
            with self._work:
                while not self._closed and not self._has_work:
                    self._post(None, None)  # idle
                    self._work.wait()
                if self._closed:
                    return
                planned: list[tuple[Lane, SchedulerOutput, float]] = []
                for lane in self.lanes.values():
                    if lane.scheduler.has_work:
                        p0 = time.perf_counter()
                        others = any(o.scheduler.running for o in self.lanes.values()
                                     if o is not lane)  # fmt: skip
                        out = lane.scheduler.schedule(self._clock(), others)
                        if not out.is_empty:
                            planned.append((lane, out, time.perf_counter() - p0))
                if not planned:  # nothing admissible now: wait for an add or abort
                    self._work.wait()
                    continue
            for lane, out, schedule_s in planned:
                self._step_lane(lane, out, schedule_s)

    def _step_lane(self, lane: Lane, out: SchedulerOutput, schedule_s: float) -> None:
        sched = lane.scheduler
        p1 = time.perf_counter()
        result: StepResult | None
        try:
            result = lane.step(out.batch)
        except KVCacheFull:
            log.warning("backend KV full at %d cells used; preempting", sched.kv.used)
            with self._work:
                sched.rollback_kv_full(out)
            return
        except Exception:  # EngineError, or a bug: it must not kill the engine thread
            log.exception("engine step failed; failing its %d requests", len(out.reqs))
            result = None
        p2 = time.perf_counter()
        with self._work:
            if result is None:
                outputs, stats = sched.fail(out, self._clock())
            else:
                outputs, stats = sched.postprocess(out, result, self._clock())
        outputs, stopped = self._text.process(outputs)  # outside the lock
        if stopped:
            with self._work:
                for req_id in stopped:
                    sched.stop(req_id, self._clock())
            for f in stats.finished:  # ended at max_tokens by the core, by its text here
                if f.req_id in stopped:
                    f.finish_reason = "stop"
        p3 = time.perf_counter()
        stats.lane = lane.name
        stats.schedule_s = schedule_s
        stats.postprocess_s = p3 - p2
        stats.step_s = schedule_s + p3 - p1
        if stats.stall_target_s is not None and stats.step_s > stats.stall_target_s:
            self._log_over_target(stats, p2 - p1)
        elif log.isEnabledFor(logging.DEBUG):
            self._log_step(stats, p2 - p1)
        self._post(outputs, stats)

    def _log_step(self, stats: StepStats, engine_s: float) -> None:
        """At debug level: every step with prompt chunks (auto's too), and decode steps
        twice their usual time (what held them?)."""
        if stats.step_shape[1] or stats.step_s > 2 * self._decode_s:
            log.debug(
                "planned step: %.1f ms (engine %.1f ms: decode %.1f, GIL wait %.1f, swap %.1f; "
                "modelled %.1f ms; %d decode tokens, prompt chunks %s as (tokens, KV depth); "
                "policy %s)",
                1000 * stats.step_s, 1000 * engine_s, 1000 * stats.decode_s,
                1000 * stats.gil_s, 1000 * stats.swap_s, 1000 * stats.modelled_s,
                stats.step_shape[0], stats.step_shape[1], stats.chunk_policy,
            )  # fmt: skip
        if not stats.step_shape[1] and stats.step_shape[0]:
            self._decode_s += 0.1 * (stats.step_s - self._decode_s)

    def _log_over_target(self, stats: StepStats, engine_s: float) -> None:
        """Say that a step ran past --max-stall-ms, and why it might have: at most once a
        second (an unreachable target would otherwise log every step)."""
        now = time.monotonic()
        if now - self._over_logged < 1.0:
            self._over_unlogged += 1
            return
        log.info(
            "step over the stall target: %.0f ms (engine %.0f ms, modelled %.0f ms; "
            "%d decode tokens, prompt chunks %s as (tokens, KV depth)); %d more since the "
            "last such line",
            1000 * stats.step_s, 1000 * engine_s, 1000 * stats.modelled_s,
            stats.step_shape[0], stats.step_shape[1], self._over_unlogged,
        )  # fmt: skip
        self._over_logged, self._over_unlogged = now, 0

    def _post(self, outputs: list[RequestOutput] | None, stats: StepStats | None) -> None:
        assert self._aloop is not None
        self._aloop.call_soon_threadsafe(self._deliver, outputs, stats)

    # ---- event loop -------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput] | None, stats: StepStats | None) -> None:
        if outputs is None:
            with self._lock:  # an add may have come after the engine thread went idle
                idle = not self._has_work
            if idle:
                self._idle.set()
            return
        for o in outputs:
            q = self._streams.get(o.req_id)
            if q is not None:
                q.put_nowait(o)
                if o.finish_reason is not None:
                    del self._streams[o.req_id]
                    self._lane_of.pop(o.req_id, None)
        if stats is not None and self._on_stats is not None:
            self._on_stats(stats)
