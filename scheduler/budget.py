"""How many prompt tokens a step may carry: the chunk policy.

A long prompt is prefilled in chunks, one per step, beside the users decoding: a trade of
their pause against its first token. Two policies behind one interface — `grant(step,
n_max, depth)` per prompt chunk, `observe(step, seconds)` once it ran, `stats()`:

- `FixedBudget` grants every chunk the step's token budget (llama.cpp's and vLLM's
  behaviour; `--max-stall-ms 0`): the fastest prefill, and decoders wait for all of it.
- `StallTarget` sizes the chunks so that a step with decoders in it stays under a target
  time, with the step-cost model of `scheduler.step_cost`, which knows where kernels
  change (physical batches, CPU attention tiles) from the geometry the engine reports:

  1. The chunk is the largest whose modelled step fits the target divided by the
     correction and the margin (bisection: the modelled time rises with the chunk, in
     steps at each boundary), or of those the one that prefills fastest.
  2. The correction is feedback: a weighted mean of log(measured / modelled) — what the
     fit, slow to forget so as to average out noise, still misses (a machine that slowed
     down, a prefill deeper than the fit's points).
  3. The margin plans to a high quantile of the recent residuals, not their mean: a
     steady GPU keeps a few percent, a shared CPU room for its 1.34x spikes (its ggml
     threads all wait at each op's barrier for one preempted thread); `_least_risk`.
  4. The first chunk of a step gets at least `min_chunk` tokens, so prefill always
     progresses (also before any prompt was measured); a step is never larger than the
     model can be trusted with (`StepCostModel.trusted_rows`).
  5. Under `auto` (no target given), where the target leaves the prefill inefficient —
     the knee, where prefill runs within EFFICIENCY of its best speed, lies beyond the
     target's chunk, or the decoders' own step takes over 1 - 1 / EFFICIENCY of it — a
     step may spend SHARE of the pause llama-server makes there (its full batch), on the
     chunk that prefills fastest within it: on a compute-bound CPU a decode step of a few
     users costs little beside a prompt chunk, so a step is its chunk, and every chunk
     pays for the decoders and a pass over the KV (a fake of the 2-core CPU, an 8K prompt:
     its first token 1.39x llama-server's in 250 ms or knee steps, 1.14x in a fifth of
     its pause). Where llama-server's pause is within the target (experts in host RAM:
     any prompt step costs about the target), or where no chunk past the minimum fits in
     that share (experts in host RAM, each physical batch using all of them: its copy to
     the GPU alone takes more), a smaller step buys no shorter pause: the knee stands,
     cut to LEAST_EFFICIENT.

  A step is bounded only when someone waits for it: decoders here, or requests of another
  lane that steps after it. A burst's step is not (every decoder has one token and no
  prefill is under way: the prompts arrived together, and bounding them would stagger the
  burst over many steps).

Kept in one file past the ~250 lines a scheduler module aims at: most of it is one class,
`StallTarget`, whose searches (largest within, fastest within, the knee, least risk) all
read the same correction, margin and cost model; split apart they would pass that state
back and forth. A quarter of the file is this note, the policy's design.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Protocol

from scheduler.step_cost import StepCostModel, StepDraft


class ChunkPolicy(Protocol):
    cost: StepCostModel

    def grant(self, step: StepDraft, n_max: int, depth: int, rest: int = 0, behind: int = 0) -> int:
        """Tokens (at most `n_max`) a prompt at KV depth `depth`, `rest` tokens from its
        end, with `behind` prompts queued after it, may add to `step`."""
        ...

    def bounded(self, step: StepDraft) -> bool: ...  # is this step held to a target?

    def beyond_reach(self, step: StepDraft, rest: int) -> bool: ...  # see StallTarget's

    def observe(self, step: StepDraft, seconds: float) -> None: ...  # the engine's time

    def stats(self) -> dict[str, float]: ...  # figures for /metrics


class FixedBudget:
    """Every chunk as large as the step's token budget allows."""

    def __init__(self, cost: StepCostModel) -> None:
        self.cost = cost

    def grant(self, step: StepDraft, n_max: int, depth: int, rest: int = 0, behind: int = 0) -> int:
        return n_max

    def bounded(self, step: StepDraft) -> bool:
        return False

    def beyond_reach(self, step: StepDraft, rest: int) -> bool:
        return False

    def observe(self, step: StepDraft, seconds: float) -> None:
        self.cost.observe(step, seconds)

    def stats(self) -> dict[str, float]:
        return self.cost.terms()


