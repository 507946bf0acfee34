"""EngineLoop: the asyncio shell around the core, stepping the fake engine in its thread.

Every wait is on a stream or on a stats predicate; the timeouts only turn a hang (or a loop
task that died) into a failure with its cause instead of a stuck test.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from engine.errors import BackendError, KVCacheFull
from engine.step_types import StepBatch, StepResult
from scheduler.core import Scheduler, SchedulerConfig
from scheduler.loop import EngineLoop
from scheduler.request import Request, RequestOutput, RequestStatus
from scheduler.stats import StepStats
from tests.fake_engine import FakeEngine, make_request, reference

TIMEOUT_S = 10.0


def cfg(**kw: int) -> SchedulerConfig:
    base = dict(max_num_seqs=4, kv_capacity=1_000, max_num_batched_tokens=32, max_waiting=64)
    base.update(kw)
    return SchedulerConfig(**base)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [1 + (5 * i + salt) % 40 for i in range(n)]


class StatsLog:
    """The `on_stats` sink: keeps every step's stats and wakes whoever waits on a predicate."""

    def __init__(self) -> None:
        self.items: list[StepStats] = []
        self._waiters: list[tuple[Callable[[StepStats], bool], asyncio.Future[StepStats]]] = []

    def __call__(self, stats: StepStats) -> None:
        self.items.append(stats)
        for pred, fut in self._waiters:
            if not fut.done() and pred(stats):
                fut.set_result(stats)

    def expect(self, pred: Callable[[StepStats], bool]) -> asyncio.Future[StepStats]:
        """A future for the first step from now on whose stats satisfy `pred`."""
        fut: asyncio.Future[StepStats] = asyncio.get_running_loop().create_future()
        self._waiters.append((pred, fut))
        return fut


class Harness:
    def __init__(
        self, config: SchedulerConfig, fake: FakeEngine | None = None, hold_at_step: int = -1,
        step: Callable[[StepBatch], StepResult] | None = None,
    ) -> None:  # fmt: skip
        """`hold_at_step=k`: the engine thread waits before step k until `release()`, so a
        test can act while the loop is at a known point (the fake steps in microseconds).
        `step`: the engine step around the fake, when a test wraps it."""
        self.fake = fake or FakeEngine()
        self._inner = step or self.fake.step
        self.fake.n_batch = config.max_num_batched_tokens
        self.stats = StatsLog()
        self.held = threading.Event()
        self._gate = threading.Event()
        self._hold_at = hold_at_step
        self.loop = EngineLoop(Scheduler(config), self._step, on_stats=self.stats)
        self.loop.start()

    def _step(self, batch: StepBatch) -> StepResult:
        if len(self.fake.batches) == self._hold_at:
            self.held.set()
            assert self._gate.wait(TIMEOUT_S), "never released"
        return self._inner(batch)

    def release(self) -> None:
        self._gate.set()

    async def guarded(self, aw: Coroutine[Any, Any, Any] | asyncio.Future[Any]) -> Any:
        """Await `aw`, failing with the loop task's own exception if that task dies first."""
        fut = asyncio.ensure_future(aw)
        task = self.loop._task
        assert task is not None
        done, _ = await asyncio.wait({fut, task}, timeout=TIMEOUT_S, return_when="FIRST_COMPLETED")
        if fut in done:
            return fut.result()
        fut.cancel()
        if task in done:
            task.result()  # re-raises what killed the loop
            raise AssertionError("engine loop exited while a request was still waiting")
        raise AssertionError(f"nothing after {TIMEOUT_S}s (scheduler livelock?)")

    async def next_output(self, q: asyncio.Queue[RequestOutput]) -> RequestOutput:
        out: RequestOutput = await self.guarded(q.get())
        return out

    async def collect(self, q: asyncio.Queue[RequestOutput]) -> list[RequestOutput]:
        outs = [await self.next_output(q)]
        while outs[-1].finish_reason is None:
            outs.append(await self.next_output(q))
        return outs

    async def close(self) -> None:
        await self.loop.stop()


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(main())


def assert_reference(req: Request, outs: list[RequestOutput]) -> None:
    ref = reference(req.prompt_ids, req.max_tokens, req.stops.stops)
    assert [t for o in outs for t in o.token_ids] == ref.token_ids
    assert "".join(o.text for o in outs) == ref.text
    assert outs[-1].finish_reason == ref.finish_reason
    assert all(o.finish_reason is None for o in outs[:-1])


