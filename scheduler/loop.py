"""The shell around the scheduler core: one engine thread, fed from the event loop.

The engine thread loops — schedule → engine step → postprocess — without coming back to
the event loop between steps, and hands each step's outputs to the event loop in one
callback. The event loop only adds and aborts requests and streams results, so HTTP,
streaming and /metrics keep answering during a step, and a busy event loop never delays
the next step (a hand-off per step through an executor cost ~1.5 ms of a 15 ms step).
The core is guarded by one lock: the engine thread holds it while scheduling and
postprocessing, never while llama.cpp runs; add/abort take it briefly.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from engine.errors import EngineError, KVCacheFull
from engine.step_types import StepBatch, StepResult
from scheduler.core import Scheduler
from scheduler.request import Request, RequestOutput
from scheduler.stats import StepStats

log = logging.getLogger(__name__)

StepFn = Callable[[StepBatch], StepResult]
StatsSink = Callable[[StepStats], None]


class EngineLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        step: StepFn,
        on_stats: StatsSink | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scheduler = scheduler
        self._step = step
        self._on_stats = on_stats
        self._clock = clock
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}  # event-loop side only
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._closed = False
        self._idle = asyncio.Event()
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Future[None] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    def start(self) -> None:
        self._aloop = asyncio.get_running_loop()
        self._task = self._aloop.run_in_executor(self._executor, self._run)

    async def stop(self, drain_s: float = 0.0) -> None:
        """Let running requests finish for up to `drain_s`, then stop stepping."""
        if drain_s > 0 and not self._idle.is_set():
            try:
                await asyncio.wait_for(self._idle.wait(), drain_s)
            except TimeoutError:
                log.warning("drain timed out with %d running", len(self.scheduler.running))
        with self._work:
            self._closed = True
            self._work.notify()
        if self._task is not None:
            await self._task
        self._executor.shutdown(wait=True)

    def add(self, req: Request) -> asyncio.Queue[RequestOutput]:
        """Queue a request; raises `QueueFull` at the bound. Returns its output stream."""
        with self._work:
            self.scheduler.add(req)
            self._work.notify()
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[req.req_id] = q
        self._idle.clear()
        return q

    def abort(self, req_id: str) -> None:
        """Stop a request (client gone); its KV is freed at the next step."""
        if self._streams.pop(req_id, None) is not None:
            with self._work:
                self.scheduler.abort(req_id)
                self._work.notify()

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    # ---- engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        sched = self.scheduler
        while True:
            with self._work:
                while not self._closed and not sched.has_work:
                    self._post(None, None)  # idle
                    self._work.wait()
                if self._closed:
                    return
                p0 = time.perf_counter()
                out = sched.schedule(self._clock())
                p1 = time.perf_counter()
                if out.is_empty:  # nothing admissible now: wait for an add or abort
                    self._work.wait()
                    continue
            result: StepResult | None
            try:
                result = self._step(out.batch)
            except KVCacheFull:
                log.warning("backend KV full at %d cells used; preempting", sched.pool.used)
                with self._work:
                    sched.rollback_kv_full(out)
                continue
            except EngineError:
                log.exception("engine step failed; failing its %d requests", len(out.reqs))
                result = None
            p2 = time.perf_counter()
            with self._work:
                if result is None:
                    outputs, stats = sched.fail(out, self._clock())
                else:
                    outputs, stats = sched.postprocess(out, result, self._clock())
            p3 = time.perf_counter()
            stats.schedule_s = p1 - p0
            stats.postprocess_s = p3 - p2
            stats.step_s = p3 - p0
            self._post(outputs, stats)

    def _post(self, outputs: list[RequestOutput] | None, stats: StepStats | None) -> None:
        assert self._aloop is not None
        self._aloop.call_soon_threadsafe(self._deliver, outputs, stats)

    # ---- event loop -------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput] | None, stats: StepStats | None) -> None:
        if outputs is None:
            with self._lock:  # an add may have come after the engine thread went idle
                idle = not self.scheduler.has_work
            if idle:
                self._idle.set()
            return
        for o in outputs:
            q = self._streams.get(o.req_id)
            if q is not None:
                q.put_nowait(o)
                if o.finish_reason is not None:
                    del self._streams[o.req_id]
        if stats is not None and self._on_stats is not None:
            self._on_stats(stats)
