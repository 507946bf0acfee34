"""The asyncio shell around the scheduler core.

One task loops: schedule → run the blocking engine step in ONE dedicated worker thread →
postprocess → hand each request its delta. The event loop never blocks on llama.cpp, so
HTTP, streaming and /metrics keep answering during a step. The core is only touched from
the event-loop thread; the worker thread sees nothing but the `StepBatch`.
"""

from __future__ import annotations

import asyncio
import logging
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
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._closed = False
        self._task: asyncio.Task[None] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-loop")

    async def stop(self, drain_s: float = 0.0) -> None:
        """Let running requests finish for up to `drain_s`, then stop stepping."""
        if drain_s > 0 and self.scheduler.has_work:
            try:
                await asyncio.wait_for(self._idle.wait(), drain_s)
            except TimeoutError:
                log.warning("drain timed out with %d running", len(self.scheduler.running))
        self._closed = True
        self._wake.set()
        if self._task is not None:
            await self._task
        self._executor.shutdown(wait=True)

    def add(self, req: Request) -> asyncio.Queue[RequestOutput]:
        """Queue a request; raises `QueueFull` at the bound. Returns its output stream."""
        self.scheduler.add(req)
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[req.req_id] = q
        self._idle.clear()
        self._wake.set()
        return q

    def abort(self, req_id: str) -> None:
        """Stop a request (client gone); its KV is freed at the next step."""
        if self._streams.pop(req_id, None) is not None:
            self.scheduler.abort(req_id)
            self._wake.set()

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            if not self.scheduler.has_work:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            t0 = self._clock()
            out = self.scheduler.schedule(t0)
            if out.is_empty:  # nothing admissible now; wait for an add or abort
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                result = await loop.run_in_executor(self._executor, self._step, out.batch)
            except KVCacheFull:
                log.warning(
                    "backend KV full at %d cells used; preempting", self.scheduler.pool.used
                )
                self.scheduler.rollback_kv_full(out)
                continue
            except EngineError:
                log.exception("engine step failed; failing its %d requests", len(out.reqs))
                outputs, stats = self.scheduler.fail(out, self._clock())
            else:
                outputs, stats = self.scheduler.postprocess(out, result, self._clock())
            for o in outputs:
                q = self._streams.get(o.req_id)
                if q is not None:
                    q.put_nowait(o)
                    if o.finish_reason is not None:
                        del self._streams[o.req_id]
            stats.step_s = self._clock() - t0
            if self._on_stats is not None:
                self._on_stats(stats)
