"""The scheduler core driven step by step against the strict, history-deterministic fake.

Because the fake's next token depends only on a sequence's own history, every request's
output must equal `reference()` (the request run alone) whatever it was batched with,
however its prompt was chunked and however often it was preempted.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import pytest

from engine.errors import BackendError, KVCacheFull
from scheduler.core import QueueFull, Scheduler, SchedulerConfig
from scheduler.output import OutputProcessor
from scheduler.request import Request, RequestOutput, RequestStatus
from scheduler.stats import StepStats
from scheduler.step_plan import SchedulerOutput
from tests.fake_engine import (
    EOG,
    EOG_MARK,
    FakeEngine,
    make_request,
    next_token,
    prompt_logprob,
    reference,
    token_bytes,
)


@dataclass
class Step:
    out: SchedulerOutput
    outputs: list[RequestOutput]
    stats: StepStats | None  # None when the batch was empty and nothing ran


@dataclass
class Driver:
    """schedule → fake step → postprocess → text (as the engine loop runs them), checking
    the step contract around each call."""

    cfg: SchedulerConfig
    fake: FakeEngine = field(default_factory=FakeEngine)
    now: float = 0.0

    def __post_init__(self) -> None:
        self.sched = Scheduler(self.cfg)
        self.out_text = OutputProcessor()
        self.fake.n_batch = self.cfg.max_num_batched_tokens
        self.streams: dict[str, list[RequestOutput]] = defaultdict(list)
        self.steps: list[Step] = []
        self.reqs: dict[str, Request] = {}

    def add(self, req: Request) -> Request:
        return self.add_group([req])[0]

    def add_group(self, reqs: list[Request]) -> list[Request]:
        self.sched.add_group(reqs)
        for req in reqs:
            self.out_text.add(req)
            self.reqs[req.req_id] = req
        return reqs

    def step(self) -> Step:
        self.now += 1.0
        sched = self.sched
        decoders = {r.req_id: (r, r.num_preemptions) for r in sched.running if r.is_decoding}
        out = sched.schedule(self.now)
        sched.kv.sanity_checks(len(sched.running))
        check_batch(self.cfg, out, decoders)
        if out.is_empty:
            step = Step(out, [], None)
        else:
            result = self.fake.step(out.batch)
            # The batch's releases and starts leave the engine holding exactly the running
            # set, and the prefix cache's holders.
            holders = sched.kv.engine_holders
            assert set(self.fake.kv) == {r.seq_id for r in sched.running} | holders
            outputs, stats = sched.postprocess(out, result, self.now)
            outputs, stopped = self.out_text.process(outputs)
            for req_id in stopped:
                sched.stop(req_id, self.now)
            step = Step(out, outputs, stats)
            for o in outputs:
                self.streams[o.req_id].append(o)
        sched.kv.sanity_checks(len(sched.running))
        check_mirror(sched, self.fake)
        self.steps.append(step)
        return step

    def run(self, max_steps: int = 2_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work:
                return
            if self.step().out.is_empty and self.sched.has_work:
                if self.sched.aside:  # its side prefill goes on: the side thread wakes us
                    self.sched.side_woke()
                    continue
                raise AssertionError("scheduler has work but scheduled nothing")
        raise AssertionError(f"not done after {max_steps} steps (livelock?)")

    def text(self, req_id: str) -> str:
        return "".join(o.text for o in self.streams[req_id])

    def token_ids(self, req_id: str) -> list[int]:
        return [t for o in self.streams[req_id] for t in o.token_ids]

    def finish_reason(self, req_id: str) -> str | None:
        s = self.streams[req_id]
        return s[-1].finish_reason if s else None

    def assert_matches_reference(self, req_id: str) -> None:
        req = self.reqs[req_id]
        ref = reference(req.prompt_ids, req.max_tokens, req.stops.stops)
        assert self.token_ids(req_id) == ref.token_ids, req_id
        assert self.text(req_id) == ref.text, req_id
        assert self.finish_reason(req_id) == ref.finish_reason, req_id
        assert [o.finish_reason for o in self.streams[req_id][:-1]] == [None] * (
            len(self.streams[req_id]) - 1
        )
        assert req.output_ids == ref.token_ids


def check_batch(
    cfg: SchedulerConfig, out: SchedulerOutput, decoders: dict[str, tuple[Request, int]]
) -> None:
    """Budget, chunk cap, chunk/request pairing, sample flags, decoders first, one token each.

    `decoders` maps each request decoding before `schedule()` to (request, its preemption
    count then); one preempted in this schedule no longer counts as a decoder.
    """
    b = out.batch
    assert b.num_tokens <= cfg.max_num_batched_tokens
    assert len(out.reqs) == len(b.chunks)
    assert len({r.req_id for r in out.reqs}) == len(out.reqs)
    cap = cfg.max_prefill_chunk or cfg.max_num_batched_tokens
    still = {
        req_id
        for req_id, (req, n_pre) in decoders.items()
        if req.status is RequestStatus.RUNNING and req.num_preemptions == n_pre
    }
    is_decode = []
    for req, chunk in zip(out.reqs, b.chunks, strict=True):
        assert req.status is RequestStatus.RUNNING
        assert chunk.seq_id == req.seq_id
        assert 1 <= len(chunk.tokens) <= cap
        assert chunk.pos0 == req.num_computed
        assert chunk.tokens == req.tokens_from(chunk.pos0, len(chunk.tokens))
        ends = chunk.pos0 + len(chunk.tokens) == req.num_tokens
        assert chunk.sample == (ends and req.max_tokens > 0)
        if chunk.targets:  # a scored prompt's chunk: a logit row per token it scores
            assert len(chunk.tokens) <= cfg.prompt_logprob_rows
        is_decode.append(req.req_id in still)
        if req.req_id in still:
            assert len(chunk.tokens) == 1 and chunk.sample
    assert is_decode == sorted(is_decode, reverse=True), "a prompt chunk before a decoder"
    if cfg.max_num_seqs <= cfg.max_num_batched_tokens:
        missing = still - {r.req_id for r in out.reqs}
        assert not missing, f"decoders left without a token this step: {missing}"


def check_mirror(sched: Scheduler, fake: FakeEngine) -> None:
    """The pool's accounting equals what the engine holds for every running request."""
    total = 0
    for r in sched.running:
        assert r.seq_id is not None
        assert sched.kv.own_cells(r) == r.num_computed - r.shared
        if r.seq_id in fake.kv:
            assert fake.history(r.seq_id) == r.tokens_from(0, r.num_computed)
        else:  # admitted by a schedule whose step did not run (an empty or failed one)
            assert r.num_computed == 0
        total += r.num_computed - r.shared
    assert sched.kv.used == total + sched.kv.cached
    pending = sched.kv.pending
    if not pending.released and not pending.kv_ops:  # (the engine drops those next step)
        assert fake.kv_used == sched.kv.used  # shared cells counted once on both sides
    # A swapped request's KV is in the engine's swap store, as many cells as it computed;
    # a prompt prefilled aside holds its space until its cells come (then it is swapped).
    swapped = [r for r in sched.waiting if r.swap_key is not None]
    aside = sum(r.num_prompt - 1 for r in sched.aside.values())
    assert sched.kv.swap_used == sum(r.num_computed for r in swapped) + aside
    assert {r.swap_key: r.num_computed for r in swapped} == {
        k: len(cells) for k, cells in fake.swapped.items() if k not in pending.swap_drop
    }


def cfg(**kw: int | None) -> SchedulerConfig:
    base: dict[str, int | None] = dict(
        max_num_seqs=4, kv_capacity=1_000, max_num_batched_tokens=32, max_waiting=64
    )
    base.update(kw)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


def prompt(n: int, salt: int = 0) -> list[int]:
    return [1 + (7 * i + salt) % 40 for i in range(n)]


def decoding_every_step(d: Driver, step: Step, req_ids: list[str]) -> None:
    by_id = {r.req_id: c for r, c in zip(step.out.reqs, step.out.batch.chunks, strict=True)}
    for req_id in req_ids:
        assert len(by_id[req_id].tokens) == 1


# ---- joining and leaving ----------------------------------------------------------------


def test_new_request_joins_at_next_step_while_others_decode() -> None:
    d = Driver(cfg())
    a = d.add(make_request("a", prompt(5), 20))
    s1 = d.step()
    assert [len(c.tokens) for c in s1.out.batch.chunks] == [5]
    assert [s.seq_id for s in s1.out.batch.starts] == [a.seq_id]
    d.step()
    assert a.is_decoding
    b = d.add(make_request("b", prompt(7, 1), 20))
    s3 = d.step()
    chunks = s3.out.batch.chunks
    assert [(c.seq_id, len(c.tokens)) for c in chunks] == [(a.seq_id, 1), (b.seq_id, 7)]
    assert [s.seq_id for s in s3.out.batch.starts] == [b.seq_id]
    assert {o.req_id for o in s3.outputs} == {"a", "b"}
    assert len(d.streams["a"]) == 3 and len(d.streams["b"]) == 1
    d.run()
    d.assert_matches_reference("a")
    d.assert_matches_reference("b")


