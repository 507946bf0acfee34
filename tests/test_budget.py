"""The chunk policy: the cost model learns step times, and prompt chunks are sized so that
steps with decoding users stay under the stall target — judged as distributions over
seeded fake machines, not single runs."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from engine.step_types import StepBatch
from scheduler.budget import FixedBudget, StallTarget
from scheduler.core import Scheduler, SchedulerConfig
from scheduler.step_cost import StepCostModel, StepDraft
from tests.fake_engine import FakeEngine, make_request

Machine = Callable[[StepBatch], float]


def run_step(sched: Scheduler, fake: FakeEngine, machine: Machine, now: float) -> tuple[Any, float]:
    """One step of `sched` on `fake`, timed by `machine`: its outputs and the clock after."""
    out = sched.schedule(now)
    res = fake.step(out.batch)
    res.decode_s = machine(out.batch)
    now += res.decode_s
    outputs, _ = sched.postprocess(out, res, now)
    return outputs, now


def linear(batch: StepBatch) -> float:
    """8 ms a step + 1 ms per decode token, 0.9 ms per prompt token plus 20 ns per KV
    cell it attends (the H200 chunk-cost shape, scaled). Decoders are seqs 0-3."""
    t = 0.008
    for c in batch.chunks:
        n = len(c.tokens)
        t += 0.001 * n if c.seq_id < 4 else n * (0.0009 + 2e-8 * (c.pos0 + n / 2))
    return t


class AllGpu:
    """`linear`, each step off by a log-normal 10%: a busy GPU host."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def __call__(self, batch: StepBatch) -> float:
        return linear(batch) * math.exp(self.rng.gauss(0.0, 0.1))


class ExpertsInRam:
    """The H200 with the experts in host RAM (measured, 16K prompt, 4 decoders): a step
    under 32 rows computes the experts on the CPU (4 decoders alone: 84 ms; 22 rows: 282
    ms); from 32 rows on it copies them to the GPU (~175 ms) and rows cost little (283
    rows: 193 ms). 6% jitter."""

    def __init__(self, seed: int, slower: float = 1.0) -> None:
        self.rng = random.Random(seed)
        self.slower = slower

    def __call__(self, batch: StepBatch) -> float:
        rows = batch.num_tokens
        t = 0.044 + 0.01 * rows if rows < 32 else 0.175 + 4e-5 * rows
        return self.slower * t * math.exp(self.rng.gauss(0.0, 0.06))


