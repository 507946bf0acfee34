"""Time-bounded chunked prefill: the cost model learns step times, and the scheduler sizes
prompt chunks so that steps with decoding users stay under the stall target."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest

from engine.step_types import StepBatch, StepResult
from scheduler.budget import StepCostModel, StepTimeBudget
from scheduler.core import Scheduler, SchedulerConfig
from scheduler.request import Request
from tests.fake_engine import FakeEngine, make_request


def true_step_time(batch: StepBatch) -> float:
    """A machine whose steps cost 8 ms + 1 ms per decode token, and 0.9 ms per prompt token
    plus 20 ns per KV cell it attends to (the H200 chunk-cost shape, scaled)."""
    t = 0.008
    for c in batch.chunks:
        n = len(c.tokens)
        if c.seq_id < 4:  # the decoders of `run_scenario` (their prompts are tiny)
            t += 0.001 * n
        else:
            t += n * (0.0009 + 2e-8 * (c.pos0 + n / 2))
    return t


def bounded_scheduler(
    max_stall_s: float | None, max_num_seqs: int = 8, ubatch: int = 0, tile: int = 0
) -> tuple[Scheduler, FakeEngine]:
    """A scheduler with a 2,048-token step and a 40,000-cell KV pool, and its fake engine."""
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, kv_capacity=40000,
                        max_num_batched_tokens=2048, max_stall_s=max_stall_s,
                        min_prefill_chunk=32, ubatch=ubatch, attention_tile=tile)
    )  # fmt: skip
    fake = FakeEngine()
    fake.n_batch = 2048
    return sched, fake


def test_cost_model_recovers_a_linear_machine() -> None:
    m = StepCostModel()
    rng = random.Random(0)
    for _ in range(200):
        d = rng.randint(1, 8)
        m.observe(d, [], 0.008 + 0.001 * d)
        n, depth = rng.randint(32, 2048), rng.randint(0, 60000)
        m.observe(d, [(n, depth)], 0.008 + 0.001 * d + n * (0.0009 + 2e-8 * (depth + n / 2)))
    assert m.decode_time(4) == pytest.approx(0.012, rel=1e-3)
    est = m.estimate()
    assert est["prompt_token_s"] == pytest.approx(0.0009, rel=0.02)
    assert est["prompt_token_per_kv_cell_s"] == pytest.approx(2e-8, rel=0.05)
    # the largest chunk under 250 ms at depth 60K, checked against the true cost
    n = m.tokens_within(0.25 - m.decode_time(4), 60000, cap=8192)
    assert 0.008 + 0.004 + n * (0.0009 + 2e-8 * (60000 + n / 2)) <= 0.25
    assert 0.008 + 0.004 + (n + 8) * (0.0009 + 2e-8 * (60000 + (n + 8) / 2)) > 0.25


def test_budget_grants_a_minimum_chunk_before_it_knows_anything() -> None:
    b = StepTimeBudget(StepCostModel(), max_stall_s=0.25, n_decode=4, min_chunk=32)
    assert b.grant(5000, 0) == 32  # measured first
    assert b.grant(5000, 0) == 0  # a second prompt waits until the model knows prompts
    free = StepTimeBudget(StepCostModel(), max_stall_s=0.25, n_decode=0, min_chunk=32)
    assert free.grant(2048, 0) == 2048  # nobody decodes: full batches


class SlowsDown:
    """The linear machine, 1.5x slower from its 60th step on: another process took part
    of the cores (the long prompt arrives at step 20)."""

    def __init__(self) -> None:
        self.steps = 0

    def __call__(self, batch: StepBatch) -> float:
        self.steps += 1
        return true_step_time(batch) * (1.5 if self.steps > 60 else 1.0)


def run_scenario(
    max_stall_s: float | None,
    cost: Callable[[StepBatch], float] = true_step_time,
    ubatch: int = 0,
    tile: int = 0,
) -> tuple[list[float], list[int], int]:
    """4 users decode while a 20,000-token prompt arrives; return the time of every step that
    carried a decoder, the prompt tokens of each step, and steps until the prompt's first token."""
    sched, fake = bounded_scheduler(max_stall_s, ubatch=ubatch, tile=tile)
    now = 0.0
    for i in range(4):
        sched.add(make_request(f"d{i}", [5 + i] * 16, 10_000, arrival=now))
    long = make_request("long", [7] * 20_000, 1, arrival=now)
    times: list[float] = []
    prompt_tokens: list[int] = []
    steps_to_first = -1
    for step in range(2000):
        if step == 20:
            sched.add(long)
        out = sched.schedule(now)
        res: StepResult = fake.step(out.batch)
        res.decode_s = cost(out.batch)
        now += res.decode_s
        outputs, _ = sched.postprocess(out, res, now)
        if out.num_decode:
            times.append(res.decode_s)
        if step >= 20:
            prompt_tokens.append(sum(n for n, _ in out.prompt_chunks))
        if any(o.req_id == "long" for o in outputs):
            steps_to_first = step - 20
            break
    return times, prompt_tokens, steps_to_first