def test_finished_request_leaves_at_the_step_boundary() -> None:
    d = Driver(cfg())
    a = d.add(make_request("a", prompt(4), 2))
    b = d.add(make_request("b", prompt(4, 3), 6))
    d.step()
    seq_a = a.seq_id
    s2 = d.step()
    assert [o.finish_reason for o in s2.outputs if o.req_id == "a"] == ["length"]
    assert a.status is RequestStatus.FINISHED_LENGTH and a.seq_id is None
    assert d.sched.running == [b]
    assert d.sched.kv.used == b.num_computed
    assert seq_a in d.fake.kv  # the engine still holds it until the next batch says so
    c = d.add(make_request("c", prompt(3, 5), 3))
    s3 = d.step()
    assert s3.out.batch.released == [seq_a]
    assert s3.out.reqs == [b, c]
    assert c.seq_id == seq_a  # the freed id is reused, after its release in the same batch
    assert [s.seq_id for s in s3.out.batch.starts] == [seq_a]
    s4 = d.step()
    assert s4.out.batch.released == []
    d.run()
    for r in "abc":
        d.assert_matches_reference(r)


def test_decoders_fill_a_budget_of_exactly_their_number() -> None:
    d = Driver(cfg(max_num_seqs=3, max_num_batched_tokens=3))
    for i in range(3):
        d.add(make_request(f"r{i}", prompt(1, i), 6))
    for _ in range(5):
        step = d.step()
        assert [len(c.tokens) for c in step.out.batch.chunks] == [1, 1, 1]
        assert len(step.outputs) == 3
    d.run()
    for i in range(3):
        d.assert_matches_reference(f"r{i}")


def test_every_running_decoder_gets_exactly_one_token_each_step() -> None:
    d = Driver(cfg(max_num_seqs=4, max_num_batched_tokens=16))
    for i, n in enumerate([3, 9, 1, 6]):
        d.add(make_request(f"r{i}", prompt(n, i), 12))
    while d.sched.has_work:
        before = [r.req_id for r in d.sched.running if r.is_decoding]
        counts = {r: len(d.streams[r]) for r in before}
        step = d.step()
        decoding_every_step(d, step, before)
        for r in before:
            assert len(d.streams[r]) == counts[r] + 1
            assert len(d.streams[r][-1].token_ids) == 1
    for i in range(4):
        d.assert_matches_reference(f"r{i}")


# ---- chunked prefill --------------------------------------------------------------------


def test_long_prompt_alone_is_split_into_budget_sized_chunks() -> None:
    d = Driver(cfg(max_num_batched_tokens=8))
    d.add(make_request("long", prompt(30), 3))
    chunks = [d.step().out.batch.chunks[0] for _ in range(4)]
    assert [(c.pos0, len(c.tokens), c.sample) for c in chunks] == [
        (0, 8, False),
        (8, 8, False),
        (16, 8, False),
        (24, 6, True),
    ]
    assert d.streams["long"] and len(d.streams["long"]) == 1
    d.run()
    d.assert_matches_reference("long")


@pytest.mark.parametrize("max_prefill_chunk", [None, 4])
def test_prompt_chunks_share_the_step_with_decoders_and_always_progress(
    max_prefill_chunk: int | None,
) -> None:
    d = Driver(cfg(max_num_batched_tokens=8, max_prefill_chunk=max_prefill_chunk))
    decoders = [d.add(make_request(f"d{i}", prompt(2, i), 40)) for i in range(3)]
    d.step()
    assert all(r.is_decoding for r in decoders)
    long = d.add(make_request("long", prompt(30, 9), 5))
    want = min(8 - 3, max_prefill_chunk or 8)
    sizes = []
    while long.num_computed < long.num_prompt:
        step = d.step()
        b = step.out.batch
        assert b.num_tokens <= 8
        assert [len(c.tokens) for c in b.chunks[:3]] == [1, 1, 1]
        assert [r.req_id for r in step.out.reqs[:3]] == ["d0", "d1", "d2"]
        assert step.out.reqs[3] is long
        sizes.append(len(b.chunks[3].tokens))
    assert sum(sizes) == 30
    assert all(s == want for s in sizes[:-1]) and 0 < sizes[-1] <= want
    d.run()
    for r in ["d0", "d1", "d2", "long"]:
        d.assert_matches_reference(r)


def test_two_long_prompts_each_respect_the_chunk_cap() -> None:
    d = Driver(cfg(max_num_batched_tokens=16, max_prefill_chunk=5))
    d.add(make_request("x", prompt(12), 2))
    d.add(make_request("y", prompt(11, 2), 2))
    s1 = d.step()
    assert [len(c.tokens) for c in s1.out.batch.chunks] == [5, 5]
    s2 = d.step()
    assert [len(c.tokens) for c in s2.out.batch.chunks] == [5, 5]
    s3 = d.step()
    assert [len(c.tokens) for c in s3.out.batch.chunks] == [2, 1]
    assert [c.sample for c in s3.out.batch.chunks] == [True, True]
    d.run()
    d.assert_matches_reference("x")
    d.assert_matches_reference("y")


# ---- aborts and the queue bound ---------------------------------------------------------


def test_abort_waiting_request() -> None:
    d = Driver(cfg(max_num_seqs=1))
    a = d.add(make_request("a", prompt(4), 6))
    b = d.add(make_request("b", prompt(4, 1), 6))
    d.step()
    assert list(d.sched.waiting) == [b]
    d.sched.abort("b", d.now)
    assert list(d.sched.waiting) == []  # out of the queue at once, not at the next step
    s = d.step()
    assert b.status is RequestStatus.FINISHED_ABORTED and b.seq_id is None
    assert s.out.batch.released == [] and s.out.reqs == [a]
    assert s.stats is not None
    [fin] = s.stats.finished
    assert (fin.finish_reason, fin.num_output_tokens, fin.queue_s) == ("abort", 0, None)
    assert "b" not in d.streams
    d.run()
    d.assert_matches_reference("a")
    assert d.sched.kv.used == 0 and d.sched.kv.num_free_seqs == 1


def test_abort_running_request_frees_its_seq_and_cells() -> None:
    d = Driver(cfg())
    a = d.add(make_request("a", prompt(6), 30))
    b = d.add(make_request("b", prompt(5, 1), 30))
    for _ in range(3):
        d.step()
    seq_a = a.seq_id
    assert d.sched.kv.used == a.num_computed + b.num_computed
    n_out = len(d.streams["a"])
    d.sched.abort("a", d.now)
    s = d.step()
    assert a.status is RequestStatus.FINISHED_ABORTED and a.seq_id is None
    assert s.out.batch.released == [seq_a]
    assert s.out.reqs == [b]
    assert seq_a not in d.fake.kv
    assert d.sched.kv.used == b.num_computed
    assert s.stats is not None
    assert [f.finish_reason for f in s.stats.finished] == ["abort"]
    assert s.stats.finished[0].num_output_tokens == n_out
    assert len(d.streams["a"]) == n_out  # nothing more for the aborted stream
    assert d.sched.kv.num_free_seqs == 3
    d.sched.abort("a", d.now)  # a second abort, or one for a finished request, is a no-op
    d.run()
    d.assert_matches_reference("b")
    assert d.sched.kv.used == 0 and d.sched.kv.num_free_seqs == 4


def test_abort_of_unknown_or_finished_request_is_ignored() -> None:
    d = Driver(cfg())
    d.add(make_request("a", prompt(3), 1))
    d.run()
    d.sched.abort("a", d.now)
    d.sched.abort("nope", d.now)
    assert not d.sched.has_work


def test_queue_bound_raises_queue_full() -> None:
    d = Driver(cfg(max_waiting=2, max_num_seqs=1))
    d.add(make_request("a", prompt(3), 4))
    d.add(make_request("b", prompt(3, 1), 4))
    with pytest.raises(QueueFull):
        d.add(make_request("c", prompt(3, 2), 4))
    d.step()  # admits a; b still waits (one seq id)
    d.add(make_request("c", prompt(3, 2), 4))
    with pytest.raises(QueueFull):
        d.add(make_request("e", prompt(3, 3), 4))
    d.run()
    for r in "abc":
        d.assert_matches_reference(r)


def test_a_request_whose_sequences_do_not_all_fit_queues_none_of_them() -> None:
    d = Driver(cfg(max_waiting=8, max_num_seqs=1))
    d.add(make_request("run", prompt(3), 50))
    d.step()  # "run" holds the only sequence: everything else waits
    group = [make_request(f"g{i}", prompt(3, i), 4, client="c") for i in range(5)]
    with pytest.raises(QueueFull):  # 5 > 8 // 2: more than one client may ever hold
        d.add_group(group)
    assert not d.sched.waiting and not any(g.req_id in d.sched._by_id for g in group)
    d.add_group(group[:4])
    assert list(d.sched.waiting) == group[:4]


def test_one_client_cannot_fill_the_queue_and_a_newcomer_always_gets_in() -> None:
    d = Driver(cfg(max_waiting=12, max_num_seqs=1))
    d.add(make_request("run", prompt(3), 200))
    d.step()
    flood = 0
    with pytest.raises(QueueFull):
        while True:  # one client alone: at most half the queue
            d.add(make_request(f"a{flood}", prompt(3, flood), 4, client="A"))
            flood += 1
    assert flood == 6
    d.add(make_request("b0", prompt(3, 99), 4, client="B"))  # room kept for a newcomer
    with pytest.raises(QueueFull):  # A is over its share (12 // 3 = 4) while B waits
        d.add(make_request("a-more", prompt(3, 98), 4, client="A"))
    d.add(make_request("c0", prompt(3, 97), 4, client="C"))
    d.add(make_request("b1", prompt(3, 96), 4, client="B"))
    assert sum(r.client == "A" for r in d.sched.waiting) == 6
    # everyone's requests complete, the flood's too
    d.sched.abort("run", d.now)
    d.run()
    for r in ["b0", "b1", "c0", *(f"a{i}" for i in range(6))]:
        d.assert_matches_reference(r)