class ExpertsInRamAllUsed:
    """`ExpertsInRam` on a model whose tokens route to every expert (the GPU model of
    issue 31, 48 layers of 128 experts in Q4_0): a physical batch of 32 rows or more uses
    all of them, so each copies ~16 GB to the GPU — ~1 s a batch of up to 2,048 rows,
    more than llama-server's whole pause is worth a share of. Under 32 rows the CPU
    computes them. 6% jitter."""

    def __init__(self, seed: int, copy_s: float = 1.0) -> None:
        self.rng = random.Random(seed)
        self.copy_s = copy_s

    def __call__(self, batch: StepBatch) -> float:
        rows = batch.num_tokens
        t = 0.044 + 0.01 * rows if rows < 32 else 0.084 + self.copy_s * -(-rows // 2048)
        return t * math.exp(self.rng.gauss(0.0, 0.06))


def cpu_attention(batch: StepBatch) -> float:
    """The 2-core CPU: under 64 rows attention per row; from 64 rows on ggml's tiled flash
    attention, 1.5x dearer per row and paid for whole tiles of 64 rows. Plus 50 ms, 2 ms
    per decode token, 4 ms per prompt token."""
    rows, t, depth = batch.num_tokens, 0.05, 0
    for c in batch.chunks:
        n = len(c.tokens)
        t += 0.002 * n if c.seq_id < 4 else 0.004 * n
        depth = max(depth, c.pos0 + n)
    attended = rows if rows < 64 else 1.5 * 64 * -(-rows // 64)
    return t + attended * 4e-7 * depth


class CpuTiles:
    """`cpu_attention` on a shared machine: 5% jitter, and four spells of 15 steps 1.25x
    slower (another process)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.steps = 0
        self.spells = sorted(self.rng.sample(range(60, 400), 4))

    def __call__(self, batch: StepBatch) -> float:
        self.steps += 1
        slow = 1.25 if any(s <= self.steps < s + 15 for s in self.spells) else 1.0
        return cpu_attention(batch) * slow * math.exp(self.rng.gauss(0.0, 0.05))


class SpikyCpu:
    """`cpu_attention`, steady (2% jitter) but one step in 50 takes 1.34x: a ggml thread
    preempted by another process holds every other one at the next barrier."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def __call__(self, batch: StepBatch) -> float:
        spike = 1.34 if self.rng.random() < 0.02 else 1.0
        return cpu_attention(batch) * spike * math.exp(self.rng.gauss(0.0, 0.02))


class ComputeBound:
    """The 2-core CPU serving the embedded 270M model, as its engine measured (4 decoders
    and chunks of 128-1,024 tokens, 1-9K deep): every row costs its work — 2.6 ms a prompt
    token plus 0.17 µs per KV cell it attends, in whole tiles of 64 rows — and each chunk
    26 µs per cell of the KV behind it; a decode step of four users, 50 ms, costs little
    beside a prompt chunk. 3% jitter, and one step in 50 1.34x (a ggml thread preempted)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def __call__(self, batch: StepBatch) -> float:
        rows, t, cells = batch.num_tokens, 0.05, 0.0
        for c in batch.chunks:
            n = len(c.tokens)
            if n > 1:  # a prompt's chunk (decode tokens are in the 50 ms)
                t += 0.0026 * n + 2.6e-5 * c.pos0
                cells += n * (c.pos0 + n / 2)
        pad = -(-rows // 64) * 64 / rows if rows >= 64 else 1.0
        spike = 1.34 if self.rng.random() < 0.02 else 1.0
        return (t + 1.7e-7 * cells * pad) * spike * math.exp(self.rng.gauss(0.0, 0.03))


@dataclass
class Run:
    times: list[float]  # every step that carried a decoder
    prompt_tokens: list[int]  # per step from the prompt's arrival
    steps_to_first: int  # steps from its arrival to its first token
    ttft_s: float = 0.0  # ... and seconds


# A side context beside the steps (engine.side_prefill) on the H100 with every expert in
# host RAM, as measured there (bench/side_prefill.py): it prefills a 16K prompt in 2,048-row
# batches of ~1.1 s while the decoders' steps take 1.13x theirs alone (80 vs 71 ms), and
# its KV (96 KiB a cell) is written into the main context at 9.4 GB/s (1.5 GiB, 171 ms).
SIDE_TOKENS_PER_S = 2048 / 1.08
SIDE_SLOWDOWN = 80 / 71
CELL_BYTES, WRITE_BYTES_PER_S = 96 * 1024, 9.4e9


def run_scenario(
    target: float | None, machine: Machine, ubatch: int = 0, tile: int = 0, auto: bool = False,
    prompt: int = 20_000, side: bool = False,
) -> Run:  # fmt: skip
    """4 users decode while a `prompt`-token prompt arrives (at step 20). `side`: with a
    side context, which progresses by the time each step takes."""
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=8, kv_capacity=40000, max_num_batched_tokens=2048,
                        max_stall_s=target, min_prefill_chunk=32, ubatch=ubatch,
                        attention_tile=tile, stall_auto=auto,
                        side_prefill_tokens=32767 if side else 0, swap_cells=40000,
                        kv_bytes_per_cell=CELL_BYTES)
    )  # fmt: skip
    fake = FakeEngine(bytes_per_cell=CELL_BYTES, swap_bytes_per_s=WRITE_BYTES_PER_S)
    fake.n_batch = 2048
    now = 0.0
    for i in range(4):
        sched.add(make_request(f"d{i}", [5 + i] * 16, 10_000, arrival=now))
    run = Run([], [], -1)
    for step in range(3000):
        if step == 20:
            sched.add(make_request("long", [7] * prompt, 1, arrival=now))
            arrived = now
        out = sched.schedule(now)
        busy = fake.side_busy or bool(out.batch.side_prefill)
        res = fake.step(out.batch)
        res.decode_s = machine(out.batch) * (SIDE_SLOWDOWN if busy else 1.0)
        took = res.decode_s + res.swap_in_s + res.swap_out_s  # (the copies: users wait too)
        fake.side_tokens_per_step = round(SIDE_TOKENS_PER_S * took)  # (for the next step)
        now += took
        outputs, _ = sched.postprocess(out, res, now)
        if any(c.seq_id < 4 and len(c.tokens) == 1 for c in out.batch.chunks):
            run.times.append(took)
        if step >= 20:
            run.prompt_tokens.append(sum(len(c.tokens) for c in out.batch.chunks if c.seq_id >= 4))
        if any(o.req_id == "long" for o in outputs):
            run.steps_to_first, run.ttft_s = step - 20, now - arrived
            return run
    raise AssertionError("the long prompt never got its first token")


# (target s, machine, ubatch, tile, median steps to the first token under the policy
# before this one — 28 rules and 30 constants — on seeds 0-9)
MACHINES = {
    "all-gpu": (0.25, AllGpu, 0, 0, 161),
    "experts-in-ram": (0.25, ExpertsInRam, 512, 0, 72.5),
    "cpu-tiles": (1.0, CpuTiles, 0, 64, 337.5),
    "spiky-cpu": (1.0, SpikyCpu, 0, 64, 321.5),
    # (its figure: this policy before the auto rule of issue 32, whose hard target is the
    # same; the 2-core CPU's floor 20K deep — decoders, a pass over the KV, the minimum
    # chunk — is ~0.75 s, with a spike 1 s: a 1 s target there is the floor's own spread)
    "compute-bound": (1.5, ComputeBound, 512, 64, 135.5),
}


@pytest.mark.parametrize("name", MACHINES)
def test_steps_stay_under_the_target_and_the_prompt_is_not_slower(name: str) -> None:
    """Over ten seeds: at most 1% of decoders' steps over the target, none over 1.3x, and
    the prompt's first token no more than 10% more steps away than before."""
    target, machine, ubatch, tile, before = MACHINES[name]
    runs = [run_scenario(target, machine(seed), ubatch, tile) for seed in range(10)]
    times = [t for r in runs for t in r.times]
    over = sum(t > target for t in times) / len(times)
    assert over <= 0.01, f"{over:.2%} of steps over the target"
    assert max(times) <= 1.3 * target, f"worst step {max(times) / target:.2f}x the target"
    steps = statistics.median(r.steps_to_first for r in runs)
    assert steps <= 1.1 * before, f"{steps} steps to the first token (before: {before})"
    # every step progressed the prompt, by the minimum chunk but for its last two
    assert all(min(r.prompt_tokens[: r.steps_to_first - 1]) >= 32 for r in runs)
    assert all(min(r.prompt_tokens[: r.steps_to_first + 1]) >= 1 for r in runs)


def test_where_any_prompt_step_is_near_the_target_the_prefill_still_moves() -> None:
    """A slower host with the experts in host RAM: a step with any prompt in it costs ~90%
    of the target, so the floor's own jitter puts steps over whatever the chunk. Planned
    to the quantile the prefill went on in 32-row chunks (~620 steps); the least-risk
    chunk takes larger ones for a few percent more step: fewer steps, no more of them
    over the target than before (19.5 a prefill), and none far over."""
    runs = [run_scenario(0.25, ExpertsInRam(seed, slower=1.28), 512) for seed in range(10)]
    assert statistics.median(r.steps_to_first for r in runs) <= 245.5 * 1.1
    assert statistics.mean(sum(t > 0.25 for t in r.times) for r in runs) <= 19.5
    assert max(t for r in runs for t in r.times) <= 1.3 * 0.25


def test_chunks_end_on_the_boundaries_where_kernels_change() -> None:
    """Told the physical batch and the attention tile, the policy never ends a step a few
    rows into a batch or tile it pays for in full."""
    for machine, ubatch, tile in ((ExpertsInRam(0), 512, 0), (CpuTiles(0), 0, 64)):
        run = run_scenario(1.0 if tile else 0.25, machine, ubatch, tile)
        q = ubatch or tile
        for n in run.prompt_tokens[: run.steps_to_first]:
            rows = 4 + n
            assert rows <= q or rows % q == 0 or rows % q >= q // 4, (n, q)


def test_with_the_default_target_prefill_stays_efficient() -> None:
    """`auto` (no --max-stall-ms given): where a step with any prompt in it pays a large
    fixed cost, chunks grow to where prefill runs within EFFICIENCY of its best, so the
    prompt takes a fraction of the steps; where the target already allows efficient
    chunks (the GPU's linear machine), the target holds as before."""
    hard = run_scenario(0.25, ExpertsInRam(1, slower=1.28), 512)
    auto = run_scenario(0.25, ExpertsInRam(1, slower=1.28), 512, auto=True)
    assert auto.steps_to_first < hard.steps_to_first / 4, (auto.steps_to_first, hard.steps_to_first)
    gpu_hard = run_scenario(0.25, linear)
    gpu_auto = run_scenario(0.25, linear, auto=True)
    assert max(gpu_auto.times) <= 0.25 and max(gpu_hard.times) <= 0.25
    assert abs(gpu_auto.steps_to_first - gpu_hard.steps_to_first) <= 2


@pytest.mark.parametrize("copy_s", [1.0, 2.0])
def test_where_one_batch_costs_more_than_the_pause_to_spend_chunks_take_the_knee(
    copy_s: float,
) -> None:
    """`auto` with the experts in host RAM and every expert in use: any prompt step pays
    a ~1-2 s copy, beyond a share of llama-server's pause. Chunks of the minimum would pay
    it ~500 times for a 16K prompt (a GPU run did not finish in 12 minutes); the knee
    pays it once per ~1,500 rows: the prompt takes a few dozen steps and no step is
    longer than a full physical batch."""
    full = 0.084 + copy_s  # a whole 2,048-row batch on this machine
    for seed in range(5):
        run = run_scenario(0.25, ExpertsInRamAllUsed(seed, copy_s), 2048, auto=True,
                           prompt=16384)  # fmt: skip
        assert run.steps_to_first <= 20, (seed, run.steps_to_first)
        assert max(run.times) <= 1.3 * full, (seed, max(run.times))


def test_with_a_side_context_no_decoder_waits_for_the_every_expert_copy() -> None:
    """The same machine (every expert copied for each prompt batch, ~1 s), with a side
    context: no step carrying the prompt could keep the target, so it is prefilled beside
    the decoders' steps, which stay within 1.2x the target (the step that restores its KV
    included), and its first token comes no later than the knee's steps in place bring it."""
    for seed in range(5):
        aside = run_scenario(0.25, ExpertsInRamAllUsed(seed), 2048, auto=True, prompt=16384,
                             side=True)  # fmt: skip
        in_place = run_scenario(0.25, ExpertsInRamAllUsed(seed), 2048, auto=True, prompt=16384)
        assert max(aside.times) <= 1.2 * 0.25, (seed, max(aside.times))
        assert max(in_place.times) > 1.0  # (what the decoders paused without it)
        assert aside.ttft_s <= 1.1 * in_place.ttft_s, (seed, aside.ttft_s, in_place.ttft_s)
        assert sum(aside.prompt_tokens) == 1  # all but its last token aside


def test_the_fixed_budget_takes_whole_batches() -> None:
    """`--max-stall-ms 0`: llama.cpp's and vLLM's behaviour, every chunk as large as the
    step allows, and the decoders wait for it."""
    run = run_scenario(None, linear)
    assert max(run.prompt_tokens) == 2048 - 4
    assert max(run.times) > 1.0


def test_a_machine_that_slows_down_is_caught_up_with_within_a_few_steps() -> None:
    """From the prompt's 40th step the machine runs 1.5x slower (another process took
    cores): the correction follows it within steps, where the fit forgets slowly."""

    class SlowsDown:
        steps = 0

        def __call__(self, batch: StepBatch) -> float:
            self.steps += 1
            return linear(batch) * (1.5 if self.steps > 60 else 1.0)

    run = run_scenario(0.25, SlowsDown())
    assert sum(t > 0.25 for t in run.times) <= 3


def test_the_cost_model_recovers_a_linear_machine() -> None:
    m = StepCostModel()
    rng = random.Random(0)
    for _ in range(200):
        d = rng.randint(1, 8)
        m.observe(StepDraft(d), 0.008 + 0.001 * d)
        n, depth = rng.randint(32, 2048), rng.randint(0, 60000)
        m.observe(StepDraft(d, chunks=[(n, depth)]),
                  0.008 + 0.001 * d + n * (0.0009 + 2e-8 * (depth + n / 2)))  # fmt: skip
    assert m.decode_time(4) == pytest.approx(0.012, rel=1e-3)
    terms = m.terms()
    assert terms["prompt_token_s"] == pytest.approx(0.0009, rel=0.02)
    assert terms["prompt_token_per_kv_cell_s"] == pytest.approx(2e-8, rel=0.05)


def test_the_fit_separates_per_token_per_pass_and_per_batch_costs() -> None:
    m = StepCostModel(ubatch=512)
    rng = random.Random(1)
    for _ in range(300):
        n, d = rng.randint(32, 2000), rng.randint(0, 30000)
        batches = -(-(4 + n) // 512)
        m.observe(
            StepDraft(4, chunks=[(n, d)]),
            0.05 + n * (0.002 + 3e-7 * (d + n / 2)) + 2e-5 * (d + n) + 0.1 * batches,
        )
        m.observe(StepDraft(4), 0.05)  # fmt: skip
    terms = m.terms()
    assert terms["prompt_token_s"] == pytest.approx(0.002, rel=0.02)
    assert terms["prompt_token_per_kv_cell_s"] == pytest.approx(3e-7, rel=0.02)
    assert terms["prompt_chunk_per_kv_cell_s"] == pytest.approx(2e-5, rel=0.02)
    assert terms["prompt_batch_s"] == pytest.approx(0.1, rel=0.02)


def test_the_policy_grants_a_minimum_chunk_before_it_knows_anything() -> None:
    p = StallTarget(StepCostModel(), 0.25, min_chunk=32, step_tokens=2048)
    step = StepDraft(4, waiting=True)
    assert p.grant(step, 5000, 0) == 32  # measured first
    step.chunks.append((32, 0))
    assert p.grant(step, 5000, 0) == 0  # a second prompt waits until prompts are known
    assert p.grant(StepDraft(0), 2048, 0) == 2048  # nobody waits: full batches
    assert p.grant(StepDraft(4, waiting=True, exempt=True), 2048, 0) == 2048  # a burst
    assert FixedBudget(StepCostModel()).grant(step, 2048, 0) == 2048


def test_a_short_prompt_goes_whole_in_the_physical_batch_the_step_runs_anyway() -> None:
    """Under auto, a prompt that fits whole in the step's one physical batch is not
    chunked, however the fit prices it: on the 2-core CPU, 16 chat users whose prompts
    arrived one by one had each split in two steps (80, then 48 tokens) by a fit of steps
    all alike, whose correction said steps ran 3x their model — 1.6x llama-server's first
    token. As measured there: 15 decoders 105 ms, with an 80-token first chunk 600 ms,
    with the 48-token rest 240 ms. A long prompt's last chunk stays sized to the target."""
    p = StallTarget(StepCostModel(ubatch=512), 0.25, 32, 2048, auto=True)
    for _ in range(40):
        p.observe(StepDraft(15, 2250, waiting=True), 0.105)
        p.observe(StepDraft(15, 2250, waiting=True, chunks=[(80, 0)]), 0.60)
        p.observe(StepDraft(15, 2250, waiting=True, chunks=[(48, 80)]), 0.24)
    p.correction = 1.15  # log(measured / modelled) as the server had it
    assert p.grant(StepDraft(15, 2250, waiting=True), 2048, 0, 128) == 128
    assert p.grant(StepDraft(15, 2250, waiting=True), 2048, 7900, 300) < 300  # an 8K's end
    manual = StallTarget(p.cost, 0.25, 32, 2048)  # a target given: kept
    manual.correction = p.correction
    assert manual.grant(StepDraft(15, 2250, waiting=True), 2048, 0, 128) < 128


def test_steps_that_measure_no_time_do_not_break_the_plan() -> None:
    """A backend reporting 0-second steps leaves the model all zeros: the policy still
    grants the minimum chunk, and divides by nothing."""
    cost = StepCostModel(512, 64)
    p = StallTarget(cost, 0.25, 32, 2048)
    p.observe(StepDraft(4, waiting=True), 0.0)
    p.observe(StepDraft(0, chunks=[(100, 0)]), 0.0)
    assert p.grant(StepDraft(4, waiting=True), 1000, 0) >= 32


def test_a_fit_that_saw_only_short_prompts_does_not_grow_chunks_past_the_target() -> None:
    """Short chat prompts beside two decoders cost ~12 ms whatever their size, so the fit
    learns a fixed cost and nothing per token; a long prompt then costs 1.5 ms a token.
    Chunks grow only within what the fit has seen (twice the largest recent step), and
    none goes over (a cap on the all-time largest chunk once granted 6.8 s steps)."""
    for seed in range(4):
        p = StallTarget(StepCostModel(), 0.25, 32, 2048)
        rng = random.Random(seed)
        for _ in range(40):
            p.observe(StepDraft(2, waiting=True), 0.055 * math.exp(rng.gauss(0.0, 0.03)))
            p.observe(StepDraft(2, waiting=True, chunks=[(rng.randint(15, 40), 0)]),
                      0.067 * math.exp(rng.gauss(0.0, 0.03)))  # fmt: skip
        depth, times = 0, []
        while depth < 4500:
            step = StepDraft(2, waiting=True)
            n = p.grant(step, 510, depth, 4500 - depth)
            assert n >= 32 or n == 4500 - depth
            step.chunks.append((n, depth))
            times.append(0.055 + 0.0015 * n)
            p.observe(step, times[-1])
            depth += n
        assert max(times) <= 0.25, (seed, [round(t, 3) for t in times[:8]])
        # 4,500 tokens at 40+ a step: the first steps of the long prompt, mispredicted by
        # the fit the short prompts taught, stay in the margin's window for 200 steps
        assert len(times) <= 120, (seed, len(times))


def test_two_long_prompts_go_first_come_first_served_and_both_finish() -> None:
    """FCFS: the older prompt takes the step's prompt time first (and always its minimum
    chunk); the younger one gets what is left, then all of it. Nobody starves."""
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=8, kv_capacity=40000, max_num_batched_tokens=2048,
                        max_stall_s=0.25)
    )  # fmt: skip
    fake = FakeEngine()
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
        res.decode_s = linear(out.batch)
        now += res.decode_s
        outputs, _ = sched.postprocess(out, res, now)
        assert res.decode_s <= 0.25
        for o in outputs:
            first_token.setdefault(o.req_id, step)
        if "old" in first_token and "young" in first_token:
            break
    assert first_token["old"] < first_token["young"] < 3000


def test_a_burst_is_admitted_together_and_later_prompts_are_bounded_again() -> None:
    """A closed-loop wave: the first of 16 requests reaches an idle server alone; the other
    15 arrive during its step. It has one token, so it came with them: the next step takes
    all 15 prompts, over the target (llama-server would too) — on a machine where sharing
    a step brings first tokens sooner, a step's fixed cost dwarfing a prompt's (where a
    prompt costs its tokens they go about one a step: test_scheduler_core). Once it has
    two tokens, a newcomer's prompt is chunked."""
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=32, kv_capacity=40000, max_num_batched_tokens=2048,
                        max_stall_s=0.25)
    )  # fmt: skip
    fake = FakeEngine()
    now = 0.0
    steps: list[tuple[int, float]] = []  # (prompt tokens, step time)

    def step() -> None:
        nonlocal now
        out = sched.schedule(now)
        res = fake.step(out.batch)
        res.decode_s = 0.2 + 0.0001 * out.batch.num_tokens  # 1,920 prompt tokens: ~0.4 s
        now += res.decode_s
        _, stats = sched.postprocess(out, res, now)
        steps.append((stats.num_step_prompt_tokens, res.decode_s))

    sched.add(make_request("first", [3] * 128, 200, arrival=now))
    step()
    for i in range(15):
        sched.add(make_request(f"wave{i}", [10 + i] * 128, 200, arrival=now))
    step()
    assert steps[-1][0] == 15 * 128, "the wave's prompts went in one step"
    for _ in range(5):
        step()
    sched.add(make_request("late", [9] * 4000, 1, arrival=now))
    while sched.waiting or any(not r.is_decoding for r in sched.running):
        step()
        assert steps[-1][1] <= 0.25, "a prompt step stalled decoders with two tokens or more"
    assert len(steps) > 9, "the late prompt was chunked"