class StallTarget:
    """Chunks sized to keep steps under `target_s` (see the module doc)."""

    GAIN = 0.2  # weight of the newest planned step in the correction
    RELAX = 0.05  # per decode-only step, the correction moves this share back to 0
    QUANTILE = 0.995  # the margin covers this share of steps ...
    WINDOW = 200  # ... of the last this many planned steps
    PRIOR = 0.15  # the margin until the window holds 1 / (1 - QUANTILE) steps: ~16%
    EFFICIENCY = 1.15  # auto: the target is efficient where prompt tokens cost at most
    # this much over their best; where not, a step may take ...
    SHARE = 0.2  # ... this share of llama-server's pause: users are promised a quarter of
    # it, and its longest runs shallower than our model of its last full batch (it splits
    # that batch): 2-core CPU, 8K prompt, its longest 4.7-6.6 s, our model's ~7 s
    LEAST_EFFICIENT = 1.3  # no pause of llama-server's to spend: the knee, cut to this

    def __init__(
        self, cost: StepCostModel, target_s: float, min_chunk: int, step_tokens: int,
        auto: bool = False,
    ) -> None:  # fmt: skip
        self.cost, self.target, self.min_chunk, self.auto = cost, target_s, min_chunk, auto
        self.step_tokens = step_tokens  # the most tokens a step may carry
        self.correction = 0.0  # log(measured / modelled), weighted to the newest
        self._memo: dict[int, float] = {}  # _time's, for the grant under way
        self.residuals: deque[float] = deque(maxlen=self.WINDOW)

    def bounded(self, step: StepDraft) -> bool:
        return step.waiting and not step.exempt

    def beyond_reach(self, step: StepDraft, rest: int) -> bool:
        """Would every step that carries any of a new `rest`-token prompt beside the
        decoders go over the target? It would where the smallest such step — the decoders
        and the minimum chunk (or the whole prompt, if shorter) — is modelled over it:
        with every expert of a prompt's rows in host RAM, a step of 32 rows or more copies
        them all to the GPU (~1 s), a smaller one computes them on the CPU (~10 ms a row).
        No chunk size bounds that pause; a context of its own beside the steps does
        (scheduler.core sets such a prompt aside, engine.side_prefill)."""
        if not self.bounded(step) or not self.cost.knows_prompts or rest < 1:
            return False
        alone, self._memo = StepDraft(step.n_decode, step.decode_cells), {}
        floor = self._time(alone, min(self.min_chunk, rest), 0)
        self._memo = {}
        return floor * math.exp(self.correction) > self.target

    def _residuals(self) -> list[float]:
        """Recent log(measured / modelled) beyond the correction, largest first; with the
        PRIOR among them until the window holds enough steps for the QUANTILE."""
        r = list(self.residuals)
        if len(r) * (1.0 - self.QUANTILE) < 1.0:
            r.append(self.PRIOR)
        return sorted(r, reverse=True)

    def margin(self) -> float:
        """log of the planned step's headroom under the target that leaves 1 - QUANTILE of
        recent steps over it (at least 0)."""
        r = self._residuals()
        return max(0.0, r[min(len(r) - 1, int((1.0 - self.QUANTILE) * len(r)))])

    def grant(self, step: StepDraft, n_max: int, depth: int, rest: int = 0, behind: int = 0) -> int:
        if not self.bounded(step):
            return n_max
        floor = 0 if step.chunks else min(self.min_chunk, n_max)
        if not self.cost.knows_prompts or n_max < 1:
            return floor
        if self.auto and step.finishing and 0 < rest <= n_max:
            # the step already ends a prompt: its decoders pause for that prompt's step
            # anyway, and a short prompt beside it adds only its rows, where a step of its
            # own would pause them again, whole; it joins whole or waits, by the users'
            # whole cost (StepCostModel.joins). One prompt a step kept a split wave of 16
            # chat users apart for good: 0.84x llama-server's decode rate, 3.4x its pauses.
            return rest
        if (
            self.auto
            and 0 < rest <= n_max
            and max(depth + rest, step.rows + rest) <= (self.cost.ubatch)
        ):
            # a short prompt, whole in the one physical batch the step runs anyway: a
            # chunk of it saves the decoders a fraction of one batch's compute, and costs
            # the prompt a step and every stream a second pause (a 16-user chat whose
            # prompts arrive one by one, split in two: 1.6x llama-server's first token,
            # its steps 2.5x slower than their model, fitted on steps all alike). A long
            # prompt's last chunks stay sized to the target.
            return rest
        self._memo = {}  # _time's, for this grant
        n = self._least_risk(step, n_max, depth)
        if self.auto:
            n = max(n, self._efficient(step, n, n_max, depth, max(rest, n_max)))
            self._memo = {}
            if 0 < n < rest <= n_max:
                n = self._whole_if_cheaper(step, n, rest, depth, behind)
                self._memo = {}
        n = max(n, floor)
        if n > 0 and 0 < rest - n < self.min_chunk and rest <= n_max:
            # No last chunk under the minimum (experts in host RAM are computed on the CPU
            # under 32 rows: 4 decoders and an 18-token tail took 282 ms, planned 179)
            fits = step.rows + rest <= self.cost.trusted_rows() and (
                self._time(step, rest, depth) * math.exp(self.correction) <= self.target
            )
            n = rest if fits else (rest - self.min_chunk if rest - self.min_chunk >= floor else n)
        return min(n, n_max)

    def _efficient(self, step: StepDraft, n: int, n_max: int, depth: int, rest: int) -> int:
        """Under auto, the chunk where the target's `n` leaves the prefill inefficient (the
        module doc, 5); `n` where it does not. A second prompt in the step shares it."""
        alone, self._memo = StepDraft(step.n_decode, step.decode_cells), {}
        shared = step.rows - step.n_decode  # prompt rows already in the step
        decoders = self.cost.decode_time(step.n_decode, step.decode_cells)
        if decoders <= self.target * (1 - 1 / self.EFFICIENCY) and (
            n + shared >= self._knee(alone, n_max, depth, self.EFFICIENCY)
        ):
            return n
        gap = self._gap(alone, depth, depth + rest)
        fast = self._fastest_within(
            alone, n_max, depth, gap / math.exp(self.correction + self.margin())
        )
        if gap <= self.target or fast < self.min_chunk:  # no pause to spend on a chunk
            fast = max(fast, self._knee(alone, n_max, depth, self.LEAST_EFFICIENT))
        return fast - shared

    def _whole_if_cheaper(
        self, step: StepDraft, n: int, rest: int, depth: int, behind: int = 0
    ) -> int:
        """Under auto, the rest of a prompt in this step where chunking it by `n` costs
        more time than the pause it saves. Each chunk's step pays the fixed cost of prompt
        rows (a physical batch's: on a CPU a 128-token prompt costs ~2.6 ms a token alone,
        ~1.6 in a 2,048-row batch), which every stream then waits; the pause it saves is
        the whole step's over the chunk's. A long prompt saves seconds of pause for a few
        batches' cost and is chunked; a chat prompt, whose whole step is a fraction of a
        second over the target, cost 4 users chunked 0.85-0.99x llama-server's decode rate
        and 1.2-2.5x its first-token time, for pauses at most a third shorter. Weighed by
        who pays: the time chunking adds, every stream in the step, the prompt and the
        `behind` prompts queued after it; the shorter pause, only the streams — a wave of
        16 chat prompts chunked one by one beside its first few decoders came apart."""
        base = self.cost.step_time(step)  # the step as drafted, without this prompt
        full, last = divmod(rest, n)  # whole chunks of n, and what is left
        part, whole = self._time(step, n, depth), self._time(step, rest, depth)
        chunked = full * (part - base) + (self._time(step, last, depth) - base if last else 0.0)
        lost = chunked + base - whole  # prompt work the chunks' steps add beyond one step's
        saved = whole - part  # the longest pause, shortened
        streams = step.n_decode + step.finishing
        return rest if lost * (streams + 1 + behind) >= saved * max(1, streams) else n

    def _time(self, step: StepDraft, n: int, depth: int) -> float:
        """The step's modelled time with an n-token chunk from `depth` added."""
        if n not in self._memo:
            chunks = [*step.chunks, (n, depth)]
            draft = StepDraft(step.n_decode, step.decode_cells, chunks=chunks)
            self._memo[n] = self.cost.step_time(draft)
        return self._memo[n]

    def _gap(self, alone: StepDraft, depth: int, end: int) -> float:
        """The pause a step may spend: SHARE of the one llama-server makes here — a full
        batch from this depth, none deeper than its last (ending where the prompt does) —
        or the target if longer. A full batch larger than the model can be trusted with is
        scaled from the largest it can: its part that grows with the chunk, by tokens (a
        compute-bound step costs its rows' work; fitted on small chunks, a 2,048-row step
        was extrapolated to 2.5x what it took)."""
        n = max(1, min(self.step_tokens - alone.rows, end))
        seen, d = max(1, min(n, self.cost.trusted_rows() - alone.rows)), min(depth, end - n)
        self._memo = {}
        fixed = self._time(alone, 0, d)  # the decoders, a pass over the KV, a batch
        full = fixed + (self._time(alone, seen, d) - fixed) * n / seen
        self._memo = {}
        return max(self.target, self.SHARE * full)

    def _fastest_within(self, step: StepDraft, n_max: int, depth: int, limit: float) -> int:
        """Of the chunks whose step fits `limit` as modelled, the one that prefills fastest
        (prompt tokens per second of step): the largest, or a kernel boundary below it."""
        top = self._largest_within(step, n_max, depth, limit)
        if top >= n_max:  # all it may take: no later step pays for the rest
            return n_max
        ends = [top, *(e for e in self._ends(step, n_max) if e < top)]
        return max((e for e in ends if e > 0), default=0,
                   key=lambda e: e / max(self._time(step, e, depth), 1e-12))  # fmt: skip

    def _ends(self, step: StepDraft, n_max: int) -> list[int]:
        """Chunks that end the step on a boundary where kernels change — a full physical
        batch, a full attention tile — and `n_max`: between two, a chunk's cost per token
        falls (its fixed parts spread), and it jumps past each."""
        qs = [q for q in (self.cost.ubatch, self.cost.tile) if q]
        ends = {n_max} | {b - step.rows for q in qs for b in range(q, step.rows + n_max, q)}
        return sorted(n for n in ends if 0 < n <= n_max)

    # a step planned to the limit the k-th largest residual sets goes over when it lands
    # as the k - 1 above did
    _RANKS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96)

    def _least_risk(self, step: StepDraft, n_max: int, depth: int) -> int:
        """The fastest chunk planned to the QUANTILE: of the chunks within a limit, the one
        that prefills fastest (on the 2-core CPU a 64-row step, tiled attention, took 1.5x a
        63-row one). Unless the floor (decoders, minimum chunk) is itself over the quantile
        (experts in host RAM: any prompt step copies them to the GPU): then the chunk with
        the fewest expected steps over the target per prompt token (planned to the quantile,
        an H200 prefill took 32-row chunks and 14x an idle first token)."""
        r, ok = self._residuals(), 1.0 - self.QUANTILE
        floor = 0 if step.chunks else min(self.min_chunk, n_max)
        ends = self._ends(step, n_max)
        rate = {n: n / max(self._time(step, n, depth), 1e-12) for n in ends}

        def risk(n: int) -> float:  # the share of recent steps that would put it over
            over = math.log(self.target / max(self._time(step, n, depth), 1e-12))
            return sum(x > over - self.correction for x in r) / len(r)

        held = risk(floor) <= ok  # the quantile holds at the floor
        best, best_score = floor if held else 0, 0.0
        for k in (k for k in self._RANKS if k <= len(r)):
            limit = self.target * math.exp(-self.correction - max(r[k - 1], 0.0))
            top = self._largest_within(step, n_max, depth, limit)
            rate[top] = top / max(self._time(step, top, depth), 1e-12) if top else 0.0
            n = max(max([top, *(e for e in ends if e <= top)], key=rate.__getitem__), floor)
            p = risk(n)
            if held:
                best = max(best, n) if p <= ok else best
            elif (step.rows - step.n_decode + n) / max(p, ok) > best_score:
                best, best_score = n, (step.rows - step.n_decode + n) / max(p, ok)
            if top >= n_max or (held and p > ok):
                break
        return best

    def _largest_within(self, step: StepDraft, n_max: int, depth: int, limit: float) -> int:
        """The largest chunk (at most `n_max`, in a step the model can be trusted with)
        whose step takes at most `limit` as modelled (bisection: the time only rises)."""
        lo, hi = 0, max(0, min(n_max, self.cost.trusted_rows() - step.rows))
        if self._time(step, hi, depth) <= limit:
            return hi
        while lo + 1 < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self._time(step, mid, depth) <= limit else (lo, mid)
        return lo

    def _knee(self, step: StepDraft, n_max: int, depth: int, efficiency: float) -> int:
        """The smallest chunk whose step prefills within `efficiency` of the best a step can
        at this depth (seconds per prompt token, decoders included: they are in every step
        of a prefill; with the experts in host RAM their step is most of it), over every
        step size as modelled, bisected in the first stretch between kernel boundaries
        whose end is efficient enough; at most `n_max` and what the model can trust."""
        ends = self._ends(step, self.step_tokens - step.rows)
        if not ends:
            return 0

        def per_token(n: int) -> float:
            return self._time(step, n, depth) / n

        bar, lo = efficiency * min(per_token(n) for n in ends), 1
        trusted = self.cost.trusted_rows() - step.rows
        for hi in ends:
            if per_token(hi) <= bar:
                while lo < hi:
                    mid = (lo + hi) // 2
                    lo, hi = (lo, mid) if per_token(mid) <= bar else (mid + 1, hi)
                return max(0, min(lo, n_max, trusted))
            lo = hi + 1
        return 0

    def observe(self, step: StepDraft, seconds: float) -> None:
        """The margin learns how far the planned step landed from its plan; the correction
        learns what the fit, having learned this step too, still misses: a fit that has
        caught up must not be corrected again (early in a prefill, one step the fit
        over-estimated by 1.6x, corrected twice, planned the next step 8% over)."""
        c = self.cost
        planned = step.chunks and self.bounded(step) and step.n_decode and c.knows_prompts
        before = c.step_time(step) if planned else 0.0
        c.observe(step, seconds)
        if before > 0 and seconds > 0:
            self.residuals.append(math.log(seconds / before) - self.correction)
            after = math.log(seconds / max(c.step_time(step), 1e-12))
            self.correction += self.GAIN * (after - self.correction)
        elif not step.chunks:  # between prefills a transient must not shrink chunks for good
            self.correction -= self.RELAX * self.correction

    def stats(self) -> dict[str, float]:
        return self.cost.terms() | {"correction": math.exp(self.correction),
                                    "headroom": math.exp(-self.margin())}  # fmt: skip