def test_aborting_waiting_requests_frees_their_places_at_once() -> None:
    d = Driver(cfg(max_waiting=4, max_num_seqs=1))
    d.add(make_request("run", prompt(3), 50))
    d.step()
    for round_ in range(20):  # a client that sends and gives up, over and over
        group = [make_request(f"r{round_}-{i}", prompt(3, i), 4, client="x") for i in range(2)]
        d.add_group(group)
        for g in group:
            d.sched.abort(g.req_id, d.now)
    assert not d.sched.waiting
    d.add(make_request("other", prompt(3, 7), 4, client="y"))


def test_a_lane_others_wait_on_bounds_its_prompt_chunks() -> None:
    """Lanes step one after the other: a reproducible request decoding in its own lane
    waits for the shared lane's step, so a prompt there is chunked as if it decoded in it."""
    c = cfg(max_num_batched_tokens=512, max_stall_s=0.25, min_prefill_chunk=32)
    for others, want in ((False, 512), (True, 32)):
        sched = Scheduler(c)
        sched.add(make_request("p", prompt(2000), 4))
        out = sched.schedule(0.0, others_waiting=others)
        assert [len(ch.tokens) for ch in out.batch.chunks] == [want]


# ---- preemption -------------------------------------------------------------------------


def test_a_pool_for_two_prompts_serves_ten_without_thrashing() -> None:
    """Admission by the whole prompt plus the running requests' expected growth: with a
    pool for about two prompts, ten prompts of 30-45% of it run about two at a time and
    are never preempted (admitting by the first chunk let a third in, and preempted over
    and over)."""
    rng = random.Random(7)
    d = Driver(cfg(max_num_seqs=8, kv_capacity=100, max_num_batched_tokens=16, max_waiting=64))
    for i in range(10):
        d.add(make_request(f"r{i}", prompt(rng.randint(30, 45), i), 12))
    most = most_running(d)
    for i in range(10):
        d.assert_matches_reference(f"r{i}")
    assert sum(r.num_preemptions for r in d.reqs.values()) == 0
    assert most == 2


@pytest.mark.parametrize(
    ("per_step", "per_token", "per_cell", "together"),
    [(1e-2, 1e-4, 1e-7, 2), (0.0, 1e-3, 0.0, 1), (0.0, 1e-3, 5e-5, 1)],
    ids=["gpu-like", "compute-bound", "compute-bound-attention"],
)
def test_under_kv_pressure_steps_are_shared_only_where_batching_pays(
    per_step: float, per_token: float, per_cell: float, together: int
) -> None:
    """When the pool cannot hold everyone waiting, a newcomer joins the running requests
    only if a step of two costs well under two steps of one (GPU-like: a fixed cost per
    step); where each sequence costs its own (compute-bound), they run one after another.
    The cost is learned from decode steps of one and of two sequences: a warm-up of two
    short requests, then the same prompts one after another — deeper, so where attention
    costs (per KV cell) a step of one deep sequence costs what two shallow ones did, which
    must not read as a second sequence being free."""
    rng = random.Random(7)
    fake = FakeEngine(
        seconds_per_step=per_step, seconds_per_token=per_token, seconds_per_cell=per_cell
    )
    d = Driver(
        cfg(max_num_seqs=8, kv_capacity=100, max_num_batched_tokens=16, max_waiting=64), fake
    )
    d.add(make_request("w0", prompt(3), 4))
    d.add(make_request("w1", prompt(3, 1), 12))
    d.run()
    prompts = [prompt(rng.randint(30, 45), i) for i in range(10)]
    for i, p in enumerate(prompts):
        d.add(make_request(f"s{i}", p, 12))
        d.run()
    for i, p in enumerate(prompts):
        d.add(make_request(f"r{i}", p, 12))
    most = 0  # running at once while the pool cannot hold everyone waiting
    while d.sched.has_work:
        d.step()
        if len(d.sched.waiting) >= 2:  # two more prompts never fit beside a running one
            most = max(most, len(d.sched.running))
    for i in range(10):
        d.assert_matches_reference(f"r{i}")
    assert most == together


@pytest.mark.parametrize(
    ("per_step", "per_token", "tokens", "together"),
    [(2e-2, 1e-5, 3, 4), (1e-4, 2e-3, 3, 4), (1e-4, 2e-3, 1, 1)],
    ids=["gpu-like", "compute-bound", "compute-bound-one-token"],
)
def test_prompts_arriving_together_share_a_step_unless_their_streams_end_at_once(
    per_step: float, per_token: float, tokens: int, together: int
) -> None:
    """Four 60-token prompts at once on an idle server. Where a step's fixed cost dwarfs
    a prompt's (GPU-like), one step for all four brings every first token about as soon
    as one alone. Where a prompt costs its tokens (a few CPU cores), one a step would give
    the first its token four times sooner — and then pause its stream for each of the
    other three: the four share one step, as llama-server's do. Only requests that end
    at their first token (`max_tokens` 1: nothing to pause) go one a step there, for the
    lower mean time to first token."""
    fake = FakeEngine(seconds_per_step=per_step, seconds_per_token=per_token)
    d = Driver(cfg(max_num_seqs=8, kv_capacity=4000, max_num_batched_tokens=512), fake)
    for i, n in enumerate([20, 70, 40, 110, 30, 90]):  # the cost model learns this machine
        d.add(make_request(f"w{i}", prompt(n, i), 3))
        d.run()
    reqs = [d.add(make_request(f"r{i}", prompt(60, 10 + i), tokens)) for i in range(4)]
    clock, first = 0.0, {}
    while len(first) < len(reqs):
        s = d.step()
        if clock == 0.0:  # the first step after they arrived
            assert sum(r in reqs for r in s.out.reqs) == together
        clock += per_step + per_token * s.out.batch.num_tokens
        first |= {r.req_id: clock for r in reqs if r.output_ids and r.req_id not in first}
    mean = sum(first.values()) / len(first)
    one_step = per_step + per_token * 240  # all four in one step
    assert mean <= one_step * 1.05 if together == 4 else mean < 0.75 * one_step
    d.run()
    for r in reqs:
        d.assert_matches_reference(r.req_id)


def test_the_victim_is_the_request_with_the_least_computed() -> None:
    """Preemption throws away the victim's KV: the one with the fewest computed tokens
    costs the least to recompute, newest or not."""
    d = Driver(cfg(max_num_seqs=3, kv_capacity=50, max_num_batched_tokens=16, reserve_growth=False))
    old = d.add(make_request("old", prompt(3), 30))  # short prompt, long output
    big = d.add(make_request("big", prompt(14, 1), 30))  # newer, more computed
    while big.num_computed < 14:
        d.step()
    assert old.num_computed < big.num_computed
    while True:
        lost = old.num_computed
        s = d.step()
        if old.num_preemptions or big.num_preemptions:
            break
    assert old.num_preemptions == 1 and big.num_preemptions == 0
    assert s.stats is not None and s.stats.num_recomputed_tokens == lost  # what it threw away
    d.run()
    d.assert_matches_reference("old")
    d.assert_matches_reference("big")


def test_the_request_with_least_work_done_is_preempted_then_resumed_exactly() -> None:
    d = Driver(cfg(max_num_seqs=2, kv_capacity=30, max_num_batched_tokens=16, reserve_growth=False))
    a = d.add(make_request("a", prompt(8), 14))  # needs 8 + 13 cells
    b = d.add(make_request("b", prompt(6, 1), 10))  # needs 6 + 9 cells
    c = d.add(make_request("c", prompt(2, 2), 2))  # waits for a seq id
    first = d.step()
    while not first.out.num_preempted:
        first = d.step()
    assert first.stats is not None and first.stats.num_preempted == 1
    assert b.status is RequestStatus.WAITING and b.num_preemptions == 1
    assert a.num_preemptions == 0 and first.out.reqs == [a]
    assert len(first.out.batch.released) == 1  # b's seq id goes back in the same batch
    assert list(d.sched.waiting) == [b, c]  # the preempted request is first in line
    d.run()
    assert a.num_preemptions == 0 and b.num_preemptions == 1
    resumed = next(
        s for s in d.steps[d.steps.index(first) + 1 :] if any(r is b for r in s.out.reqs)
    )
    chunk = resumed.out.batch.chunks[resumed.out.reqs.index(b)]
    [start] = [s for s in resumed.out.batch.starts if s.seq_id == chunk.seq_id]
    assert chunk.pos0 == 0
    assert len(chunk.tokens) == b.num_prompt + len(start.history)
    assert len(start.history) > 0
    assert start.history == d.token_ids("b")[: len(start.history)]
    for r in "abc":
        d.assert_matches_reference(r)


def test_preempted_request_is_not_readmitted_in_the_same_step() -> None:
    """Preemption frees cells for the running requests to grow into; handing them straight
    back to the victim (from position 0) throws its KV away for nothing and thrashes.
    vLLM v1 admits no waiting request in a step that preempted."""
    d = Driver(
        cfg(
            max_num_seqs=2,
            kv_capacity=12,
            max_num_batched_tokens=8,
            max_prefill_chunk=3,
            reserve_growth=False,
        )
    )
    d.add(make_request("a", prompt(2), 10))  # 2 + 9 cells: fits alone
    b = d.add(make_request("b", prompt(2, 1), 10))
    readmitted = []
    while d.sched.has_work:
        before = b.num_preemptions
        step = d.step()
        if b.num_preemptions > before and any(r is b for r in step.out.reqs):
            readmitted.append(len(d.steps))
    d.assert_matches_reference("a")
    d.assert_matches_reference("b")
    assert readmitted == [], (
        f"b was preempted {b.num_preemptions} times and restarted from position 0 in the "
        f"very batch that preempted it at steps {readmitted}"
    )