def test_a_newcomer_is_not_stalled_by_a_prefill_under_way_when_old_decoders_leave() -> None:
    """The burst exemption is for prompts arriving together, never for a prefill already
    under way: a short request admitted beside a long prefill keeps its bound even when the
    last old decoder leaves the step it got its first token (found in review: 12 s)."""
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=8, kv_capacity=40000, max_num_batched_tokens=2048,
                        max_stall_s=1.0, attention_tile=64)
    )  # fmt: skip
    fake = FakeEngine()
    now, newcomer, last, gaps = 0.0, None, {}, []
    sched.add(make_request("old", [5] * 16, 10_000, arrival=now))
    for step in range(400):
        if step == 10:
            sched.add(make_request("long", [7] * 20_000, 1, arrival=now))
        if step == 60:
            newcomer = make_request("new", [9] * 16, 50, arrival=now)
            sched.add(newcomer)
        if newcomer is not None and len(newcomer.output_ids) == 1:
            sched.abort("old", 0.0)  # its client leaves as the newcomer starts decoding
        outputs, now = run_step(sched, fake, cpu_attention, now)
        for o in outputs:
            if o.req_id == "new" and "new" in last:
                gaps.append(now - last["new"])
            last[o.req_id] = now
        if newcomer is not None and newcomer.status.is_finished:
            break
    assert gaps and max(gaps) <= 1.0, f"the newcomer's longest gap {max(gaps):.2f} s"