def test_concurrent_requests_all_complete_in_shared_steps() -> None:
    async def main() -> None:
        h = Harness(cfg(max_num_seqs=4, max_num_batched_tokens=16), hold_at_step=2)
        first = [make_request(f"a{i}", prompt(3 + i, i), 6 + i) for i in range(3)]
        qs = {r.req_id: h.loop.add(r) for r in first}
        # A later wave joins while the first one is decoding (the loop waits before step 2).
        await h.guarded(asyncio.to_thread(h.held.wait, TIMEOUT_S))
        later = [make_request(f"b{i}", prompt(10, 20 + i), 5, stops=("t3",)) for i in range(3)]
        qs.update({r.req_id: h.loop.add(r) for r in later})
        h.release()
        results = await asyncio.gather(*(h.collect(q) for q in qs.values()))
        by_id = {outs[0].req_id: outs for outs in results}
        for r in first + later:
            assert_reference(r, by_id[r.req_id])
        assert max(s.num_step_seqs for s in h.stats.items) > 1
        # Some step mixed a first-wave decoder with a second-wave prompt.
        assert any(
            len(b.starts) > 0 and any(len(c.tokens) == 1 for c in b.chunks) for b in h.fake.batches
        )
        assert await h.loop.drain(TIMEOUT_S)  # the finished sequences' Release sent
        assert h.loop.scheduler.kv.used == 0
        await h.close()
        assert not h.loop.is_running

    run(main)


def test_abort_during_generation_ends_the_stream_and_frees_kv() -> None:
    async def main() -> None:
        h = Harness(cfg(), hold_at_step=3)
        req = make_request("long", prompt(8), 500)
        q = h.loop.add(req)
        got = [await h.next_output(q), await h.next_output(q)]
        await h.guarded(asyncio.to_thread(h.held.wait, TIMEOUT_S))  # mid-generation
        assert all(o.finish_reason is None for o in got)
        freed = h.stats.expect(
            lambda s: (
                s.kv_used == 0
                and s.num_running == 0
                and [f.finish_reason for f in s.finished] == ["abort"]
            )
        )
        h.loop.abort("long")
        queued = q.qsize()  # already delivered before the abort; nothing may follow them
        h.release()
        st = await h.guarded(freed)
        assert st.finished[0].num_output_tokens < 500
        assert req.status is RequestStatus.FINISHED_ABORTED
        assert q.qsize() == queued, "outputs arrived after the abort"
        assert h.fake.kv == {}  # the engine was told to drop the sequence
        # The loop goes on serving.
        nxt = make_request("next", prompt(4, 3), 4)
        assert_reference(nxt, await h.collect(h.loop.add(nxt)))
        assert q.qsize() == queued
        assert all(q.get_nowait().finish_reason is None for _ in range(queued))
        await h.close()

    run(main)


def test_abort_one_of_several_keeps_the_others_going() -> None:
    async def main() -> None:
        h = Harness(cfg(), hold_at_step=3)
        reqs = [make_request(f"r{i}", prompt(5, i), 40 if i == 1 else 12) for i in range(3)]
        qs = [h.loop.add(r) for r in reqs]
        await h.next_output(qs[1])
        await h.guarded(asyncio.to_thread(h.held.wait, TIMEOUT_S))
        h.loop.abort("r1")  # while the loop waits before step 3: r1 is mid-generation
        h.release()
        queued = qs[1].qsize()
        done = await asyncio.gather(h.collect(qs[0]), h.collect(qs[2]))
        assert_reference(reqs[0], done[0])
        assert_reference(reqs[2], done[1])
        assert reqs[1].status is RequestStatus.FINISHED_ABORTED
        assert qs[1].qsize() == queued
        assert all(qs[1].get_nowait().finish_reason is None for _ in range(queued))
        assert await h.loop.drain(TIMEOUT_S)  # the finished sequences' Release sent
        assert h.loop.scheduler.kv.used == 0
        await h.close()

    run(main)