def test_preemption_with_many_requests_matches_reference() -> None:
    d = Driver(cfg(max_num_seqs=4, kv_capacity=40, max_num_batched_tokens=12, reserve_growth=False))
    for i in range(8):
        d.add(make_request(f"r{i}", prompt(3 + 2 * i, i), 30 - 2 * i))
    d.run()
    assert sum(r.num_preemptions for r in d.reqs.values()) > 0
    for r in d.reqs:
        d.assert_matches_reference(r)


def test_time_kept_out_by_kv_is_counted_per_request() -> None:
    """A request that waits because the pool is full counts that wait, and so does the
    queue behind a blocked head (it waits for KV too); one admitted at once counts none."""
    d = Driver(cfg(max_num_seqs=4, kv_capacity=40, max_num_batched_tokens=32))
    d.add(make_request("a", prompt(30), 5))
    d.step()  # a holds 30 of 40 cells: b's 28 do not fit beside it, c waits behind b
    d.add(make_request("b", prompt(28, 1), 5, arrival=d.now))
    d.add(make_request("c", prompt(5, 2), 5, arrival=d.now))
    waited: dict[int, float] = {}  # by prompt length
    while d.sched.has_work:
        s = d.step()
        if s.stats is not None:
            waited.update({f.num_prompt_tokens: f.kv_wait_s for f in s.stats.finished})
    assert waited[30] == 0.0
    assert waited[28] >= 3.0 and waited[5] >= 3.0  # a's five tokens take 4+ steps of 1 s


def swap_cfg(**kw: int | None) -> SchedulerConfig:
    """Preempts (no growth reserve) with room for every victim in the swap space."""
    base: dict[str, int | None] = dict(
        max_num_seqs=2, kv_capacity=30, max_num_batched_tokens=16, reserve_growth=False,
        swap_cells=1_000, kv_bytes_per_cell=1,
    )  # fmt: skip
    base.update(kw)
    return cfg(**base)


def run_to_preemption(d: Driver, victim: Request) -> tuple[Step, int, int]:
    """Step until `victim` is preempted: that step, the seq id and the cells it had."""
    while True:
        seq, computed = victim.seq_id, victim.num_computed
        step = d.step()
        if victim.num_preemptions:
            assert seq is not None
            return step, seq, computed


def test_a_victim_swapped_to_host_ram_resumes_where_it_stopped() -> None:
    """With swap space, preemption keeps the victim's KV (saved before its seq id is
    released) and resumes it from there (restored into its new seq id before its next
    chunk): nothing is recomputed and the output is what it would have been."""
    d = Driver(swap_cfg(), FakeEngine(seconds_per_token=1e-3))
    a = d.add(make_request("a", prompt(8), 14))
    b = d.add(make_request("b", prompt(6, 1), 10))
    step, seq, computed = run_to_preemption(d, b)
    assert step.stats is not None
    assert (step.stats.num_preempted, step.stats.num_swapped_out) == (1, 1)
    assert step.stats.num_recomputed_tokens == 0
    assert b.swap_key is not None and b.num_computed == computed > 0
    assert step.out.batch.swap_out == [(seq, b.swap_key)]
    assert seq in step.out.batch.released
    key = b.swap_key
    d.run()
    resumed = next(s for s in d.steps if s.out.batch.swap_in)
    chunk = resumed.out.batch.chunks[resumed.out.reqs.index(b)]
    assert resumed.out.batch.swap_in == [(key, chunk.seq_id)]
    assert chunk.pos0 == computed  # the restored cells are not fed again
    assert a.num_preemptions == 0 and b.num_preemptions == 1
    d.assert_matches_reference("a")
    d.assert_matches_reference("b")
    assert d.sched.kv.swap_used == 0 and not d.fake.swapped


def test_a_victim_that_does_not_fit_the_swap_space_is_recomputed() -> None:
    d = Driver(swap_cfg(swap_cells=4), FakeEngine(seconds_per_token=1e-3))
    d.add(make_request("a", prompt(8), 14))
    b = d.add(make_request("b", prompt(6, 1), 10))
    step, _, computed = run_to_preemption(d, b)
    assert step.stats is not None and step.stats.num_swapped_out == 0
    assert step.stats.num_recomputed_tokens == computed > 4
    assert b.swap_key is None and not step.out.batch.swap_out
    d.run()
    d.assert_matches_reference("a")
    d.assert_matches_reference("b")


def test_a_swap_the_engine_could_not_restore_is_recomputed() -> None:
    d = Driver(swap_cfg(), FakeEngine(seconds_per_token=1e-3, lose_swaps={0}))
    d.add(make_request("a", prompt(8), 14))
    b = d.add(make_request("b", prompt(6, 1), 10))
    _, _, computed = run_to_preemption(d, b)
    assert b.swap_key == 0
    recomputed = 0
    while d.sched.has_work:
        s = d.step()
        recomputed += s.stats.num_recomputed_tokens if s.stats else 0
    assert recomputed == computed and b.num_preemptions == 1
    d.assert_matches_reference("a")
    d.assert_matches_reference("b")
    assert d.sched.kv.swap_used == 0


def test_an_abandoned_swapped_request_frees_its_host_ram() -> None:
    d = Driver(swap_cfg(), FakeEngine(seconds_per_token=1e-3))
    d.add(make_request("a", prompt(8), 14))
    b = d.add(make_request("b", prompt(6, 1), 10))
    run_to_preemption(d, b)
    key = b.swap_key
    assert key is not None and d.sched.kv.swap_used > 0
    d.sched.abort("b", d.now)
    assert d.sched.kv.swap_used == 0
    step = d.step()
    assert step.out.batch.swap_drop == [key]
    assert not d.fake.swapped
    d.run()
    d.assert_matches_reference("a")


@pytest.mark.parametrize("copy_bytes_per_s", [1e11, 1e7])
def test_swap_or_recompute_follows_the_measured_costs(copy_bytes_per_s: float) -> None:
    """Each victim goes the cheaper way by the scheduler's two learned models: copying its
    cells out and back (the engine's measured copy rate) against computing them again (the
    measured prefill cost). Here a token costs 1 ms to compute and a cell is 256 KiB: a
    fast copy (100 GB/s, 5 us a cell both ways) swaps every victim, a slow one (10 MB/s,
    52 ms) recomputes every victim once a swap has shown how slow it is."""
    cell = 1 << 18
    fake = FakeEngine(seconds_per_token=1e-3, swap_bytes_per_s=copy_bytes_per_s,
                      bytes_per_cell=cell)  # fmt: skip
    d = Driver(
        cfg(max_num_seqs=4, kv_capacity=40, max_num_batched_tokens=12, reserve_growth=False,
            swap_cells=10_000, kv_bytes_per_cell=cell),
        fake,
    )  # fmt: skip
    for i in range(8):
        d.add(make_request(f"r{i}", prompt(3 + 2 * i, i), 30 - 2 * i))
    steps: list[list[str]] = []  # the kind of each preemption, by step
    thrown = 0  # computed tokens preemption threw away
    while d.sched.has_work:
        s = d.step().stats
        thrown += s.num_recomputed_tokens if s is not None else 0
        if s is not None and s.num_preempted:
            recomputed = s.num_preempted - s.num_swapped_out
            steps.append(["swap"] * s.num_swapped_out + ["recompute"] * recomputed)
    for r in d.reqs:
        d.assert_matches_reference(r)
    kinds = [k for step in steps for k in step]
    assert len(kinds) >= 3
    if copy_bytes_per_s > 1e9:  # (a victim with nothing computed yet has nothing to swap)
        assert "swap" in kinds and thrown == 0
    else:  # before any copy was timed the prior says swap; after, never again
        first = next(i for i, step in enumerate(steps) if "swap" in step)
        assert {k for step in steps[first + 1 :] for k in step} == {"recompute"}, steps
        assert thrown > 0


def test_backend_kv_full_rolls_back_and_preempts_the_newest() -> None:
    d = Driver(cfg(), FakeEngine(faults={3: KVCacheFull("fragmented")}))
    a = d.add(make_request("a", prompt(5), 8))
    b = d.add(make_request("b", prompt(5, 1), 8))
    for _ in range(3):
        d.step()
    used = d.sched.kv.used
    out = d.sched.schedule(d.now + 1)
    assert d.sched.kv.used == used + 2
    with pytest.raises(KVCacheFull):
        d.fake.step(out.batch)
    d.sched.rollback_kv_full(out)
    assert b.status is RequestStatus.WAITING and b.num_preemptions == 1
    assert d.sched.kv.used == a.num_computed
    d.sched.kv.sanity_checks(len(d.sched.running))
    d.run()
    d.assert_matches_reference("a")
    d.assert_matches_reference("b")


def test_engine_failure_ends_only_that_steps_requests() -> None:
    d = Driver(cfg(max_num_seqs=1), FakeEngine(faults={2: BackendError("boom")}))
    a = d.add(make_request("a", prompt(5), 8))
    d.add(make_request("b", prompt(5, 1), 8))
    d.step()
    d.step()
    out = d.sched.schedule(d.now + 1)
    assert out.reqs == [a]
    with pytest.raises(BackendError):
        d.fake.step(out.batch)
    outputs, stats = d.sched.fail(out, d.now + 1)
    assert [(o.req_id, o.finish_reason, o.text, o.token_ids) for o in outputs] == [
        ("a", "error", "", [])
    ]
    assert [f.finish_reason for f in stats.finished] == ["error"]
    assert a.status is RequestStatus.FINISHED_ERROR and d.sched.kv.used == 0
    d.run()
    d.assert_matches_reference("b")