def test_with_the_default_target_two_prompts_share_the_knee_not_double_it() -> None:
    """`auto` sizes a step to at least the knee's worth of prompt: a second prompt in the
    same step shares it rather than bringing a knee of its own (each its own knee made
    steps of two prompts 1.5-1.8x those of one, found in review)."""

    def worst_step(prompts: int) -> float:
        sched = Scheduler(
            SchedulerConfig(max_num_seqs=8, kv_capacity=60000, max_num_batched_tokens=2048,
                            max_stall_s=0.25, ubatch=512, stall_auto=True)
        )  # fmt: skip
        fake, machine, now, worst = FakeEngine(), ExpertsInRam(3, slower=1.28), 0.0, 0.0
        fake.n_batch = 2048
        for i in range(4):
            sched.add(make_request(f"d{i}", [5 + i] * 16, 10_000, arrival=now))
        for step in range(400):
            if step == 20:
                for k in range(prompts):
                    sched.add(make_request(f"long{k}", [7 + k] * 12_000, 1, arrival=now))
            out = sched.schedule(now)
            res = fake.step(out.batch)
            res.decode_s = machine(out.batch)
            now += res.decode_s
            sched.postprocess(out, res, now)
            if step > 20:
                worst = max(worst, res.decode_s)
        return worst

    assert worst_step(2) <= 1.15 * worst_step(1), (worst_step(2), worst_step(1))