def test_chunks_keep_decode_steps_under_the_target_and_prefill_progresses() -> None:
    times, prompt_tokens, steps = run_scenario(0.25)
    assert steps > 0, "the long prompt finished its prefill"
    assert max(times) <= 0.25, f"a step with decoders took {max(times):.3f}s"
    assert all(n >= 32 for n in prompt_tokens[:steps]), "every step progressed the prompt"
    # and it is not timid: most steps use most of the target
    assert sorted(times)[len(times) // 2] > 0.15 or sum(prompt_tokens) < 20_000
    unbounded, _, steps_unbounded = run_scenario(None)
    assert max(unbounded) > 0.25  # without the target, 2,048-token chunks stall decoders
    assert steps_unbounded < steps


def test_a_machine_that_slows_down_is_caught_up_with_within_a_few_steps() -> None:
    """The least-squares fit forgets slowly (it must, to average out noise); the measured /
    modelled bias follows within steps. Without it (gain 0) seven steps ran over."""
    times, prompt_tokens, steps = run_scenario(0.25, SlowsDown())
    assert steps > 0 and all(n >= 32 for n in prompt_tokens[:steps])
    over = [t for t in times if t > 0.25]
    assert len(over) <= 3, f"{len(over)} steps over the target: {over}"


def test_the_bias_follows_a_slow_spell_and_relaxes_after_it() -> None:
    m = StepCostModel()
    for _ in range(50):
        m.observe(4, [], 0.012)
        m.observe(4, [(256, 1000)], 0.012 + 256 * 0.001)
    assert m.bias == pytest.approx(1.0, abs=0.01)
    for _ in range(10):  # the machine runs 2x slower for a while
        m.observe(4, [(256, 1000)], 2 * (0.012 + 256 * 0.001))
    assert m.bias > 1.3
    for _ in range(100):  # decode-only steps after the prefill
        m.observe(4, [], 0.012)
    assert m.bias == pytest.approx(1.0, abs=0.02)


def test_two_long_prompts_go_first_come_first_served_and_both_finish() -> None:
    """FCFS: the older prompt takes the step's prompt time first (and always its minimum
    chunk); the younger one gets what is left, then all of it. Nobody starves."""
    sched, fake = bounded_scheduler(0.25)
    now = 0.0
    for i in range(4):
        sched.add(make_request(f"d{i}", [5 + i] * 16, 10_000))
    first_token: dict[str, int] = {}
    for step in range(3000):
        if step == 10:
            sched.add(make_request("old", [7] * 8000, 1, arrival=now))
            sched.add(make_request("young", [8] * 8000, 1, arrival=now + 0.001))
        out = sched.schedule(now)
        res = fake.step(out.batch)
        res.decode_s = true_step_time(out.batch)
        now += res.decode_s
        outputs, _ = sched.postprocess(out, res, now)
        if out.num_decode:
            assert res.decode_s <= 0.25
        for o in outputs:
            first_token.setdefault(o.req_id, step)
        if "old" in first_token and "young" in first_token:
            break
    assert first_token["old"] < first_token["young"] < 3000


def test_a_burst_is_admitted_together_and_later_prompts_are_bounded_again() -> None:
    """A closed-loop wave: the first of 16 requests reaches an idle server alone and is
    prefilled; the other 15 arrive during that step. The first has one token, so it came
    with them: the next step takes all 15 prompts (llama-server would too), not one
    bounded chunk at a time. Once it has two tokens, a newcomer's prompt is chunked."""
    sched, fake = bounded_scheduler(0.25, max_num_seqs=32)

    def cost(batch: StepBatch) -> float:  # 1,920 prompt tokens: ~1 s, over the target
        return 0.008 + 0.0005 * batch.num_tokens

    now = 0.0
    steps: list[tuple[int, float]] = []  # (prompt tokens, step time)

    def step() -> None:
        nonlocal now
        out = sched.schedule(now)
        res = fake.step(out.batch)
        res.decode_s = cost(out.batch)
        now += res.decode_s
        sched.postprocess(out, res, now)
        steps.append((sum(n for n, _ in out.prompt_chunks), res.decode_s))

    sched.add(make_request("first", [3] * 128, 200, arrival=now))
    step()  # the first, alone
    for i in range(15):
        sched.add(make_request(f"wave{i}", [10 + i] * 128, 200, arrival=now))
    step()
    assert steps[-1][0] == 15 * 128, "the wave's prompts went in one step"
    assert sum(r.is_decoding for r in sched.running) == 16
    for _ in range(5):
        step()  # all decode
    sched.add(make_request("late", [9] * 4000, 1, arrival=now))
    while sched.waiting or any(not r.is_decoding for r in sched.running):
        step()
        assert steps[-1][1] <= 0.25, "a prompt step stalled decoders with two tokens or more"
    assert len(steps) > 9, "the late prompt was chunked"


def prompt_chunk_time(n: int, depth: int) -> float:
    """The 2-core CPU's shape (bench/chunk_cost.py): besides its tokens, a prompt chunk pays
    for whole passes over the KV it attends to, whatever its size (attention in tiles)."""
    return n * (0.002 + 3e-7 * (depth + n / 2)) + 2e-5 * (depth + n)


def tiled_step_time(batch: StepBatch) -> float:
    t = 0.04
    for c in batch.chunks:
        n = len(c.tokens)
        t += 0.002 * n if c.seq_id < 4 else prompt_chunk_time(n, c.pos0)
    return t


def test_chunks_stay_under_the_target_where_small_chunks_cost_a_pass_over_the_kv() -> None:
    """Deep in a 20K prompt a chunk's fixed pass over the KV is most of a 1 s step; a model
    of per-token costs alone sized chunks for it that ran 1.2-1.4x over the target."""
    times, prompt_tokens, steps = run_scenario(1.0, tiled_step_time)
    assert steps > 0 and all(n >= 32 for n in prompt_tokens[:steps])
    over = [round(t, 3) for t in times if t > 1.0]
    assert len(over) <= 2, f"{len(over)} steps over the target: {over}"
    assert sorted(times)[len(times) // 2] > 0.6, "and it still uses most of the target"


def test_the_fit_separates_per_token_and_per_pass_costs() -> None:
    m = StepCostModel()
    rng = random.Random(1)
    for _ in range(300):
        n, d = rng.randint(32, 2048), rng.randint(0, 30000)
        m.observe(4, [(n, d)], 0.05 + n * (0.002 + 3e-7 * (d + n / 2)) + 2e-5 * (d + n))
        m.observe(4, [], 0.05)
    est = m.estimate()
    assert est["prompt_token_s"] == pytest.approx(0.002, rel=0.02)
    assert est["prompt_token_per_kv_cell_s"] == pytest.approx(3e-7, rel=0.02)
    assert est["prompt_chunk_per_kv_cell_s"] == pytest.approx(2e-5, rel=0.02)


def kernel_switch_step_time(batch: StepBatch) -> float:
    """A machine whose prompt tokens cost twice as much in steps of 64 tokens or more (a
    different kernel path: ggml's CPU flash attention is tiled from 64 query rows; on the
    2-core CPU at 14K depth, 4 decoders and a 59-token chunk took 605 ms, with 60 1,000:
    docs/benchmarks.md)."""
    t = 0.05
    slow = 2.0 if batch.num_tokens >= 64 else 1.0
    for c in batch.chunks:
        n = len(c.tokens)
        if c.seq_id < 4:
            t += 0.002 * n
        else:
            t += slow * n * (0.002 + 5e-7 * (c.pos0 + n / 2))
    return t


def test_a_step_size_that_runs_slow_is_learned_and_avoided() -> None:
    """One bias for every step size oscillates on such a machine: chunks sized for the slow
    class under-use the target, the bias falls, the next chunk crosses into the slow class
    and overshoots. Per size class, each class is measured and planned for."""
    times, prompt_tokens, steps = run_scenario(1.0, kernel_switch_step_time)
    assert steps > 0 and all(n >= 32 for n in prompt_tokens[:steps])
    over = [round(t, 3) for t in times if t > 1.0]
    assert len(over) <= 3, f"{len(over)} steps over the target: {over}"


def test_a_newcomer_is_not_stalled_by_a_prefill_under_way_when_old_decoders_leave() -> None:
    """The burst exemption is for prompts arriving together, never for a prefill already
    under way: a short request admitted beside a long prefill keeps its bound even when the
    last old decoder leaves the step it got its first token (found in review: 12 s)."""
    sched, fake = bounded_scheduler(1.0)
    now = 0.0
    old = make_request("old", [5] * 16, 10_000, arrival=now)
    sched.add(old)
    newcomer: Request | None = None
    last: dict[str, float] = {}
    gaps: list[float] = []
    for step in range(400):
        if step == 10:
            sched.add(make_request("long", [7] * 20_000, 1, arrival=now))
        if step == 60:
            newcomer = make_request("new", [9] * 16, 50, arrival=now)
            sched.add(newcomer)
        if newcomer is not None and len(newcomer.output_ids) == 1:
            sched.abort("old", 0.0)  # its client leaves in the step the newcomer starts decoding
        out = sched.schedule(now)
        res = fake.step(out.batch)
        res.decode_s = 0.04 + sum(  # the CPU shape of `tiled_step_time`, by chunk length
            0.002 if len(c.tokens) == 1 else prompt_chunk_time(len(c.tokens), c.pos0)
            for c in out.batch.chunks
        )
        now += res.decode_s
        outputs, _ = sched.postprocess(out, res, now)
        for o in outputs:
            if o.req_id == "new" and "new" in last:
                gaps.append(now - last["new"])
            last[o.req_id] = now
        if newcomer is not None and newcomer.status.is_finished:
            break
    assert gaps and max(gaps) <= 1.0, f"the newcomer's longest gap {max(gaps):.2f} s"


def test_one_slow_step_does_not_cap_the_chunks_for_the_rest_of_the_prefill() -> None:
    """A single 3x spike (a shared machine) raises its size class's bias by at most half,
    and the class drifts back toward everyone's bias while the planner avoids it."""

    class OneSpike:
        def __init__(self) -> None:
            self.steps = 0

        def __call__(self, batch: StepBatch) -> float:
            self.steps += 1
            return true_step_time(batch) * (3.0 if self.steps == 26 else 1.0)

    _, _, steps_spike = run_scenario(0.25, OneSpike())
    _, _, steps_base = run_scenario(0.25)
    assert steps_spike <= steps_base * 1.1, f"{steps_spike} steps to first token vs {steps_base}"


def per_physical_batch(batch: StepBatch) -> float:
    """Experts in host RAM: llama.cpp runs a step as physical batches of 512 tokens and each
    pays 100 ms (the expert copy) whatever its size; 8 ms + 1 ms per decode token, 0.3 ms
    per prompt token."""
    tokens = sum(len(c.tokens) for c in batch.chunks)
    prompt = sum(len(c.tokens) for c in batch.chunks if c.seq_id >= 4)
    return 0.1 * -(-tokens // 512) + 0.008 + 0.001 * (tokens - prompt) + 0.0003 * prompt


def ends_short(n_prompt: int, q: int) -> bool:
    """A step of 4 decoders and `n_prompt` prompt tokens ends, after a full physical batch
    or tile of `q` rows, in one of fewer than q / 4."""
    total = 4 + n_prompt
    return total > q and 0 < total % q < q // 4


def test_a_step_does_not_end_in_a_short_physical_batch() -> None:
    """At a 320 ms target the model's chunk (~510-530 tokens) can spill a few tokens into a
    second physical batch that costs 100 ms more than modelled (372 ms); told the physical
    batch size, the planner stops such a chunk at the boundary, and the first step of more
    physical batches than any measured is planned small (a probe), not at the full target."""
    for target in (0.32, 0.4):  # at 0.4 s the first two-batch step ran 0.414 s unprobed
        times, prompt_tokens, steps = run_scenario(target, per_physical_batch, ubatch=512)
        assert steps > 0 and all(n >= 32 for n in prompt_tokens[:steps])
        assert not any(ends_short(n, 512) for n in prompt_tokens[: steps - 1])
        assert max(times) <= target, f"a step with decoders took {max(times):.3f}s"
    blind, blind_tokens, blind_steps = run_scenario(0.32, per_physical_batch)
    assert any(ends_short(n, 512) for n in blind_tokens[:blind_steps]) and max(blind) > 0.32


def cpu_attention(batch: StepBatch) -> float:
    """The 2-core CPU's attention: under 64 rows, per row; from 64 rows on, ggml's tiled
    flash attention, 1.5x dearer per row and paid for whole tiles of 64 rows (a 65-row
    step costs two tiles). Plus 50 ms, 2 ms per decode token, 4 ms per prompt token."""
    rows, t, depth = batch.num_tokens, 0.05, 0
    for c in batch.chunks:
        n = len(c.tokens)
        t += 0.002 * n if c.seq_id < 4 else 0.004 * n
        depth = max(depth, c.pos0 + n)
    attended = rows if rows < 64 else 1.5 * 64 * -(-rows // 64)
    return t + attended * 4e-7 * depth


def test_a_cpu_step_does_not_end_in_a_short_attention_tile() -> None:
    """Told the attention tile (64 rows, ggml's CPU flash attention), the planner never ends
    a step a few rows into a tile it pays for in full, and stays within the target — but
    for a few percent where the 64-row class, measured shallower, has grown dearer with
    depth than its bias says (a class's bias is one factor at every depth). The prompt's
    last step, which may take the whole rest, is planned with the bias the planner would
    give that size (a 60-token rest, one 64-row tile at 20K depth, planned with the tile
    class's stale bias took 1.07 s)."""
    times, prompt_tokens, steps = run_scenario(1.0, cpu_attention, tile=64)
    assert steps > 0 and all(n >= 32 for n in prompt_tokens[:steps])
    assert not any(ends_short(n, 64) for n in prompt_tokens[: steps - 1])
    assert max(times) <= 1.05, f"a step with decoders took {max(times):.3f}s"
    assert sum(t > 1.0 for t in times) <= 1
    _, blind_tokens, blind_steps = run_scenario(1.0, cpu_attention)
    assert any(ends_short(n, 64) for n in blind_tokens[:blind_steps])


class Jitter:
    """The linear machine, each step off by a random factor (log-normal, 10%): a shared
    machine. Seeded: the runs are the same every time."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def __call__(self, batch: StepBatch) -> float:
        return true_step_time(batch) * math.exp(self.rng.gauss(0.0, 0.1))


def test_a_jittery_machine_gets_more_headroom(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps that land 10% from their plan: planned to a fixed 85% of the target, 21 steps
    of five prefills ran over; planned with room for the measured spread, none."""
    over = sum(sum(t > 0.25 for t in run_scenario(0.25, Jitter(s))[0]) for s in range(5))
    monkeypatch.setattr(StepTimeBudget, "SPREAD_K", 0.0)  # a fixed 85%
    fixed = sum(sum(t > 0.25 for t in run_scenario(0.25, Jitter(s))[0]) for s in range(5))
    assert over <= 2 and fixed > 10, (over, fixed)
    # a steady machine keeps the full 85% (the linear test above: not timid)
    assert StepTimeBudget.headroom(StepCostModel()) == StepTimeBudget.HEADROOM


def test_full_batch_prefills_teach_the_model_their_true_cost() -> None:
    """Steps with nobody decoding (prompts in full batches, four physical batches each) are
    not planned, so no class bias applies to them: the fit learns their time as measured
    (found in review: they were scaled by the probe bias for unmeasured multi-batch
    classes and the model then put 2,048-token chunks at 0.7 of their cost)."""

    def cost(d: int, chunks: list[tuple[int, int]]) -> float:
        return 0.008 + 0.001 * d + sum(n * (0.0009 + 2e-8 * (p + n / 2)) for n, p in chunks)

    m = StepCostModel(512)
    for d in range(1, 9):
        m.observe(d, [], cost(d, []))
    for i in range(30):
        m.observe(4, [(200 + 3 * i, 1000 * i)], cost(4, [(200 + 3 * i, 1000 * i)]))
    for i in range(10):
        m.observe(0, [(2048, 30000 + 2048 * i)], cost(0, [(2048, 30000 + 2048 * i)]))
    for depth in (0, 20000, 50000):
        assert m.step_time(0, [(2048, depth)]) == pytest.approx(cost(0, [(2048, depth)]), rel=0.05)
        n = StepTimeBudget(m, 0.25, 4, 32).grant(20000, depth)
        assert cost(4, [(n, depth)]) <= 0.25


def test_steps_that_measure_no_time_do_not_break_the_plan() -> None:
    """A backend (or fake) reporting 0-second steps leaves the model all zeros; planning must
    still grant the minimum chunk, not divide by zero."""
    m = StepCostModel(512, 64)
    m.observe(4, [], 0.0)
    m.observe(0, [(100, 0)], 0.0)
    assert StepTimeBudget(m, 0.25, 4, 32).grant(1000, 0) >= 32


def test_the_fit_learns_a_fixed_cost_per_prompt_step_once_it_has_the_points() -> None:
    """With the experts in host RAM any step carrying a prompt copies them to the GPU: a
    fixed cost whatever the chunk. The fit learns it as such (not as a per-token cost that
    makes large chunks look dear), but not from two noisy points, where an intercept
    makes a chunk twice the size look cheap per token."""
    m = StepCostModel()
    for _ in range(3):
        m.observe(4, [], 0.084)
    m.observe(4, [(64, 0)], 0.084 + 0.1 + 4e-5 * 64)
    m.observe(4, [(128, 64)], 0.084 + 0.1 + 4e-5 * 128)
    assert m.estimate()["prompt_chunk_s"] == 0.0  # two points would fit it exactly
    rng = random.Random(2)
    for _ in range(40):
        n, d = rng.randint(32, 500), rng.randint(0, 16000)
        m.observe(4, [(n, d)], 0.084 + 0.1 + 4e-5 * n)
    assert m.estimate()["prompt_chunk_s"] > 0.05
    for n in (32, 60, 120, 250, 500):  # planned as the budget plans: with the class's bias
        planned = m.step_time(4, [(n, 16000)]) * m.bias_for(4 + n)
        assert planned == pytest.approx(0.184 + 4e-5 * n, rel=0.03), n  # without h: 18-52% off


class ExpertsInRam:
    """The H200 with the experts in host RAM (measured, 16K prompt, 4 decoders): a step
    under 32 rows computes the experts on the CPU (4 decoders alone: 84 ms; 22 rows: 282
    ms); from 32 rows on it copies them to the GPU (~175 ms) and the rows cost little
    (283 rows: 193 ms). Each step off by a random 6% (seeded)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def __call__(self, batch: StepBatch) -> float:
        rows = batch.num_tokens
        t = 0.044 + 0.01 * rows if rows < 32 else 0.175 + 4e-5 * rows
        return t * math.exp(self.rng.gauss(0.0, 0.06))


def test_with_experts_in_ram_a_prefill_keeps_its_large_chunks() -> None:
    """Chunks of 32 to 500 rows cost about the same there. Before the fixed cost was
    modelled, a slow step or two shrank the chunks, their time did not shrink, the bias
    rose and the prefill went on in 32-row chunks (H200: first token 7.9x later than on an
    idle server; here a median of 202 steps, and a last chunk of under 32 tokens that
    took the CPU path over the target). Now: no step over, no short last chunk, and the
    first token within 120 steps (about 94 at the median)."""
    steps = []
    for seed in range(6):
        times, prompt_tokens, n = run_scenario(0.25, ExpertsInRam(seed), ubatch=512)
        assert n > 0 and max(times) <= 0.25, f"seed {seed}: a step took {max(times):.3f}s"
        assert all(t >= 32 for t in prompt_tokens[: n + 1]), f"seed {seed}: a short chunk"
        steps.append(n)
    assert sorted(steps)[len(steps) // 2] <= 120, steps


class ExpertsInRamSlowerHost(ExpertsInRam):
    """`ExpertsInRam` on a slower host, 1.28x (H200 run 15: an idle prefill took 7.8-8.3 s
    where run 13's took 6.1-6.3; 4 decoders alone ~110 ms, with 32 prompt rows ~225): a
    step with any prompt in it costs ~90% of a 250 ms target, over the planned share."""

    def __call__(self, batch: StepBatch) -> float:
        return 1.28 * super().__call__(batch)


def test_where_the_smallest_chunk_is_over_the_planned_share_chunks_still_grow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the floor (decoders and the minimum chunk) over the planned share of the target
    but under the target, the chunk is planned to the target: rows cost little next to the
    step's fixed cost, so the prefill takes far fewer steps, and fewer land over the target
    (the floor's own spread puts some over whatever the chunk). Planned to the share (as
    FLOOR_SLACK 1 plans), it went on in 32-row chunks: 624 steps, as on the H200."""

    def run(seeds: range) -> tuple[list[int], int, float]:
        steps, over, worst = [], 0, 0.0
        for seed in seeds:
            times, prompt_tokens, n = run_scenario(0.25, ExpertsInRamSlowerHost(seed), ubatch=512)
            assert n > 0 and all(t >= 32 for t in prompt_tokens[:n])
            steps.append(n)
            over += sum(t > 0.25 for t in times)
            worst = max(worst, *times)
        return sorted(steps), over, worst

    steps, over, worst = run(range(6))
    monkeypatch.setattr(StepTimeBudget, "FLOOR_SLACK", 1.0)
    share_steps, share_over, _ = run(range(6))
    assert steps[3] <= 350 and share_steps[3] >= 600, (steps, share_steps)
    assert over < share_over * 0.8, (over, share_over)
    assert worst <= 0.3, worst  # the floor's spread, not the chunk's size


def test_a_prompt_does_not_end_in_a_chunk_under_the_minimum() -> None:
    """The grant leaves the minimum chunk for the prompt's last step, or takes the whole
    rest when that costs little more."""
    m = StepCostModel()
    for _ in range(3):
        m.observe(4, [], 0.01)
    for i in range(10):
        m.observe(4, [(100 + i, 1000 * i)], 0.01 + 0.001 * (100 + i))
    b = StepTimeBudget(m, 0.25, 4, 32)
    n = b._fit(5000, 10_000)
    assert 100 < n < 5000
    # 10 tokens would be left: the grant leaves 32 instead
    assert StepTimeBudget(m, 0.25, 4, 32).grant(n + 10, 10_000, n + 10) == n + 10 - 32
    # 40 tokens left, a target only the 32-token floor meets: on a machine where a step
    # with a prompt costs mostly a fixed 100 ms, all 40 go (they cost little more); on
    # one where prompt tokens cost in proportion, 32 (and 8 in the next step)
    assert StepTimeBudget(m, 0.02, 4, 32).grant(40, 10_000, 40) == 32
    fixed = StepCostModel()
    for _ in range(3):
        fixed.observe(4, [], 0.084)
    for i in range(10):
        fixed.observe(4, [(32 + 40 * i, 1000 * i)], 0.184 + 4e-5 * (32 + 40 * i))
    assert StepTimeBudget(fixed, 0.15, 4, 32).grant(40, 10_000, 40) == 40
    # a prompt that is not at its end: no change
    assert StepTimeBudget(m, 0.25, 4, 32).grant(n + 10, 10_000, 50_000) == n


class DeepTilesCpu:
    """The 2-core CPU's shape where the tiled path (64 rows and more) grows dearer with
    depth than the small steps: per tile row 1.3x at depth 0, 2.5x at 14K; the shared
    machine 1.25x slower for four spells of 15 steps; 5% jitter. Seeded."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.steps = 0
        self.spells = sorted(self.rng.sample(range(60, 400), 4))

    def __call__(self, batch: StepBatch) -> float:
        self.steps += 1
        rows, t, depth = batch.num_tokens, 0.05, 0
        for c in batch.chunks:
            n = len(c.tokens)
            t += 0.002 * n if c.seq_id < 4 else 0.004 * n
            depth = max(depth, c.pos0 + n)
        attended = rows if rows < 64 else 64 * -(-rows // 64) * (1.3 + depth / 12000)
        t += attended * 4e-7 * depth
        slow = 1.25 if any(s <= self.steps < s + 15 for s in self.spells) else 1.0
        return t * slow * math.exp(self.rng.gauss(0.0, 0.05))


def test_a_class_measured_much_shallower_is_not_trusted_deeper() -> None:
    """The tiled classes, measured early, look as cheap as then when the prefill is deep;
    and long runs of small chunks teach a fit with a fixed term that a chunk six times
    larger costs about the same. Before: up to 6.8, 14.5 and 33.8 s steps at a 1 s
    target (chunks of 342, 684 and 1,368 tokens, each twice the last), and without the
    fixed term 7 steps over, the worst 1.65 s; then, with those fixed but a tiled class
    re-entered after a run of small chunks at its old bias, 3 over, the worst 1.38 s (first
    token after 321 steps at the median). Now a tiled class re-entered 8 tiles' rows and 5%
    deeper than it was measured is planned as one that ran slow: none over, for ~4% more
    steps to the first token."""
    over, worst, steps = 0, 0.0, []
    for seed in range(8):
        times, prompt_tokens, n = run_scenario(1.0, DeepTilesCpu(seed), tile=64)
        assert n > 0 and all(t >= 32 for t in prompt_tokens[:n])
        over += sum(t > 1.0 for t in times)
        worst = max(worst, max(times))
        steps.append(n)
    assert over <= 1 and worst <= 1.1, (over, worst)
    assert sorted(steps)[len(steps) // 2] <= 350, steps


class SpikyCpu:
    """`cpu_attention` on a shared machine: steady (2% jitter), but one step in 50 takes
    1.34x (the largest of the CPU runs' misses) — a ggml thread preempted by another
    process holds every other one at the next barrier. Seeded."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def __call__(self, batch: StepBatch) -> float:
        spike = 1.34 if self.rng.random() < 0.02 else 1.0
        return cpu_attention(batch) * spike * math.exp(self.rng.gauss(0.0, 0.02))


def test_a_cpu_only_machine_keeps_room_for_its_spikes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A steady CPU's spread falls low enough for the 85% cap, and then a rare 1.34x step
    goes over (at a 78% cap as well, and at 72% one did: a spike on a class whose model
    was a few percent short); where attention runs in CPU tiles the cap is 70% and none
    does."""
    steady = StepCostModel(tile=64)
    steady.spread = 0.001
    assert StepTimeBudget.headroom(steady) == StepTimeBudget.CPU_HEADROOM < 0.8
    steady.tile = 0  # attention on a GPU: the GPU's steps have no such tail
    assert StepTimeBudget.headroom(steady) == StepTimeBudget.HEADROOM
    over = sum(sum(t > 1.0 for t in run_scenario(1.0, SpikyCpu(s), tile=64)[0]) for s in range(4))
    monkeypatch.setattr(StepTimeBudget, "CPU_HEADROOM", StepTimeBudget.HEADROOM)
    capped_high = sum(
        sum(t > 1.0 for t in run_scenario(1.0, SpikyCpu(s), tile=64)[0]) for s in range(4)
    )
    assert over == 0 and capped_high > 0, (over, capped_high)


def test_a_fit_that_saw_only_short_prompts_does_not_grow_chunks_past_the_target() -> None:
    """Short chat prompts beside two decoders cost ~12 ms whatever their size (on the CPU
    their cost hides in the decode step's noise), so the fit learns a fixed cost per chunk
    and nothing per token. A long prompt then arrives at 1.5 ms a token. Before, each chunk
    could double what the last step had carried (the extrapolation cap) while every
    far-off step was dismissed as a spike and never taught the fit: 256-token chunks, 439 ms
    steps at a 250 ms target (the CPU end-to-end test once saw 1.19 s). Now chunks grow only
    past what the fit has learned from, and none goes over."""
    for seed in range(4):
        m = StepCostModel()
        rng = random.Random(seed)
        for _ in range(5):
            m.observe(2, [], 0.055)
        for _ in range(40):
            m.observe(2, [], 0.055 * math.exp(rng.gauss(0.0, 0.03)))
            m.observe(2, [(rng.randint(15, 40), 0)], 0.067 * math.exp(rng.gauss(0.0, 0.03)))
        depth, times = 0, []
        while depth < 4500:
            n = StepTimeBudget(m, 0.25, n_decode=2, min_chunk=32).grant(510, depth, 4500 - depth)
            assert n >= 32 or n == 4500 - depth
            times.append(0.055 + 0.0015 * n)
            m.observe(2, [(n, depth)], times[-1])
            depth += n
        assert max(times) <= 0.25, (seed, [round(t, 3) for t in times[:8]])
        assert len(times) <= 90, (seed, len(times))  # 4,500 tokens at ~63 a step