# ---- finishing: length, EOG, stop strings -----------------------------------------------


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens_finishes_with_length_and_exact_count(max_tokens: int) -> None:
    d = Driver(cfg())
    d.add(make_request("a", prompt(4), max_tokens))
    d.run()
    stream = d.streams["a"]
    assert len(stream) == max_tokens
    assert [o.num_output_tokens for o in stream] == list(range(1, max_tokens + 1))
    assert stream[-1].finish_reason == "length"
    assert all(o.num_prompt_tokens == 4 for o in stream)
    d.assert_matches_reference("a")
    fins = [f for s in d.steps if s.stats for f in s.stats.finished]
    assert [(f.finish_reason, f.num_output_tokens) for f in fins] == [("length", max_tokens)]


def test_eog_finishes_with_stop_and_no_text() -> None:
    d = Driver(cfg())
    d.add(make_request("a", [EOG_MARK, 7, 3, 4], 10))
    d.run()
    ids = d.token_ids("a")
    assert len(ids) == 4 and ids[-1] == EOG and EOG not in ids[:-1]
    assert d.finish_reason("a") == "stop"
    assert d.streams["a"][-1].text == ""
    assert d.text("a") == "".join(token_bytes(t).decode() for t in ids[:-1])
    d.assert_matches_reference("a")


def test_eog_on_the_last_allowed_token_is_stop_not_length() -> None:
    d = Driver(cfg())
    d.add(make_request("a", [EOG_MARK, 5, 9], 3))
    d.run()
    assert d.token_ids("a")[-1] == EOG and len(d.token_ids("a")) == 3
    assert d.finish_reason("a") == "stop"


def spanning_stop(prompt_ids: list[int], n: int) -> tuple[str, int, int]:
    """A stop string made of the end of token k and the start of token k+1, first seen there.

    Returns (stop, k, offset in the text where the stop starts)."""
    ref = reference(prompt_ids, n)
    pieces = [token_bytes(t).decode() for t in ref.token_ids]
    full = "".join(pieces)
    for k in range(1, n - 1):
        end_k = len("".join(pieces[: k + 1]))
        stop = full[end_k - 2 : end_k + 2]
        if full.find(stop) == end_k - 2:
            return stop, k, end_k - 2
    raise AssertionError("no usable stop in this output")


def test_stop_string_spanning_two_tokens_truncates_and_finishes_stop() -> None:
    p = prompt(6)
    stop, k, at = spanning_stop(p, 20)
    full = reference(p, 20).text
    d = Driver(cfg())
    d.add(make_request("a", p, 20, stops=(stop,)))
    d.run()
    assert d.finish_reason("a") == "stop"
    assert d.text("a") == full[:at]
    assert d.token_ids("a") == reference(p, 20).token_ids[: k + 2]
    # The first half of the stop was held back: no delta ever showed part of it at the end.
    emitted = ""
    for o in d.streams["a"]:
        emitted += o.text
        assert emitted == full[: len(emitted)]
    # After token k the stop's first half (its last two characters) is held back ...
    assert "".join(o.text for o in d.streams["a"][: k + 1]) == full[:at]
    # ... and token k+1 completes the stop: nothing more is shown.
    assert d.streams["a"][k + 1].text == ""
    d.assert_matches_reference("a")


def test_stop_string_within_one_token() -> None:
    p = prompt(6, 4)
    ref = reference(p, 12)
    stop = token_bytes(ref.token_ids[5]).decode().strip()  # e.g. "t17"
    d = Driver(cfg())
    d.add(make_request("a", p, 12, stops=(stop,)))
    d.run()
    assert d.finish_reason("a") == "stop"
    assert stop not in d.text("a")
    assert len(d.token_ids("a")) <= 6
    d.assert_matches_reference("a")


def test_held_back_text_is_flushed_when_length_ends_the_request() -> None:
    p = prompt(5, 2)
    ref = reference(p, 4)
    # A stop that starts like the last token's text but never completes.
    stop = token_bytes(ref.token_ids[-1]).decode() + "\x00"
    d = Driver(cfg())
    d.add(make_request("a", p, 4, stops=(stop,)))
    d.run()
    assert d.finish_reason("a") == "length"
    assert d.text("a") == ref.text
    assert d.streams["a"][-1].text.endswith(token_bytes(ref.token_ids[-1]).decode())


# ---- stats ------------------------------------------------------------------------------


def test_stats_are_consistent_with_the_run() -> None:
    d = Driver(cfg(max_num_seqs=2, max_num_batched_tokens=10))
    arrivals = {"a": 0.0, "b": 0.0, "c": 0.0}
    d.add(make_request("a", prompt(4), 5, arrival=0.0))
    d.add(make_request("b", prompt(12, 1), 3, arrival=0.0))
    d.add(make_request("c", [EOG_MARK, 6, 1, 2], 9, arrival=0.0))
    first_token_at: dict[str, float] = {}
    while d.sched.has_work:
        step = d.step()
        st = step.stats
        assert st is not None
        assert st.num_running == len(d.sched.running)
        assert st.num_waiting == len(d.sched.waiting)
        assert st.kv_used == d.sched.kv.used == sum(r.num_computed for r in d.sched.running)
        assert st.kv_capacity == 1_000
        assert st.num_step_tokens == step.out.batch.num_tokens
        assert st.num_step_seqs == len(step.out.batch.chunks)
        assert st.num_generated_tokens == len(step.outputs)
        new = [o.req_id for o in step.outputs if o.req_id not in first_token_at]
        for r in new:
            first_token_at[r] = d.now
        assert sorted(st.ttft_s) == sorted(d.now - arrivals[r] for r in new)
        assert len(st.queue_s) == len(new)
        assert st.num_prompt_tokens == sum(d.reqs[r].num_prompt for r in new)
        assert len(st.itl_s) == len(step.outputs) - len(new)
        assert all(x == 1.0 for x in st.itl_s)  # one step = one time unit here
    all_stats = [s.stats for s in d.steps if s.stats]
    fins = [f for s in all_stats for f in s.finished]
    assert Counter(f.finish_reason for f in fins) == {"length": 2, "stop": 1}
    assert sorted(f.num_output_tokens for f in fins) == sorted(len(d.token_ids(r)) for r in "abc")
    assert sum(s.num_generated_tokens for s in all_stats) == sum(len(d.token_ids(r)) for r in "abc")
    assert sum(len(s.ttft_s) for s in all_stats) == 3
    # c waited for a seq id: its queue time is when it was first scheduled.
    c_fin = next(f for f in fins if f.finish_reason == "stop")
    assert c_fin.queue_s is not None and c_fin.queue_s > 1.0
    for r in "abc":
        d.assert_matches_reference(r)


# ---- randomized workloads against the slow reference ------------------------------------


STOP_POOL = ("t7 t", "3 t1", "t22", "9 t4", "t31 t")
VOCAB_PROMPT = 40


@pytest.mark.parametrize("seed", range(10))
def test_random_workload_matches_reference(seed: int) -> None:
    rng = random.Random(seed)
    config = cfg(
        max_num_seqs=rng.choice([2, 3, 5]),
        kv_capacity=rng.choice([40, 48, 64]),
        max_num_batched_tokens=rng.choice([6, 8, 16]),
        max_prefill_chunk=rng.choice([None, 3, 5]),
        max_waiting=1_000,
    )
    d = Driver(config)
    n_reqs = 40
    pending: list[tuple[int, Request]] = []
    for i in range(n_reqs):
        n_prompt = rng.randint(1, 24)
        max_tokens = rng.randint(1, min(24, config.kv_capacity - n_prompt + 1))
        ids = [rng.randint(1, VOCAB_PROMPT) for _ in range(n_prompt)]
        if n_prompt >= 2 and rng.random() < 0.2:
            ids[0], ids[1] = EOG_MARK, n_prompt + rng.randint(0, max_tokens)
        stops = tuple(rng.sample(STOP_POOL, k=rng.randint(0, 2)))
        at = rng.randint(0, 80)
        pending.append((at, make_request(f"r{i}", ids, max_tokens, arrival=at, stops=stops)))
    pending.sort(key=lambda x: x[0])
    aborted: set[str] = set()
    step_no = 0
    while pending or d.sched.has_work:
        step_no += 1
        assert step_no < 5_000, "livelock"
        while pending and pending[0][0] <= step_no:
            d.add(pending.pop(0)[1])
        if d.reqs and rng.random() < 0.04:
            victim = rng.choice(sorted(d.reqs))
            if not d.reqs[victim].status.is_finished:
                aborted.add(victim)
            d.sched.abort(victim, d.now)
        d.now = step_no - 1.0
        step = d.step()
        if step.stats is not None:
            assert step.stats.kv_used <= config.kv_capacity
    assert len(d.reqs) == n_reqs
    for req_id, req in d.reqs.items():
        assert req.status.is_finished
        if req_id in aborted:
            assert req.status is RequestStatus.FINISHED_ABORTED
            ref = reference(req.prompt_ids, req.max_tokens, req.stops.stops)
            got = d.token_ids(req_id)
            assert got == ref.token_ids[: len(got)]
            assert all(o.finish_reason is None for o in d.streams[req_id])
        else:
            d.assert_matches_reference(req_id)
    assert d.sched.kv.used == 0
    assert d.sched.kv.num_free_seqs == config.max_num_seqs