@pytest.mark.parametrize(
    "fault", [BackendError("ggml said no"), RuntimeError("a bug in the step")], ids=type
)
def test_backend_error_fails_only_that_steps_requests(fault: Exception) -> None:
    """A backend error, or any exception out of a step (a bug), fails that step's requests
    only: the engine thread lives on and serves the others."""

    async def main() -> None:
        # One seq id: b waits while a runs, so the failing step (the third) holds only a.
        h = Harness(cfg(max_num_seqs=1), FakeEngine(faults={2: fault}))
        a = make_request("a", prompt(5), 8)
        b = make_request("b", prompt(6, 1), 5)
        qa, qb = h.loop.add(a), h.loop.add(b)
        errored = h.stats.expect(lambda s: [f.finish_reason for f in s.finished] == ["error"])
        outs_a = await h.collect(qa)
        assert [o.finish_reason for o in outs_a] == [None, None, "error"]
        assert outs_a[-1].token_ids == [] and outs_a[-1].text == ""
        ref_a = reference(a.prompt_ids, a.max_tokens)
        assert [t for o in outs_a for t in o.token_ids] == ref_a.token_ids[:2]
        assert a.status is RequestStatus.FINISHED_ERROR
        await h.guarded(errored)
        assert_reference(b, await h.collect(qb))
        # A request that arrives after the failure is served normally.
        c = make_request("c", prompt(3, 2), 3)
        assert_reference(c, await h.collect(h.loop.add(c)))
        assert await h.loop.drain(TIMEOUT_S)  # the finished sequences' Release sent
        assert h.loop.scheduler.kv.used == 0
        await h.close()

    run(main)


def test_kv_cache_full_rolls_back_preempts_and_everything_completes() -> None:
    async def main() -> None:
        h = Harness(cfg(), FakeEngine(faults={3: KVCacheFull("no slot")}))
        reqs = [make_request(f"r{i}", prompt(4 + i, i), 10) for i in range(3)]
        qs = [h.loop.add(r) for r in reqs]
        results = await asyncio.gather(*(h.collect(q) for q in qs))
        for r, outs in zip(reqs, results, strict=True):
            assert_reference(r, outs)
        assert [r.num_preemptions for r in reqs] == [0, 0, 1]  # the newest gave way
        failed, after = h.fake.batches[3], h.fake.batches[4]
        assert len(failed.chunks) == 3
        # its KV goes at once; it is re-admitted only after a request finished (real room)
        assert len(after.released) == 1 and len(after.starts) == 0
        restart = next(i for i, b in enumerate(h.fake.batches) if i > 4 and b.starts)
        assert any(b.released for b in h.fake.batches[5 : restart + 1])
        assert await h.loop.drain(TIMEOUT_S)  # the finished sequences' Release sent
        assert h.loop.scheduler.kv.used == 0
        await h.close()

    run(main)


def test_backend_with_less_room_than_the_accounting_still_makes_progress() -> None:
    """llama.cpp can refuse a batch the pool's arithmetic admits (fragmented or SWA cache).

    Three requests of 6 + 24 cells each on a backend of 40 cells (the scheduler believes
    100): each fits alone, so after the backend says "full" the loop must settle into running
    what fits. Today it preempts the newest, re-admits it at the very next schedule (the
    pool's arithmetic still says there is room), gets "full" again, and never advances.
    """

    async def main() -> None:
        fake = FakeEngine(capacity=40, max_steps=400)
        h = Harness(cfg(max_num_seqs=3, kv_capacity=100, max_num_batched_tokens=16), fake)
        reqs = [make_request(f"r{i}", prompt(6, i), 25) for i in range(3)]
        qs = [h.loop.add(r) for r in reqs]
        results = await asyncio.gather(*(h.collect(q) for q in qs))
        for r, outs in zip(reqs, results, strict=True):
            assert_reference(r, outs)
        await h.close()

    run(main)


def test_stop_drains_running_requests() -> None:
    async def main() -> None:
        h = Harness(cfg())
        req = make_request("a", prompt(4), 6)
        q = h.loop.add(req)
        await h.loop.stop(drain_s=TIMEOUT_S)
        assert not h.loop.is_running
        outs = [q.get_nowait() for _ in range(q.qsize())]
        assert_reference(req, outs)

    run(main)