def cpu_deep(batch: StepBatch) -> float:
    """The 2-core CPU's costs as fitted over an 8K prompt: 50 ms a step, 25 ms per decode
    token, 2.15 ms per prompt token plus 0.17 µs per KV cell it attends, and 40 µs per
    cell of depth once per chunk (what every prompt chunk pays for the KV behind it)."""
    t = 0.05
    for c in batch.chunks:
        n = len(c.tokens)
        t += 0.025 if c.seq_id < 4 else n * (0.00215 + 1.66e-7 * (c.pos0 + n / 2)) + 4e-5 * c.pos0
    return t


def test_with_the_default_target_a_cpu_pauses_a_share_of_an_unbounded_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a CPU every prompt chunk pays for the KV behind it and the decoders' step is
    over an eighth of the target: `auto` spends SHARE of the pause an unbounded step
    (llama-server's) makes, no more, and given more it prefills faster."""

    def prefill(run: Run) -> list[float]:
        return run.times[20 : 21 + run.steps_to_first]

    unbounded = prefill(run_scenario(None, cpu_deep, prompt=8192))
    auto = prefill(run_scenario(0.25, cpu_deep, auto=True, prompt=8192))
    monkeypatch.setattr(StallTarget, "SHARE", 0.4)
    wider = prefill(run_scenario(0.25, cpu_deep, auto=True, prompt=8192))
    assert max(auto) <= 0.25 * max(unbounded), (max(auto), max(unbounded))
    assert 0.25 * max(unbounded) < max(wider) <= 0.4 * max(unbounded)
    assert sum(wider) < 0.9 * sum(auto), (sum(wider), sum(auto))


@dataclass
class Prefill:
    ttft_s: float  # from the prompt's arrival to its first token
    longest_s: float  # the longest step the decoders waited for in that time


def run_arrival(machine: Machine, auto: bool, prompt: int = 8192) -> Prefill:
    """As a user meets a freshly started server: 4 users arrive together (32-token
    prompts) and decode for 3 s; then a `prompt`-token prompt arrives. `auto` at the
    default 250 ms, or (False) every chunk the whole step budget (llama-server)."""
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=8, kv_capacity=40000, max_num_batched_tokens=2048,
                        max_stall_s=0.25 if auto else None, min_prefill_chunk=32,
                        ubatch=512, attention_tile=64, stall_auto=auto)
    )  # fmt: skip
    fake = FakeEngine()
    fake.n_batch = 2048
    now, arrived, longest = 0.0, -1.0, 0.0
    for i in range(4):
        sched.add(make_request(f"d{i}", [5 + i] * 32, 10_000, arrival=now))
    for _ in range(3000):
        if arrived < 0 and now >= 3.0:
            sched.add(make_request("long", [7] * prompt, 1, arrival=now))
            arrived = now
        out = sched.schedule(now)
        res = fake.step(out.batch)
        res.decode_s = machine(out.batch)
        now += res.decode_s
        outputs, _ = sched.postprocess(out, res, now)
        if arrived >= 0:
            longest = max(longest, res.decode_s)
        if any(o.req_id == "long" for o in outputs):
            return Prefill(now - arrived, longest)
    raise AssertionError("the long prompt never got its first token")