def test_reference_is_what_the_fake_produces_alone() -> None:
    """The fake and the reference agree, so the tests above compare like with like."""
    p = prompt(5)
    ref = reference(p, 6)
    hist = list(p)
    for tok in ref.token_ids:
        assert next_token(hist) == tok
        hist.append(tok)


# ---- prefix cache -----------------------------------------------------------------------


def test_a_prompt_the_cache_holds_is_not_computed_again() -> None:
    """A finished request's KV stays as cache: a later prompt with the same start reads
    those cells (its first chunk starts after them) and its output is what it would be."""
    d = Driver(cfg(prefix_cache=True, max_cached_seqs=4))
    system = prompt(16, 3)
    d.add(make_request("a", [*system, 1, 2, 3], 5))
    d.run()
    assert d.sched.kv.cached == 16 + 3 + 4  # prompt and the output tokens it computed
    b = d.add(make_request("b", [*system, 9, 9], 5))
    step = d.step()
    chunk = step.out.batch.chunks[step.out.reqs.index(b)]
    assert chunk.pos0 == 16 and b.num_cached == 16
    d.run()
    d.assert_matches_reference("a")
    d.assert_matches_reference("b")


def test_the_cache_gives_way_to_requests_and_keeps_outputs_exact() -> None:
    """Seeded workloads of shared prefixes in a small pool: cached prefixes are read where
    they match and evicted for new work, the pool's and the engine's cells stay in step
    (the driver checks after every step) and every request gets exactly its output alone."""
    read: set[tuple[int, str]] = set()  # (seed, request) that read a cached prefix
    for seed in range(12):
        rng = random.Random(seed)
        d = Driver(
            cfg(max_num_seqs=3, kv_capacity=120, max_num_batched_tokens=16, prefix_cache=True,
                max_cached_seqs=3)
        )  # fmt: skip
        heads = [prompt(rng.randint(4, 20), s) for s in range(3)]
        for i in range(14):
            tail = [rng.randrange(1, 40) for _ in range(rng.randint(1, 12))]
            d.add(make_request(f"r{i}", rng.choice(heads) + tail, rng.randint(1, 10)))
            for _ in range(rng.randint(0, 6)):
                if d.sched.has_work:
                    d.step()
                    read |= {(seed, r.req_id) for r in d.sched.running if r.num_cached}
        while d.sched.has_work:
            d.step()
            read |= {(seed, r.req_id) for r in d.sched.running if r.num_cached}
        for i in range(14):
            d.assert_matches_reference(f"r{i}")
        assert len(d.sched.kv.engine_holders) <= 3
    assert len(read) > 20


def prompt_tokens_computed(d: Driver) -> int:
    return sum(step.stats.num_step_prompt_tokens for step in d.steps if step.stats)


@pytest.mark.parametrize("window", [0, 8])
def test_requests_behind_one_prompt_compute_it_once(window: int) -> None:
    """A burst behind one long system prompt: the first request computes it and offers it
    to the cache as soon as it is computed, before its own question; the others wait for
    that, read it, and compute only their own questions. With a sliding window too: the
    offer ends where the questions part, so the read ends where its window is intact (the
    fake fails a read of a cell llama.cpp may overwrite). Each output is what it is alone."""
    d = Driver(
        cfg(prefix_cache=True, max_cached_seqs=8, max_num_batched_tokens=64,
            sliding_window=window),
        FakeEngine(window=window),
    )  # fmt: skip
    system = prompt(100, 3)
    reqs = [d.add(make_request(f"q{i}", [*system, 1 + i, 2 + i], 4)) for i in range(4)]
    d.run()
    assert prompt_tokens_computed(d) == 102 + 3 * 2
    assert [r.num_cached for r in reqs] == [0, 100, 100, 100]
    for r in reqs:
        d.assert_matches_reference(r.req_id)
    assert d.sched.kv.evictable == d.sched.kv.cached


@pytest.mark.parametrize("window", [0, 8])
def test_a_prompt_is_offered_though_the_cache_holds_its_first_tokens(window: int) -> None:
    """Every prompt starts with BOS, so after any request the cache holds the first token of
    the next: a prompt being offered gives up its own copy of what the cache holds and
    tags the cache's, instead of not being offered at all — so a burst behind one system
    prompt still computes it once after a warm-up request."""
    d = Driver(
        cfg(prefix_cache=True, max_cached_seqs=8, max_num_batched_tokens=64,
            sliding_window=window),
        FakeEngine(window=window),
    )  # fmt: skip
    bos = 2
    d.add(make_request("warm-up", [bos, 9, 9, 9], 2))
    d.run()
    system = [bos, *prompt(100, 3)]
    reqs = [d.add(make_request(f"q{i}", [*system, 1 + i, 2 + i], 4)) for i in range(4)]
    d.run()
    assert [r.num_cached for r in reqs] == [0 if window else 1, 101, 101, 101]
    for r in reqs:
        d.assert_matches_reference(r.req_id)


@pytest.mark.parametrize("window", [0, 8])
def test_a_burst_is_offered_its_shared_prompt_when_the_cache_holds_all_its_ids(window: int) -> None:
    """The cache's sequence ids are all taken (by earlier conversations): offering a burst's
    shared prompt gives up the least useful one, whose release takes a step, and still
    offers it at once (a read must end at a point offered, under a window)."""
    d = Driver(
        cfg(prefix_cache=True, max_cached_seqs=2, max_num_seqs=4, max_num_batched_tokens=64,
            sliding_window=window),
        FakeEngine(window=window),
    )  # fmt: skip
    for i in range(2):
        d.add(make_request(f"old{i}", prompt(30, 20 + i), 3))
    d.run()
    assert d.sched.kv.num_holders == 2
    system = prompt(100, 3)
    reqs = [d.add(make_request(f"q{i}", [*system, 1 + i, 2 + i], 4)) for i in range(4)]
    d.run()
    assert [r.num_cached for r in reqs] == [0, 100, 100, 100]
    for r in reqs:
        d.assert_matches_reference(r.req_id)


@pytest.mark.parametrize("window", [0, 8])
def test_a_request_sharing_the_start_of_a_prompt_being_computed_reads_that_start(
    window: int,
) -> None:
    """A long prompt is being computed when a request sharing only its start arrives: the
    running one offers the shared part to the cache as soon as it has computed it, so the
    newcomer reads it and computes only its own tokens — with a sliding window too, where
    a read must end at a point offered (the fake fails a read of a cell llama.cpp may
    overwrite), which the end of the long prompt is not."""
    d = Driver(
        cfg(prefix_cache=True, max_cached_seqs=8, max_num_batched_tokens=32,
            sliding_window=window),
        FakeEngine(window=window),
    )  # fmt: skip
    system = prompt(96, 4)
    long = d.add(make_request("long", [*system, *prompt(200, 9)], 3))
    d.step()
    assert 0 < long.num_computed < 96
    short = d.add(make_request("short", [*system, 5, 6, 7], 3))
    d.run()
    assert short.num_cached == 96
    assert prompt_tokens_computed(d) == 296 + 3
    d.assert_matches_reference("long")
    d.assert_matches_reference("short")


@pytest.mark.parametrize("window", [0, 8])
def test_a_chat_offers_its_system_block_so_later_chats_behind_it_read_it(window: int) -> None:
    """A chat's prompt is offered to the cache at its system block's end too (`offer_at`,
    from the API), so a chat with the same system prompt and another question that comes
    after the first has finished reads the system block — with a sliding window as well,
    where a read must end at a point offered (the end of the first prompt is not one for
    the second). Both outputs are what they are alone."""
    d = Driver(
        cfg(prefix_cache=True, max_cached_seqs=8, sliding_window=window), FakeEngine(window=window)
    )
    system = prompt(80, 6)
    first = make_request("first", [*system, 1, 2, 3], 4)
    first.offer_at = 80
    d.add(first)
    d.run()
    second = make_request("second", [*system, 7, 8], 4)
    second.offer_at = 80
    d.add(second)
    d.run()
    assert second.num_cached == 80
    d.assert_matches_reference("first")
    d.assert_matches_reference("second")


@pytest.mark.parametrize("window", [0, 8])
def test_the_choices_of_one_request_compute_its_prompt_once(window: int) -> None:
    """`n` choices are requests with one prompt, queued together: it is computed once
    and each choice computes only the last token (its logits are each choice's own).
    With a sliding window, the first choice offers all but the last token before computing
    it, since a read must end where its cells' window is intact (the fake marks every cell
    llama.cpp may overwrite, and fails a read of one)."""
    d = Driver(
        cfg(prefix_cache=True, max_cached_seqs=8, sliding_window=window), FakeEngine(window=window)
    )
    p = prompt(80, 5)
    reqs = [make_request(f"c{i}", list(p), 6) for i in range(4)]
    d.add_group(reqs)
    d.reqs.update({r.req_id: r for r in reqs})
    d.run()
    assert prompt_tokens_computed(d) == 80 + 3
    assert [r.num_cached for r in reqs] == [0, 79, 79, 79]
    for r in reqs:
        d.assert_matches_reference(r.req_id)