def test_a_prompt_prefilled_aside_returns_though_nothing_else_steps() -> None:
    """The decoder finishes while a prompt is prefilled by the side context: the engine
    thread has nothing to step and sleeps; the side context's thread wakes it
    (`side_woke`), and the batch that polls for the prefill restores the prompt, whose
    output is the reference's."""

    async def main() -> None:
        config = SchedulerConfig(
            max_num_seqs=4, kv_capacity=1_000, max_num_batched_tokens=64, max_stall_s=0.001,
            side_prefill_tokens=200, swap_cells=1_000, kv_bytes_per_cell=1,
        )  # fmt: skip
        fake = FakeEngine(seconds_per_step=0.01, seconds_per_token=1e-3)
        finish = threading.Event()
        done: list[tuple[int, bool]] = []
        lock = threading.Lock()
        sent: list[int] = []

        def side(key: int, tokens: list[int]) -> None:  # the side context's thread
            assert finish.wait(TIMEOUT_S)
            with lock:
                fake.swapped[key] = [(pos, tok, -1 - pos) for pos, tok in enumerate(tokens)]
                done.append((key, True))
            h.loop.side_woke()

        def step(batch: StepBatch) -> StepResult:
            jobs, batch.side_prefill = batch.side_prefill, []
            for key, tokens in jobs:
                sent.append(key)
                threading.Thread(target=side, args=(key, tokens), daemon=True).start()
            result = fake.step(batch)
            with lock:
                result.side_done, done[:] = list(done), []
            return result

        h = Harness(config, fake, hold_at_step=3, step=step)
        a = make_request("a", prompt(8), 6)
        qa = h.loop.add(a)
        # a few tokens in (not a burst's first step), the loop held before its next step
        await h.guarded(asyncio.to_thread(h.held.wait, TIMEOUT_S))
        long = make_request("long", prompt(100, 3), 4)
        ql = h.loop.add(long)
        h.release()
        released = h.stats.expect(lambda s: s.num_step_tokens == 0)  # a's release step
        assert (await h.collect(qa))[-1].finish_reason == "length"
        await h.guarded(released)  # ... ran: from here the engine thread has nothing to do
        assert sent and long.req_id in h.loop.scheduler.aside
        steps = len(fake.batches)
        finish.set()
        assert_reference(long, await h.collect(ql))
        assert fake.batches[steps].side_poll  # the first step after the wake-up polled
        await h.close()

    run(main)


@pytest.mark.parametrize("seed", range(12))
def test_aborts_during_a_long_prefill_leave_nothing_taken_once_idle(seed: int) -> None:
    """A long prompt is computed in chunks while others wait to read it from the prefix
    cache (it is offered short of its end, a `Share` op may be pending when it ends); it
    is aborted at a seeded point, sometimes with a reader, and then no more traffic comes.
    Once the engine thread has nothing to do, the books, the last stats the server
    published and the engine's own cells must agree: nothing is held by a request that is
    gone, and no release waits for a next batch that an idle server never sends."""
    rng = random.Random(seed)

    async def main() -> None:
        config = cfg(max_num_seqs=4, kv_capacity=600, max_num_batched_tokens=16,
                     prefix_cache=True, max_cached_seqs=4)  # fmt: skip
        h = Harness(config, hold_at_step=rng.randrange(1, 7))  # (120 tokens: 8 steps)
        base = prompt(120, seed)
        long = make_request("long", base, 4)
        readers = [make_request(f"r{i}", [*base[: 70 + 10 * i], 41 + i, 42], 3) for i in range(2)]
        qs = {r.req_id: h.loop.add(r) for r in (long, *readers)}
        await h.guarded(asyncio.to_thread(h.held.wait, TIMEOUT_S))
        assert long.num_computed < long.num_prompt  # still prefilling
        gone = ["long", *(["r0"] if rng.random() < 0.5 else [])]
        for req_id in gone:
            h.loop.abort(req_id)
            del qs[req_id]
        h.release()
        for req in readers:
            if req.req_id in qs:
                assert_reference(req, await h.collect(qs[req.req_id]))
        assert await h.loop.drain(TIMEOUT_S)
        kv = h.loop.scheduler.kv
        assert not kv.pending.needs_batch, "a release waits for a batch nobody sends"
        assert kv.used == kv.cached and h.fake.kv_used == kv.used
        last = h.stats.items[-1]
        assert last.num_running == 0 and last.kv_used == last.kv_cached == kv.used
        assert long.status is RequestStatus.FINISHED_ABORTED
        await h.close()

    run(main)