def test_with_the_default_target_a_compute_bound_cpu_keeps_llama_servers_pace() -> None:
    """The 2-core CPU (`ComputeBound`), an 8K prompt beside 4 users, ten seeds: without a
    flag the prompt's first token comes within 1.25x of llama-server's (every chunk the
    whole step budget), and the users' longest pause is within a quarter of its. Before
    (steps to the 250 ms target, or to the knee), the first token took 1.39x (median,
    1.53x worst): each step pays for the decoders and a pass over the KV."""
    for seed in range(10):
        ours = run_arrival(ComputeBound(seed), auto=True)
        peer = run_arrival(ComputeBound(seed), auto=False)
        assert ours.ttft_s <= 1.25 * peer.ttft_s, (seed, ours.ttft_s, peer.ttft_s)
        assert ours.longest_s <= 0.25 * peer.longest_s, (seed, ours.longest_s, peer.longest_s)


class BatchedCpu:
    """The 2-core CPU serving the embedded model, where prompt rows cost less in a big step
    than in a small one (as measured there: a 128-token prompt ~2.6 ms a token alone,
    ~1.6 in a 2,048-row batch — the matmuls' fixed cost per step with prompt rows, 128
    ms, shared by every row): a decode step of D users 60 ms + 4 ms a user; prompt rows
    1.6 ms each plus 128 ms a physical batch of 2,048 rows that carries any. 3% jitter."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def __call__(self, batch: StepBatch) -> float:
        prompt = sum(len(c.tokens) for c in batch.chunks if len(c.tokens) > 1)
        decode = sum(1 for c in batch.chunks if len(c.tokens) == 1)
        t = 0.06 + 0.004 * decode
        if prompt:
            t += 0.0016 * prompt + 0.128 * -(-batch.num_tokens // 2048)
        return t * math.exp(self.rng.gauss(0.0, 0.03))


@dataclass
class Traffic:
    output_tok_s: float  # every user's output over the run's wall time
    decode_tok_s: float  # tokens after each request's first, over the same time
    ttft_p50_s: float
    itl_p99_s: float  # the pause between a stream's consecutive tokens


def run_users(machine: Machine, ours: bool, spread: float = 0.0, users: int = 16,
              isl: int = 128, osl: int = 64, requests: int = 4,
              ramp_s: float = 0.0) -> Traffic:  # fmt: skip
    """`users` chat users in a closed loop (`bench.compare`'s shape): each sends a prompt,
    reads `osl` tokens (± `spread`), sends the next, `requests` times; each user's first
    request is the warm-up (the cost model learns the machine), not counted. A request
    reaches the scheduler a client's round trip (2-30 ms) after its user started or read
    the last token, so a wave's prompts arrive spread over a few milliseconds and a step
    may start with only the first of them, as on a real server; `ramp_s`: the users start
    one after another over that time (a load generator's ramp). `ours`: the default
    policy (the stall target, `auto`); else llama-server's — every waiting prompt joins the
    step, each chunk the whole step budget."""
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=32, kv_capacity=60000, max_num_batched_tokens=2048,
                        max_stall_s=0.25 if ours else None, min_prefill_chunk=32,
                        ubatch=2048, stall_auto=ours)
    )  # fmt: skip
    if not ours:
        sched.chunks.cost.joins = lambda *_: True  # type: ignore[method-assign]
        sched.chunks.cost.waits_for_decoders = lambda *_: False  # type: ignore[method-assign]
    fake = FakeEngine()
    fake.n_batch = 2048
    rng = random.Random(7)
    now, sent = 0.0, {u: 0 for u in range(users)}
    due = [(rng.uniform(0.002, 0.03) + ramp_s * u / users, u) for u in range(users)]
    arrival: dict[str, float] = {}
    last: dict[str, float] = {}
    ttft: list[float] = []
    gaps: list[float] = []
    out_tokens = decode_tokens = 0

    def send(u: int, at: float) -> None:
        rid = f"u{u}r{sent[u]}"
        n = max(1, round(osl * (1 + spread * rng.uniform(-1, 1))))
        sched.add(make_request(rid, [100 + 37 * u + sent[u] + i % 50 for i in range(isl)], n,
                               arrival=at))  # fmt: skip
        arrival[rid] = at
        sent[u] += 1

    start = math.inf  # the first counted request's arrival
    for _ in range(100_000):
        if not sched.waiting and not sched.running:
            if not due:
                break
            now = max(now, min(due)[0])  # idle: the next request's arrival
        for at, u in sorted(d for d in due if d[0] <= now):
            send(u, at)
            due.remove((at, u))
            if sent[u] == 2:
                start = min(start, at)
        outputs, now = run_step(sched, fake, machine, now)
        for o in outputs:
            if not o.token_ids:
                continue
            u = int(o.req_id[1:].split("r")[0])
            if o.finish_reason is not None and sent[u] < requests:
                due.append((now + rng.uniform(0.002, 0.03), u))
            if o.req_id.endswith("r0"):
                continue
            out_tokens += len(o.token_ids)
            if o.req_id in last:
                gaps.append(now - last[o.req_id])
                decode_tokens += len(o.token_ids)
            else:
                ttft.append(now - arrival[o.req_id])
            last[o.req_id] = now
    else:
        raise AssertionError("the users never finished")
    gaps.sort()
    wall = now - start
    return Traffic(out_tokens / wall, decode_tokens / wall, statistics.median(ttft),
                   gaps[min(len(gaps) - 1, round(0.99 * (len(gaps) - 1)))])  # fmt: skip


@pytest.mark.parametrize("spread", [0.0, 0.5], ids=["lock-step", "spread"])
@pytest.mark.parametrize("users", [1, 4, 16])
def test_many_users_with_short_prompts_never_trail_llama_servers_batching(
    users: int, spread: float
) -> None:
    """Chat users with 128-token prompts on the CPU where batched prompt rows cost less
    (`BatchedCpu`), in lock-step waves and with output lengths spread ±50%, starting over
    0.6 s (a wave's prompts then reach the server over two prompt steps): against
    llama-server's policy (every waiting prompt in the step) ours decodes and delivers at
    least as fast, its first tokens come no later at the median and its streams pause no
    longer at p99 (within the 3% jitter). Admitting one prompt a step kept the split wave
    of 16 lock-step users apart for good: 0.85x the decode rate; spreading a wave's prompts
    over steps to bring the first one sooner gave 0.90x and 3.4-3.6x the pauses at p99."""
    for seed in range(3):
        ours = run_users(BatchedCpu(seed), True, spread, users, ramp_s=0.6)
        peer = run_users(BatchedCpu(seed), False, spread, users, ramp_s=0.6)
        assert ours.decode_tok_s >= 0.97 * peer.decode_tok_s, (seed, ours, peer)
        assert ours.output_tok_s >= 0.97 * peer.output_tok_s, (seed, ours, peer)
        assert ours.ttft_p50_s <= 1.05 * peer.ttft_p50_s, (seed, ours, peer)
        assert ours.itl_p99_s <= 1.2 * peer.itl_p99_s, (seed, ours, peer)