def test_with_a_sliding_window_only_intact_prefixes_are_read() -> None:
    """llama.cpp may overwrite a window layer's cell that one sequence owns once it lies a
    window behind that sequence's end (the fake marks all such cells and fails any read of
    one). A cached conversation is read whole — its holder's last window is intact — or
    up to the prompt it offered while it ran (pinned), never cut anywhere else; a sequence
    whose own last window the cache would replace with another holder's cells is not
    cached."""
    d = Driver(cfg(prefix_cache=True, max_cached_seqs=8, sliding_window=8), FakeEngine(window=8))
    a = d.add(make_request("a", prompt(40, 1), 5))
    d.run()
    b = d.add(make_request("b", prompt(40, 1)[:30] + [7] * 10, 5))  # a's start, then not
    d.run()
    assert b.num_cached == 0
    c = d.add(make_request("c", [*a.prompt_ids, *a.output_ids, 3, 3], 5))  # a's next turn
    d.run()
    assert c.num_cached == 44  # all a computed: its prompt and output but the last token
    e = d.add(make_request("e", [*prompt(40, 1), 9, 9], 5))  # a's prompt, another question
    d.run()
    assert e.num_cached == 40  # a offered its prompt as it ran: that end stays pinned
    cached = d.sched.kv.cached
    f = d.add(make_request("f", [*prompt(40, 1)[:30], 9, 9], 2))  # its window: a's cells
    d.run()
    assert f.num_cached == 0 and d.sched.kv.cached == cached  # f is not kept
    for r in (a, b, c, e, f):
        d.assert_matches_reference(r.req_id)


@pytest.mark.parametrize("window", [0, 6, 24])
@pytest.mark.parametrize("seed", range(20))
def test_random_cached_workload_matches_reference(seed: int, window: int) -> None:
    """Seeded workloads of conversations that come back for their next turn, bursts behind
    shared prompts and choices of one prompt, in a pool that forces eviction: every output
    is the request's alone, no read touches a cell a window layer may have lost, the
    pool's and the engine's cells stay in step after every step (the driver checks), and
    in the end nothing is locked and every holder id is accounted for."""
    rng = random.Random(seed)
    d = Driver(
        cfg(max_num_seqs=4, kv_capacity=260, max_num_batched_tokens=24, prefix_cache=True,
            max_cached_seqs=5, sliding_window=window),
        FakeEngine(window=window),
    )  # fmt: skip
    heads = [prompt(rng.randint(10, 40), s) for s in range(3)]
    done: list[Request] = []
    for n in range(12):
        kind = rng.random()
        if kind < 0.4 and done:  # a conversation's next turn
            prev = rng.choice(done)
            reqs = [make_request(f"r{n}", [*prev.prompt_ids, *prev.output_ids, 5, 6], 4)]
        elif kind < 0.7:  # choices of one prompt
            p = rng.choice(heads) + [rng.randrange(1, 40) for _ in range(rng.randint(1, 8))]
            reqs = [make_request(f"r{n}.{k}", list(p), rng.randint(1, 6)) for k in range(3)]
        else:  # a burst behind one head (a chat's system block: offered there)
            head = rng.choice(heads)
            reqs = [
                make_request(f"r{n}.{k}", head + [rng.randrange(1, 40) for _ in range(3)], 3)
                for k in range(3)
            ]
            for r in reqs:
                r.offer_at = len(head)
        for r in reqs:
            d.add(r)
        for _ in range(rng.randint(0, 8)):
            if d.sched.has_work:
                d.step()
        done += [r for r in d.reqs.values() if r.status.is_finished and r.output_ids]
    d.run()
    for req_id in d.reqs:
        d.assert_matches_reference(req_id)
    assert d.sched.kv.evictable == d.sched.kv.cached
    assert len(d.sched.kv.engine_holders) <= 5


def test_with_a_sliding_window_conversations_behind_one_system_prompt_are_all_kept() -> None:
    """Two users open with the same short system prompt at once (too short to wait for):
    the second computes it too and, when it finishes, gives its
    copy up for the first user's cells, which are still in their holder's window. So both
    conversations are cached, and each next turn reads its own."""
    d = Driver(cfg(prefix_cache=True, max_cached_seqs=8, sliding_window=64), FakeEngine(window=64))
    system = prompt(20, 2)
    u = [d.add(make_request(f"u{i}", [*system, 30 + i, 31, 32, 33, 34], 5)) for i in range(2)]
    d.run()
    assert d.sched.kv.cached == 20 + 2 * (5 + 4)  # the system prompt once
    nxt = [
        d.add(make_request(f"n{i}", [*r.prompt_ids, *r.output_ids, 7], 3)) for i, r in enumerate(u)
    ]
    d.run()
    assert [r.num_cached for r in nxt] == [29, 29]
    for r in (*u, *nxt):
        d.assert_matches_reference(r.req_id)


def compute_bound_cached_driver() -> Driver:
    """A small pool with a prefix cache, on a compute-bound fake whose cost model has
    learnt that a step of two costs two steps of one (batching does not pay)."""
    fake = FakeEngine(seconds_per_step=0.0, seconds_per_token=1e-3)
    d = Driver(
        cfg(max_num_seqs=8, kv_capacity=200, max_num_batched_tokens=16, prefix_cache=True,
            max_cached_seqs=4),
        fake,
    )  # fmt: skip
    d.add(make_request("w0", prompt(3), 4))
    d.add(make_request("w1", prompt(3, 1), 12))
    d.run()
    return d


def most_running(d: Driver) -> int:
    """Run to the end; the most requests that ran at once."""
    most = 0
    while d.sched.has_work:
        d.step()
        most = max(most, len(d.sched.running))
    return most


def test_the_prefix_cache_does_not_count_as_kv_pressure() -> None:
    """Where batching does not pay, requests the pool cannot hold together run one after
    another; but cells the cache holds and nobody reads give way, so they do not make two
    requests that fit beside each other wait for one another."""
    d = compute_bound_cached_driver()
    d.add(make_request("c", prompt(120, 9), 4))
    d.run()
    assert d.sched.kv.cached >= 120
    for i in range(2):
        d.add(make_request(f"r{i}", [40 + i, *prompt(39, i)], 12))
    most = most_running(d)
    assert most == 2
    for req_id in ("c", "r0", "r1"):
        d.assert_matches_reference(req_id)


def test_what_waiting_requests_will_read_from_the_cache_is_not_kv_pressure() -> None:
    """Where batching does not pay, requests the pool cannot hold together run one after
    another; requests behind a cached prompt need only their own tokens (the cached cells
    are read once, by all of them), so they run together."""
    d = compute_bound_cached_driver()
    system = prompt(120, 9)
    d.add(make_request("c", system, 2))
    d.run()
    reqs = [d.add(make_request(f"r{i}", [*system, 50 + i, *prompt(7, i)], 8)) for i in range(3)]
    most = most_running(d)
    assert most == 3 and [r.num_cached for r in reqs] == [120] * 3
    for r in reqs:
        d.assert_matches_reference(r.req_id)


@pytest.mark.parametrize("window", [4, 16])
def test_with_a_sliding_window_a_prompt_the_cache_could_not_take_is_pinned(window: int) -> None:
    """Two users open with one system prompt at once: the second's prompt cannot be offered
    while it runs (the cache already holds its start, from the first), so a pin keeps the
    window before its end; once it finishes and joins the cache (giving up its copy of the
    system prompt for the first user's, whose pin keeps it intact where the window reaches
    back into it), its next turn reads up to there though the reply came back otherwise."""
    d = Driver(
        cfg(prefix_cache=True, max_cached_seqs=8, sliding_window=window),
        FakeEngine(window=window),
    )
    system = prompt(20, 2)
    u = [d.add(make_request(f"u{i}", [*system, *([30 + i] * 8)], 4)) for i in range(2)]
    d.run()
    nxt = [d.add(make_request(f"n{i}", [*r.prompt_ids, 39, 38, 37], 3)) for i, r in enumerate(u)]
    d.run()
    assert [r.num_cached for r in nxt] == [28, 28]
    for r in (*u, *nxt):
        d.assert_matches_reference(r.req_id)


def test_with_a_sliding_window_older_turns_give_up_their_pins_first() -> None:
    """Each turn of a conversation leaves a pin at its prompt's end. When the cache runs out
    of ids, those pins inside the path go before any cached conversation does: a long
    conversation stays readable to its latest turn."""
    d = Driver(cfg(prefix_cache=True, max_cached_seqs=3, sliding_window=4), FakeEngine(window=4))
    ids = prompt(12, 4)
    for turn in range(6):
        r = d.add(make_request(f"t{turn}", ids, 3))
        d.run()
        if turn:
            assert r.num_cached == len(ids) - 2  # all the last turn computed
        ids = [*ids, *r.output_ids, 5 + turn]
        d.assert_matches_reference(r.req_id)


def _scored_prompt(out: RequestOutput, ids: list[int]) -> list[tuple[int, float]]:
    assert out.prompt_logprobs is not None
    got = [(s.token, s.logprob) for s in out.prompt_logprobs]
    assert got == [(t, prompt_logprob(p, t)) for p, t in enumerate(ids) if p > 0]
    return got


def test_prompt_logprobs_score_every_prompt_token_once_in_chunks_of_the_rows() -> None:
    """echo + logprobs: every prompt token after the first gets its logprob, in order, on
    the request's first output; its chunks stay within the engine's rows per call, and it
    never reads the prefix cache (a cached prefix has no logit rows) while others beside it
    run as usual."""
    d = Driver(
        cfg(max_num_batched_tokens=64, prefix_cache=True, max_cached_seqs=4,
            prompt_logprob_rows=16)
    )  # fmt: skip
    ids = prompt(150)
    d.add(make_request("warm", ids, 3))
    d.run()
    scored = d.add(make_request("scored", ids, 4, prompt_logprobs=2))
    d.add(make_request("beside", prompt(90, 1), 20))
    d.run()
    assert scored.num_cached == 0
    first = d.streams["scored"][0]
    assert len(_scored_prompt(first, ids)) == 149
    assert all(o.prompt_logprobs is None for o in d.streams["scored"][1:])
    assert all(o.prompt_logprobs is None for o in d.streams["beside"])
    d.assert_matches_reference("scored")
    d.assert_matches_reference("beside")
    sizes = [len(c.tokens) for s in d.steps for r, c in zip(s.out.reqs, s.out.batch.chunks,
                                                           strict=True) if r is scored]  # fmt: skip
    assert max(sizes) == 16  # capped (the step budget alone would give 63)


def test_a_prompt_only_request_finishes_when_its_prompt_is_scored() -> None:
    """max_tokens 0 with echo (lm-evaluation-harness's loglikelihood): no token is sampled;
    the request ends with `length` and its prompt's logprobs."""
    d = Driver(cfg(max_num_batched_tokens=32, prompt_logprob_rows=8))
    ids = prompt(40)
    req = d.add(make_request("lp", ids, 0, prompt_logprobs=0))
    d.run()
    (out,) = d.streams["lp"]
    assert out.finish_reason == "length" and out.token_ids == [] and req.output_ids == []
    assert len(_scored_prompt(out, ids)) == 39
    assert not any(c.sample for s in d.steps for c in s.out.batch.chunks)


def test_prompt_logprobs_survive_a_preemption_without_repeats() -> None:
    """A scored request preempted mid-prompt recomputes what it lost and scores each
    position once: the list is the same as when it runs alone."""
    d = Driver(cfg(max_num_seqs=2, kv_capacity=56, max_num_batched_tokens=16,
                   reserve_growth=False, prompt_logprob_rows=8))  # fmt: skip
    hog = d.add(make_request("hog", prompt(25), 30))
    while not hog.output_ids:
        d.step()
    ids = prompt(30, 3)
    scored = d.add(make_request("scored", ids, 6, prompt_logprobs=1))
    for _ in range(20):  # the pool fills while its prompt is computed: it has done least
        d.step()
        if scored.num_preemptions:
            break
    assert scored.num_preemptions == 1
    assert 0 < len(scored.prompt_logprobs) < 29  # it had scored part of its prompt
    d.run()
    _scored_prompt(d.streams["scored"][0], ids)
    d.assert_matches_reference("scored")


# ---- prompts prefilled aside (a side context beside the steps) ----------------------------


def side_cfg(**kw: float | None) -> SchedulerConfig:
    """A target no step with a prompt chunk beside a decoder can keep (1 ms against 10 ms
    a step), a side context for prompts of up to 200 tokens, swap space for them."""
    base: dict[str, float | None] = dict(
        max_num_seqs=4, kv_capacity=1_000, max_num_batched_tokens=64, max_stall_s=0.001,
        side_prefill_tokens=200, swap_cells=1_000, kv_bytes_per_cell=1,
    )  # fmt: skip
    base.update(kw)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


def side_fake(per_step: int = 16, lose: frozenset[int] = frozenset()) -> FakeEngine:
    """Its side context prefills `per_step` tokens a step; the keys in `lose` fail."""
    return FakeEngine(seconds_per_step=0.01, seconds_per_token=1e-3,
                      side_tokens_per_step=per_step, lose_side=set(lose))  # fmt: skip


def decoding(d: Driver, req: Request) -> None:
    """Step until `req` decodes, a few tokens in (its prompt's step taught the cost model
    prompts; a decoder with one token may have come with a burst, whose step is free)."""
    while len(req.output_ids) < 3:
        d.step()


def test_a_prompt_no_step_could_carry_within_the_target_is_prefilled_aside() -> None:
    """Every step with a prompt chunk beside the decoder would go over the target: the
    prompt goes to the side context whole (less its last token) while the decoder keeps
    its one-token steps, comes back as a swapped request, is restored and samples — the
    same output as in place."""
    d = Driver(side_cfg(), side_fake())
    a = d.add(make_request("a", prompt(8), 60))
    decoding(d, a)
    long = d.add(make_request("long", prompt(100, 3), 5))
    step = d.step()
    assert step.out.batch.side_prefill == [(long.swap_key, long.prompt_ids[:99])]
    assert long.req_id in d.sched.aside and long not in d.sched.waiting
    assert step.stats is not None and step.stats.num_running == 2
    while long.req_id in d.sched.aside:  # the decoder alone in every step meanwhile
        step = d.step()
        assert [len(c.tokens) for c in step.out.batch.chunks] == [1]
    assert step.stats is not None and step.stats.aside_prompt_tokens == 99
    assert long.num_computed == 99 and long.swap_key is not None
    restored = d.step()
    (seq,) = [c.seq_id for c, r in zip(restored.out.batch.chunks, restored.out.reqs,
                                        strict=True) if r is long]  # fmt: skip
    assert restored.out.batch.swap_in == [(0, seq)]
    assert [(len(c.tokens), c.pos0) for c in restored.out.batch.chunks] == [(1, a.num_computed - 1),
                                                                            (1, 99)]  # fmt: skip
    d.run()
    d.assert_matches_reference("a")
    d.assert_matches_reference("long")
    assert d.sched.kv.swap_used == 0 and not d.fake.swapped


def test_where_a_step_can_carry_a_chunk_within_the_target_the_prompt_stays_in_place() -> None:
    d = Driver(side_cfg(max_stall_s=10.0), side_fake())
    a = d.add(make_request("a", prompt(8), 60))
    decoding(d, a)
    d.add(make_request("long", prompt(100, 3), 5))
    d.run()
    assert not any(s.out.batch.side_prefill for s in d.steps)
    d.assert_matches_reference("long")


def test_without_a_side_context_or_decoders_the_prompt_is_chunked_in_place() -> None:
    """No side context (the default), or no one waiting for the steps (nothing bounds them):
    in place."""
    for config, first in ((side_cfg(side_prefill_tokens=0), True), (side_cfg(), False)):
        d = Driver(config, side_fake())
        if first:
            decoding(d, d.add(make_request("a", prompt(8), 60)))
        d.add(make_request("long", prompt(100, 3), 5))
        d.run()
        assert not any(s.out.batch.side_prefill for s in d.steps)
        d.assert_matches_reference("long")


def test_a_second_long_prompt_waits_for_the_side_context_and_short_ones_pass() -> None:
    """One prompt at a time aside: the next long one waits for the side context (in place
    it would hold every decoder), while one behind it shorter than a minimum chunk (which
    the side context does not take) goes in place meanwhile."""
    d = Driver(side_cfg(), side_fake())
    a = d.add(make_request("a", prompt(8), 80))
    decoding(d, a)
    first = d.add(make_request("first", prompt(100, 3), 5))
    second = d.add(make_request("second", prompt(90, 5), 5))
    short = d.add(make_request("short", prompt(12, 7), 5))
    d.step()
    assert first.req_id in d.sched.aside and second in d.sched.waiting
    while first.req_id in d.sched.aside:
        d.step()
        assert second.num_computed == 0 and second.seq_id is None
    assert short.output_ids  # it went in place, beside the decoder, meanwhile
    d.run()
    asides = [k for s in d.steps for k, _ in s.out.batch.side_prefill]
    assert len(asides) == 2 and second.swap_key is None
    for req_id in ("a", "first", "second", "short"):
        d.assert_matches_reference(req_id)


def test_a_request_abandoned_while_aside_frees_its_swap_space_and_its_cells_are_dropped() -> None:
    d = Driver(side_cfg(), side_fake())
    a = d.add(make_request("a", prompt(8), 60))
    decoding(d, a)
    long = d.add(make_request("long", prompt(100, 3), 5))
    d.step()
    key = long.swap_key
    assert key is not None and d.sched.kv.swap_used == 99
    d.sched.abort("long", d.now)
    assert d.sched.kv.swap_used == 0 and not d.sched.aside
    assert long.status is RequestStatus.FINISHED_ABORTED
    while d.fake.side_busy:  # its prefill runs on; its cells are dropped once they come
        step = d.step()
        assert key not in step.out.batch.swap_drop or not d.fake.side_busy
    d.run()
    assert any(s.out.batch.swap_drop == [key] for s in d.steps)
    assert not d.fake.swapped and d.sched.kv.swap_used == 0
    d.assert_matches_reference("a")


def test_a_side_prefill_that_failed_is_computed_in_place() -> None:
    d = Driver(side_cfg(), side_fake(lose=frozenset({0})))
    a = d.add(make_request("a", prompt(8), 60))
    decoding(d, a)
    long = d.add(make_request("long", prompt(100, 3), 5))
    d.run()
    assert sum(len(s.out.batch.side_prefill) for s in d.steps) == 1
    assert not any(s.out.batch.swap_in for s in d.steps) and long.swap_key is None
    d.assert_matches_reference("long")
    assert d.sched.kv.swap_used == 0


def test_an_idle_scheduler_asks_for_the_side_prefill_once_woken() -> None:
    """The decoders finished while a prompt was aside: nothing is left to step, so the
    scheduler plans nothing (the loop sleeps) until the side context wakes it; then one
    batch asks for what it finished."""
    d = Driver(side_cfg(), side_fake(per_step=4))
    a = d.add(make_request("a", prompt(8), 8))
    decoding(d, a)
    long = d.add(make_request("long", prompt(100, 3), 5))
    while a.status is not RequestStatus.FINISHED_LENGTH:
        d.step()
    d.step()  # (its release)
    assert long.req_id in d.sched.aside and d.sched.has_work
    assert d.step().out.is_empty
    d.sched.side_woke()
    poll = d.step()
    assert poll.out.batch.side_poll and not poll.out.batch.chunks
    d.run()
    d.assert_matches_reference("long")
