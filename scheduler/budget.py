"""How many prompt tokens fit in a step without stalling the decoding users too long.

A step's time is modelled as

    t(D, P, d) = t_dec(D) + c0 * P + c1 * P * (d + P / 2) + g * (d + P) + h

for D decode tokens and a P-token prompt chunk whose KV depth starts at d: attention makes
each prompt token cost more the more context it attends to (c1), and a chunk also pays a
cost that grows with the span it attends over but not with its size (g): kernels work in
tiles, and a small chunk still makes whole passes over the KV; and a step pays a fixed
cost for carrying a prompt at all (h): with the experts in host RAM, llama.cpp copies them to
the GPU for any physical batch of 32 rows or more (H200: 4 decoders alone 84 ms, with 32
prompt rows 185 ms, with 283 rows 193 ms). On the 2-core CPU, ggml's
flash attention splits a step's rows into 8 pieces, each padded to a 64-row tile, so a
65-token chunk at 11K depth cost what a 128-token one does — 1.5x what a model without `g`
planned (bench/chunk_cost.py measures the shape on a machine). `t_dec` (a + b * D) is fitted
on decode-only steps, (c0, c1, g, h) on steps that carried prompt chunks — by exponentially
weighted least squares with non-negative terms, so the model follows the machine as it
warms up or gets busy. Until a term has data, the chunk falls back to the minimum
(measured, then grown) rather than a guess.

The fit lags a prefill that goes ever deeper: its points come from shallower chunks than
the one being planned (on the 2-core CPU at 8K depth, steps planned at 850 ms took 1,050–
1,100 ms). So the model also keeps `bias`, a fast moving average (faster up than down) of
measured / modelled time over the steps it planned (those with both decode tokens and
prompt chunks), and the budget plans against the target divided by it: a model that runs
behind is corrected within a few steps, whatever the cause.

Kernels also change with a step's size, and no smooth model follows that. On the 2-core
CPU serving 4 decoders and a 16K prompt, 62- to 79-token chunks at 12–16K depth took
1.0–1.3 s where 32–51 took 0.4–0.6 s (measured). A step of 64 or more rows takes ggml's
tiled flash-attention path; our reading of its code is that the decoders' rows share tiles
with the prompt's, and their sliding-window cells, scattered through the cache by hundreds
of interleaved steps, make whole tiles compute. The engine alone (`bench/chunk_cost.py`,
decoders' cells not scattered) shows a smaller jump of the same kind at 14K: 124 tokens
778 ms, 128 tokens 1,124 ms. So the bias is also kept per size class of
the step (`size_class`: physical batches, attention tiles, powers of two), and a chunk is
planned with the bias of the class it would put the step in: the planner finds the cheap
classes by measuring them, and takes the chunk that prefills fastest per second of step
among the largest of each class that fit. The fit learns each step's time less its
class's difference from everyone's bias, so the classes' biases stay ratios to a model
that the slow classes do not drag up.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass


@dataclass
class _Line:
    """Weighted least squares for y = k0 + k1 * x, with exponential forgetting."""

    decay: float = 0.98
    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        g = self.decay
        self.n = self.n * g + 1.0
        self.sx = self.sx * g + x
        self.sy = self.sy * g + y
        self.sxx = self.sxx * g + x * x
        self.sxy = self.sxy * g + x * y

    @property
    def ready(self) -> bool:
        return self.n >= 1.0

    @property
    def varied(self) -> bool:
        """x has varied enough (in what is remembered) for a slope."""
        mx = self.sx / self.n
        return self.sxx / self.n - mx * mx > 1e-9 * max(1.0, mx * mx)

    def fit(self) -> tuple[float, float]:
        """(k0, k1); a flat line through the mean while x has not varied enough."""
        mx, my = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mx * mx
        if not self.varied:
            return my, 0.0
        k1 = max(0.0, (self.sxy / self.n - mx * my) / var)
        return max(0.0, my - k1 * mx), k1


class _NonNegativeFit:
    """Weighted least squares for y = sum(k_i * x_i) with every k_i >= 0 and exponential
    forgetting. With three terms the exact non-negative solution is cheap: solve the normal
    equations on every subset of terms and keep the best whose terms are all >= 0. More
    terms must cut the residual by MORE_TERMS: with chunks of one size the three prompt
    terms are collinear, and a fit that splits noise between them predicts other sizes
    badly (a single point gives the first term alone)."""

    RIDGE = 1e-9  # relative, keeps near-collinear terms (similar chunks) solvable
    MORE_TERMS = 0.9  # a fit with more terms must have under 90% of the residual

    def __init__(self, k: int, decay: float = 0.98, late: tuple[int, float] = (-1, 0.0)) -> None:
        self.k = k
        self.decay = decay
        # (term, points): a term the fit may use only once it has that many (weighted) points
        self.late_term, self.late_points = late
        self.n = 0.0
        self.xx = [[0.0] * k for _ in range(k)]
        self.xy = [0.0] * k
        self.yy = 0.0
        self._coefs: list[float] | None = None

    def add(self, x: tuple[float, ...], y: float) -> None:
        g = self.decay
        self.n = self.n * g + 1.0
        for i in range(self.k):
            self.xy[i] = self.xy[i] * g + x[i] * y
            for j in range(self.k):
                self.xx[i][j] = self.xx[i][j] * g + x[i] * x[j]
        self.yy = self.yy * g + y * y
        self._coefs = None

    @property
    def ready(self) -> bool:
        return self.n >= 1.0

    def fit(self) -> list[float]:
        if self._coefs is None:
            self._coefs = self._solve()
        return self._coefs

    def _solve(self) -> list[float]:
        best: tuple[float, int, list[float]] | None = None  # (residual, terms, coefs)
        tie = 1e-12 * max(self.yy, 1e-300)
        for size in range(1, self.k + 1):
            for subset in itertools.combinations(range(self.k), size):
                if self.late_term in subset and self.n < self.late_points:
                    continue
                ks = _solve_normal(self.xx, self.xy, subset, self.RIDGE)
                if ks is None or min(ks) < 0 or not all(map(math.isfinite, ks)):
                    continue
                coefs = [0.0] * self.k
                for i, v in zip(subset, ks, strict=True):
                    coefs[i] = v
                res = self._residual(coefs)
                bar = best[0] * (self.MORE_TERMS if size > best[1] else 1.0) if best else 0.0
                if best is None or res < bar - tie:
                    best = (res, size, coefs)
        return best[2] if best else [0.0] * self.k

    def _residual(self, c: list[float]) -> float:
        r = self.yy - 2 * sum(c[i] * self.xy[i] for i in range(self.k))
        return r + sum(c[i] * c[j] * self.xx[i][j] for i in range(self.k) for j in range(self.k))


def _solve_normal(
    xx: list[list[float]], xy: list[float], subset: tuple[int, ...], ridge: float
) -> list[float] | None:
    """Solve the normal equations restricted to `subset` (Gauss-Jordan, partial pivoting),
    on columns scaled to unit diagonal: the terms differ by 10^5 in magnitude."""
    m = len(subset)
    if any(xx[i][i] <= 0 for i in subset):
        return None
    sc = [math.sqrt(xx[i][i]) for i in subset]
    a = [
        [xx[i][j] / (sc[r] * sc[c]) for c, j in enumerate(subset)] + [xy[i] / sc[r]]
        for r, i in enumerate(subset)
    ]
    for r in range(m):
        a[r][r] += ridge
    for col in range(m):
        piv = max(range(col, m), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-300:
            return None
        a[col], a[piv] = a[piv], a[col]
        for r in range(m):
            if r != col:
                f = a[r][col] / a[col][col]
                for c in range(col, m + 1):
                    a[r][c] -= f * a[col][c]
    return [a[r][m] / a[r][r] / sc[r] for r in range(m)]


class StepCostModel:
    """The learned step-time model."""

    # Weight of the newest step in `bias`: a step slower than planned sets it (an overshoot
    # is a pause users see; on the CPU a slow size class got slower with depth and each
    # return to it ran 8-13% over with a gain of 0.6), a faster one moves it by 0.3 (an
    # undershoot only costs a smaller chunk). One step raises it by at most BIAS_JUMP: a
    # single spike (the shared machine) must not make a class look 3x slower.
    BIAS_GAIN = 0.3
    BIAS_GAIN_UP = 1.0
    BIAS_JUMP = 1.5
    BIAS_RELAX = 0.05  # per decode-only step, `bias` moves this share back toward 1
    # The planner avoids a class that ran slow, so it would never measure it again, and one
    # spike would cap the chunks for good. So when it compares classes it sees a slow
    # class's bias relax toward everyone's as the class goes unmeasured (time constant in
    # measured steps), while a chunk in it is still sized with its own bias: a return to
    # it is a probe within the target. (Relaxing the bias itself, 0.5-2% a step, let the
    # CPU's slow class be re-entered with a bias it no longer had: up to 1,364 ms at a
    # 1,000 ms target.)
    EXPLORE_STEPS = 3.0
    BIAS_RANGE = (0.5, 4.0)
    # How far a planned step lands from its plan, |log(measured / planned)|, averaged over
    # recent planned steps (weight of the newest): the budget keeps room for the machine's
    # spread (StepTimeBudget.headroom). One step counts at most log(1.5).
    SPREAD_GAIN = 0.05
    FIXED_COST_POINTS = 8.0
    # The fit extrapolates to at most twice the largest chunk of recent steps (the largest
    # loses 3% a step, half in ~23 steps; at 10% a step the cap fell so fast in a dip to
    # small chunks that an experts-in-RAM fake with a small depth cost took 147 steps to
    # the first token instead of 125, median of 20 seeds): on a CPU-shaped fake, long runs
    # of 59-token chunks taught a fit with a fixed term that 342 tokens cost what 59 do,
    # and the all-time largest chunk (from shallow depth) let it grant them: 6.8 s steps
    # at a 1 s target. Only steps the fit learned from count: a step far slower than its
    # plan is dismissed as a spike (see `observe`), and when the fit is what was wrong —
    # short prompts had taught it a fixed cost and nothing per token — the chunks doubled
    # on the back of steps it never learned (CPU end-to-end test: a 1.19 s step at 250 ms).
    SEEN_DECAY = 0.97
    # Variance of the decode tokens per step (in what the batching fit remembers) below
    # which its judgement is kept: steps of one and two tokens, 11% or more of either.
    # Below it the slope rests on a few old steps and whatever has changed since (depth,
    # the machine's load) reads as the cost of a second sequence.
    BATCH_VARIETY = 0.1

    def __init__(self, ubatch: int = 0, tile: int = 0) -> None:
        self._dec = _Line()  # x = decode tokens, y = seconds
        # y = a decode-only step's seconds; x = (1, decode tokens, KV cells they attend):
        # what sharing a step buys (`batching_pays`), its judgement kept while steps of
        # other sizes still carry BATCH_VARIETY of what the fit remembers
        self._batch = _NonNegativeFit(3)
        self._batch_pays: bool | None = None
        # y = a step's seconds beyond its decode part; x = (prompt tokens, token-cells
        # attended, KV span of the chunks, chunks): the terms c0, c1, g and h of the module
        # doc. h only from FIXED_COST_POINTS points: from two noisy ones an intercept makes
        # a chunk twice the size look cheap per token (a 10%-jitter fake then ran 1.08x).
        self._prompt = _NonNegativeFit(4, late=(3, self.FIXED_COST_POINTS))
        self.max_seen_chunk = 0  # the largest prompt part of recent steps the fit learned
        self.bias = 1.0  # measured / modelled time of recent planned steps
        self.class_bias: dict[int, float] = {}  # the same, per size class (see size_class)
        if tile & (tile - 1) or (tile and ubatch % tile):
            raise ValueError("the attention tile must be a power of two dividing ubatch")
        self.ubatch = ubatch  # llama.cpp's physical batch (0: not known)
        self.tile = tile  # query rows per attention tile (0: attention is not tiled)
        self._measured = 0  # steps that updated a class bias
        self.spread = 0.05  # mean |log(measured / planned)| of planned steps (a prior)
        self._class_seen: dict[int, int] = {}  # class -> `_measured` when last updated
        self._class_depth: dict[int, int] = {}  # class -> KV depth it was last measured at
        self._top_full, self._top_bias = -1, 0.0  # see _note_classes

    _FULL = 1 << 16  # size_class: one full physical batch

    def size_class(self, n_tokens: int) -> int:
        """A step's size class, ordered as its size: `_FULL` per full physical batch
        (llama.cpp runs a step as batches of `ubatch` tokens), plus the class of the last
        batch — by powers of two (kernels switch at powers of two: ggml's CPU flash
        attention tiles from 64 rows, the GPU copies RAM experts from 32) and, from one
        attention tile on, by the tiles it fills (a tile costs the same for 1 row as for
        64). So 512 tokens are one batch and 513 two; 64 rows one tile and 65 two."""
        n, full = max(1, n_tokens), 0
        if self.ubatch:
            full, n = divmod(n - 1, self.ubatch)
            n += 1
        if self.tile and n >= self.tile:
            k = self.tile.bit_length() - 1 + (n - 1) // self.tile
        else:
            k = n.bit_length() - 1
        return full * self._FULL + k

    def class_range(self, c: int) -> tuple[int, int]:
        """The step sizes (tokens) of size class `c`, inclusive."""
        full, k = divmod(c, self._FULL)
        tiled = self.tile.bit_length() - 1 if self.tile else k + 1
        if k >= tiled:
            j = k - tiled
            first, last = (j * self.tile + 1 if j else self.tile), (j + 1) * self.tile
        else:
            first, last = 1 << k, (1 << (k + 1)) - 1
            last = min(last, self.tile - 1) if self.tile else last
        if self.ubatch:
            last = min(last, self.ubatch)
        return full * self.ubatch + first, full * self.ubatch + last

    def lower_class(self, c: int) -> int:
        """The size class just below `c` (-1 below the smallest)."""
        first, _ = self.class_range(c)
        return self.size_class(first - 1) if first > 1 else -1

    def bias_for(self, n_tokens: int) -> float:
        """The bias of steps of this size: their class's once measured, else everyone's —
        or, for a step of more physical batches than any measured, the largest bias known
        times BIAS_JUMP: each physical batch pays a fixed cost the fit cannot know before
        it sees one (H200, experts in RAM: a first 512 + 137-row step ran 1.47x its plan),
        so the first such step is a probe planned small."""
        return self.bias_of_class(self.size_class(n_tokens))

    def bias_of_class(self, c: int) -> float:
        """`bias_for` of the steps of size class `c`."""
        known = self.class_bias.get(c)
        if known is not None:
            return known
        if self.class_bias and c // self._FULL > self._top_full:
            return max(self.bias, self._top_bias) * self.BIAS_JUMP
        return self.bias

    def _note_classes(self) -> None:
        """Keep what `bias_for` asks of every class at hand (it is called per class per
        planned chunk)."""
        self._top_full = max(self.class_bias) // self._FULL if self.class_bias else -1
        self._top_bias = max(self.class_bias.values(), default=0.0)

    def choice_bias(self, c: int) -> float:
        """The bias the planner compares size class `c` with: a slow class's relaxes toward
        everyone's the longer it goes unmeasured (see EXPLORE_STEPS)."""
        b = self.class_bias.get(c, self.bias)
        if b <= self.bias:
            return b
        age = self._measured - self._class_seen.get(c, self._measured)
        return self.bias + (b - self.bias) * math.exp(-age / self.EXPLORE_STEPS)

    def measured_depth(self, c: int) -> int | None:
        """The KV depth size class `c` was last measured at (None: never)."""
        return self._class_depth.get(c)

    def measured_steps_ago(self, c: int) -> int | None:
        """Planned steps since size class `c` was last measured (1: the last one; None:
        never)."""
        seen = self._class_seen.get(c)
        return None if seen is None else self._measured - seen + 1

    @property
    def knows_prompts(self) -> bool:
        return self._prompt.ready

    def decode_time(self, n_decode: int) -> float:
        if not self._dec.ready:
            return 0.0
        a, b = self._dec.fit()
        return a + b * n_decode

    def batching_pays(self) -> bool:
        """Does decoding one more sequence in a step cost less than half of decoding it
        alone (its own work — per token and per KV cell it attends, at the depth steps
        have had — below the per-step work)? Then a running request shares its steps for
        less than 1.5x its pace, and two together run 1.33x+ the tokens of two one after
        the other. On a GPU it always does (weights are read once a step for every
        sequence); on a few CPU cores a small model's decode is compute-bound and it does
        not. True until steps of different sizes have been seen.

        Depth is in the fit because the steps it compares come at different depths: a
        warm-up of two short requests against one long prompt's decode alone made the
        second sequence look free when depth was left out (the deep single steps cost
        what the shallow double ones had), and the server shared steps that did not pay."""
        return self._batch_pays is None or self._batch_pays

    def _judge_batching(self) -> None:
        f = self._batch
        n, sd, sk, sdd = f.xx[0][0], f.xx[0][1], f.xx[0][2], f.xx[1][1]
        if n <= 0 or sdd / n - (sd / n) ** 2 < self.BATCH_VARIETY:
            return  # one size of step in memory: it says nothing about sharing
        a, b, e = f.fit()
        self._batch_pays = b + e * sk / sd <= a

    def step_time(self, n_decode: int, chunks: list[tuple[int, int]]) -> float:
        """Modelled seconds for a step of `n_decode` decode tokens and prompt `chunks` as
        (tokens, start depth); the decode part only while no prompt has been measured."""
        t = self.decode_time(n_decode)
        if self.knows_prompts:
            t += sum(self.chunk_time(n, d) for n, d in chunks)
        return t

    def chunk_time(self, n: int, depth: int) -> float:
        """Modelled seconds for an n-token prompt chunk starting at KV depth `depth`."""
        c0, c1, g, h = self._prompt.fit()
        return n * (c0 + c1 * (depth + n / 2)) + g * (depth + n) + h

    def tokens_within(self, room_s: float, depth: int, cap: int) -> int:
        """Largest chunk from `depth` whose modelled time fits in `room_s` (at most `cap`,
        and at most twice the largest chunk the fit learned from: beyond that it extrapolates)."""
        c0, c1, g, h = self._prompt.fit()
        room = room_s - g * depth - h
        if room <= 0:
            return 0
        lin = c0 + c1 * depth + g  # c1/2 * n^2 + lin * n <= room
        # the root of the quadratic in the form that does not cancel when c1 is tiny
        denom = lin + math.sqrt(lin * lin + 2 * c1 * room)
        n = 2 * room / denom if denom > 1e-30 else float(cap)
        limit = min(cap, 2 * max(self.max_seen_chunk, 1))
        return max(0, int(n) if n < limit else limit)

    def observe(
        self,
        n_decode: int,
        chunks: list[tuple[int, int]],
        seconds: float,
        planned: bool = True,
        decode_depth: int = 0,
    ) -> None:
        """One step: its decode tokens, its prompt chunks as (tokens, start depth), its time;
        `planned` when its chunks were sized for the stall target (a burst's were not: its
        ratio updates only its own size class, not the bias new classes start from);
        `decode_depth` the KV cells its decode tokens attend, summed."""
        n_prompt = sum(n for n, _ in chunks)
        if n_prompt == 0:
            if n_decode:
                self._dec.add(n_decode, seconds)
                self._batch.add((1.0, n_decode, decode_depth), seconds)
                self._judge_batching()
                # Between prefills the bias relaxes: a transient (another process for a
                # while) must not shrink the next prompt's chunks for good.
                self.bias += self.BIAS_RELAX * (1.0 - self.bias)
                for c, b in self.class_bias.items():
                    self.class_bias[c] = b + self.BIAS_RELAX * (1.0 - b)
                self._note_classes()
            return
        # The fit learns the smooth cost: the step's time less what sets its size class
        # apart (its class's bias over everyone's, before this step moves them), so a slow
        # class does not pull every other class's model up, nor a fast one down — each
        # class's bias is a ratio to the fit and would go stale whenever the fit moved.
        c = self.size_class(n_decode + n_prompt)
        class_bias = self.bias_of_class(c)  # what the step was planned with
        normal = seconds * self.bias / self.class_bias.get(c, self.bias)
        if n_decode and self._dec.ready and self.knows_prompts:  # a step the budget planned
            modelled = self.step_time(n_decode, chunks)
            if modelled > 0:
                lo, hi = self.BIAS_RANGE
                ratio = min(hi, max(lo, seconds / modelled))
                if ratio > class_bias * self.BIAS_JUMP:
                    # An outlier (a spike of the shared machine, or a step size that runs
                    # far slower): the biases jump, the fit does not learn it, or every
                    # class would look slow for as long as the fit remembers it. If it
                    # persists, the biases catch up and the fit learns it from then on.
                    normal = -1.0
                if planned:
                    miss = min(abs(math.log(ratio / class_bias)), math.log(self.BIAS_JUMP))
                    self.spread += self.SPREAD_GAIN * (miss - self.spread)
                # A class starts from everyone's bias: one step is too noisy to plan on
                # alone (a first ratio of 0.7 let the next chunk run 9% over the target).
                # A class marked slower than everyone (often by one unlucky step) that
                # measures faster than its mark drops to what it measured at once, down to
                # everyone's bias: a probe (`StepTimeBudget._fit`) that finds the class
                # fine must not leave it barred for the many steps a 0.3 gain takes.
                old = self.class_bias.get(c, self.bias)
                new = self._follow(old, ratio)
                if self.bias < old and ratio < old:
                    new = min(new, max(ratio, self.bias))
                self.class_bias[c] = new
                self._measured += 1
                self._class_seen[c] = self._measured
                self._class_depth[c] = max(d for _, d in chunks)
                self._note_classes()
                if planned:
                    self.bias = self._follow(self.bias, ratio)
        self.max_seen_chunk = int(self.max_seen_chunk * self.SEEN_DECAY)
        if normal < 0:
            return
        self.max_seen_chunk = max(n_prompt, self.max_seen_chunk)
        rest = max(normal - self.decode_time(n_decode), 0.0)
        cells = sum(n * (d + n / 2) for n, d in chunks)
        span = sum(d + n for n, d in chunks)
        self._prompt.add((float(n_prompt), cells, float(span), float(len(chunks))), rest)

    def _follow(self, bias: float, ratio: float) -> float:
        if ratio > bias:
            return min(bias + self.BIAS_GAIN_UP * (ratio - bias), bias * self.BIAS_JUMP)
        return bias + self.BIAS_GAIN * (ratio - bias)

    def estimate(self) -> dict[str, float]:
        """The model's current figures (for /metrics)."""
        out: dict[str, float] = {}
        if self._dec.ready:
            out["decode_base_s"], out["decode_per_token_s"] = self._dec.fit()
        if self.knows_prompts:
            c0, c1, g, h = self._prompt.fit()
            out["prompt_token_s"], out["prompt_token_per_kv_cell_s"] = c0, c1
            out["prompt_chunk_per_kv_cell_s"], out["prompt_chunk_s"] = g, h
        return out


class StepTimeBudget:
    """The time left for prompt chunks in the step being planned.

    Unbounded when nobody decodes, here or in another lane that waits for this step
    (prompts then use full batches), no target is set, or
    the step is a `burst`'s (every decoder has one token and no prefill is under way: see
    `Scheduler.schedule`), so a request of a burst may see one long gap, between its first
    and second token, and none after.
    The first chunk granted gets at least `min_chunk` tokens, so prefill always progresses
    — also before the model has seen any prompt (it measures that chunk, then grows).
    Chunks are sized to a share of the target (`headroom`) divided by the model's bias for
    the step's size class: the step's own Python and jitter come on top of the engine time
    the model predicts; of the classes a chunk may put the step in, the planner takes the
    one that prefills fastest (`_fit`).
    A step of more than one `model.ubatch` (llama.cpp runs a batch as physical batches of
    that size) does not end in a short one: each physical batch pays a fixed cost whatever its
    size — with experts in host RAM, a copy of the experts to the GPU or, under 32 tokens,
    a CPU pass over them (an H200 step of 4 decoders and a 538-token chunk, 512 + 30 rows,
    took 498 ms against 289 modelled) — so a tail shorter than a quarter of `ubatch` is
    left to the next step. The same for `model.tile`, when attention runs on the CPU: ggml's
    flash attention there works in tiles of 64 query rows from 64 rows on, and a tile
    costs the same for 1 row as for 64 (2-core CPU, 12.6K depth, 4 decoders: a 60-token
    chunk took 747 ms, a 65-token one 1,014).
    """

    # The share of the target a step is planned to: at most 85% (the step's Python and a
    # steady machine's jitter), less on a machine whose steps land far from their plan —
    # e^(-4 * spread), so that a step 4 spreads slower than planned still fits. A prefill
    # is ~170 steps and one over is a miss, so the room is for a ~99.7% step, and the
    # tail is fat (the shared 2-core CPU: spread 0.09-0.13, p98 1.17x, single 64-row steps
    # 1.5x; at 3 spreads 1-2 steps a run went over, at 4 none; the H200: spread < 0.06).
    HEADROOM = 0.85
    PROBE_GAIN = 1.25
    NOISE_SPREADS = 2.0
    STALE_RISE = 1.25
    STALE_DEPTH = 0.05
    STALE_TILES = 8
    TAIL_EXTRA = 1.1
    FLOOR_SLACK = 1.15
    SPREAD_K = 4.0
    MIN_HEADROOM = 0.6

    # Where the model runs on the CPU alone (attention in CPU tiles: `model.tile`), at most
    # 70%: every op of a step runs on ggml threads that take every core and meet at a
    # barrier after each op, so one thread preempted by anything else on the machine (the
    # server's own Python, its clients) holds the whole step — a tail the mean spread does
    # not show. On the shared 2-core CPU, measured / planned over 1,260 planned steps: p99
    # 1.19, p99.5 1.23, max 1.36; in a steady stretch the spread fell to 0.03 and a plan at
    # 85% then took 1.26x (1,072 ms at a 1,000 ms target). At 78%, steps of 1.28x, 1.31x
    # and 1.34x their plan went over in three runs of twelve (a spike on a class whose
    # model is a few percent short); 70% leaves room for 1.43x, for ~5% more steps.
    CPU_HEADROOM = 0.70

    @classmethod
    def headroom(cls, model: StepCostModel) -> float:
        cap = cls.CPU_HEADROOM if model.tile else cls.HEADROOM
        return max(cls.MIN_HEADROOM, min(cap, math.exp(-cls.SPREAD_K * model.spread)))

    def __init__(
        self,
        model: StepCostModel,
        max_stall_s: float | None,
        n_decode: int,
        min_chunk: int,
        burst: bool = False,
        others_waiting: bool = False,
    ) -> None:
        self.model = model
        waiting = n_decode > 0 or others_waiting  # someone's next token waits for this step
        self.bounded = max_stall_s is not None and waiting and not burst
        room = self.headroom(model)
        self.max_stall = max_stall_s or 0.0
        self.target = self.max_stall * room
        # A probe of a class that may only look slow (`_fit`) spends half the room: it is
        # planned 2 spreads under the target instead of 4.
        self.probe_target = self.max_stall * math.sqrt(room)
        self.planned = model.decode_time(n_decode)  # modelled time of the step so far
        self.tokens = n_decode  # tokens in the step so far
        self.min_chunk = min_chunk
        self._granted = False

    def grant(self, n_max: int, depth: int, rest: int | None = None) -> int:
        """Tokens (at most `n_max`) a prompt at KV depth `depth`, with `rest` tokens still
        to prefill, may prefill in this step."""
        if not self.bounded:
            return n_max
        floor = 0 if self._granted else min(self.min_chunk, n_max)
        n = 0
        if self.model.knows_prompts:
            if floor:
                self._over_the_floor(floor, depth)
            n = self._fit(n_max, depth)
        n = max(n, floor)
        if rest is not None:
            n = self._no_short_rest(n, n_max, rest, depth)
        if n:
            self._granted = True
            self.tokens += n
            if self.model.knows_prompts:
                self.planned += self.model.chunk_time(n, depth)
        return n

    def _over_the_floor(self, floor: int, depth: int) -> None:
        """Where the step's floor — its decoders and the minimum chunk, as planned — is
        already over the planned share of the target, plan to the target itself (at most
        FLOOR_SLACK over the floor) instead. The share keeps room for a step landing slow,
        but a step with any prompt in it lands there anyway: with the experts in host RAM
        the step is mostly a fixed cost (the experts' copy to the GPU, from 32 rows on). On
        a slower H200 host (4 decoders alone ~110 ms, with 32 prompt rows ~225) the plan
        at 85% of 250 ms fitted no more than the minimum: the prefill went on in 32-row
        steps, 56-76 of them over the target from the floor's own spread, and its first
        token came 14-15x later than on an idle server. Chunks planned to the target take
        several times the rows for a few percent more step, so the prefill is as many times
        shorter and has as many fewer steps that can land over. Not on the CPU alone
        (`model.tile`): there rows are dear and a step's tail is a 1.3x spike of the whole
        step, which the share is kept for."""
        m = self.model
        if m.tile:
            return
        at_floor = (self.planned + m.chunk_time(floor, depth)) * self._class_bias(
            m.size_class(self.tokens + floor), depth
        )[0]
        if self.target < at_floor <= self.max_stall:
            self.target = min(self.max_stall, at_floor * self.FLOOR_SLACK)
            self.probe_target = max(self.probe_target, self.target)

    def _no_short_rest(self, n: int, n_max: int, rest: int, depth: int) -> int:
        """`n`, unless it leaves the prompt a last chunk under `min_chunk`: then less, so
        that `min_chunk` is left; or, where that is not possible (the rest is under two
        minimum chunks), the whole rest if it fits the target or costs little more than
        `n` (within TAIL_EXTRA). A short last chunk is a step of its own in a size class
        seldom measured, and it can be the dearest: with the experts in host RAM a step
        under 32 rows computes them on the CPU (H200: 4 decoders and an 18-token tail took
        282 ms against 179 planned), while a whole rest of 32-63 tokens costs what 32 do.
        On the CPU, where 64 rows start a dearer kernel, the whole rest is not taken."""
        left = rest - n
        if n == 0 or not 0 < left < self.min_chunk:
            return n
        cut = self._without_short_tail(rest - self.min_chunk)
        if cut >= self.min_chunk:
            return cut
        if rest > n_max:
            return n
        m = self.model

        def planned(k: int) -> float:  # with the bias `_fit` would plan that size with
            t = self.planned + m.chunk_time(k, depth)
            return t * self._class_bias(m.size_class(self.tokens + k), depth)[0]

        whole = planned(rest)
        return rest if whole <= max(self.target, planned(n) * self.TAIL_EXTRA) else n

    def _without_short_tail(self, n: int) -> int:
        """`n`, less the tokens that would end the step in a short physical batch or
        attention tile."""
        for q in (self.model.ubatch, self.model.tile):
            total = self.tokens + n
            if q and total > q and total % q < q // 4:
                n -= min(total % q, n)
        return n

    def _class_bias(self, c: int, depth: int) -> tuple[float, bool]:
        """The bias a chunk that puts the step in size class `c` is planned with, and
        whether the class is stale: one whose modelled step (at its smallest size) grew by
        STALE_RISE since it was last measured, or a CPU tile class re-entered deeper
        (`_tiles_gone_deeper`), is planned as one that ran slow once more (x BIAS_JUMP)."""
        m = self.model
        first, _ = m.class_range(c)
        lo = max(1, first - self.tokens)
        bias = m.bias_of_class(c)
        seen = m.measured_depth(c)
        stale = seen is not None and self.planned + m.chunk_time(lo, depth) > (
            self.STALE_RISE * (self.planned + m.chunk_time(lo, seen))
        )
        stale = stale or self._tiles_gone_deeper(c, first, depth)
        return (bias * m.BIAS_JUMP if stale else bias), stale

    def _tiles_gone_deeper(self, c: int, first: int, depth: int) -> bool:
        """Whether size class `c` (steps of `first` tokens and more) runs attention in CPU
        tiles and is re-entered deeper than it was measured: measured before, but not by
        the last step, and since then the prefill went STALE_DEPTH of its depth and
        STALE_TILES tiles' rows deeper. Such a class is planned as one that ran slow once
        more. On the 2-core CPU the tiled path's cost grows with depth faster than the
        small steps' that the fit follows, and in four runs out of seven the one step over
        a 1,000 ms target was a return to a tiled class after a run of sub-tile chunks:
        a 64-row step measured at 7.0K depth (583 ms) took 1,033 ms at 9.0K, a 2-tile one
        measured at 7.9K took 1,045 ms at 9.0K (planned 690), and 64-row steps took 1,140
        and 1,285 ms at 14.6K and 12.7K. A class in steady use is measured every step and
        keeps its own bias."""
        m = self.model
        if not m.tile or first < m.tile or depth <= 0:
            return False
        ago = m.measured_steps_ago(c)
        if ago is None or ago == 1:
            return False
        seen = m.measured_depth(c) or 0
        return depth - seen > max(self.STALE_DEPTH * depth, self.STALE_TILES * m.tile)

    def _fit(self, n_max: int, depth: int) -> int:
        """The chunk that prefills fastest — most prompt tokens per second of step, as
        modelled and corrected by the bias of the size class it puts the step in — among
        the largest of each class that keep the step within the target. Not simply the
        largest: on the 2-core CPU at 12K depth a step of 63 rows took 530 ms and one of
        64 (ggml's tiled attention) 800, for one token more. A slow class, compared with
        its bias relaxed (`choice_bias`), is probed only for a chunk PROBE_GAIN times the
        best otherwise: each probe of that 64-row class for one token more risked a
        1.5x step (750-1,150 ms at one size and depth). A probe is sized with the class's
        own bias, within the target; or, when no chunk of the class fits that way but its
        bias is within 2 spreads of everyone's (it may be slow only by noise), within
        `probe_target`. Without that, one unlucky step barred a class for good: with the
        experts in host RAM (H200, 16K prompt) a prefill went on in 32-row chunks at
        ~185 ms a step where 250-row ones took ~190, and its first token came 7.9x later
        than when the server was idle. A class whose modelled step has grown by STALE_RISE
        since it was last measured (the prefill went deeper) is planned with its bias x
        BIAS_JUMP: on the CPU, ggml's tiled attention grows dearer with depth than the small
        steps the fit follows, and a 2-tile class measured at 3K depth ran 1.4-2.4x its
        plan when re-entered at 12-14K."""
        m = self.model
        best, best_rate, probe, probe_rate, probe_n = 0, 0.0, 0, 0.0, 0
        c, bottom = m.size_class(self.tokens + n_max), m.size_class(self.tokens + 1)
        while c >= bottom:
            first, last = m.class_range(c)
            lo = max(1, first - self.tokens)
            hi = min(n_max, last - self.tokens)
            bias, stale = self._class_bias(c, depth)
            # a total cut back to a batch or tile boundary is a lower class: left to its turn
            n = self._without_short_tail(m.tokens_within(self.target / bias - self.planned,
                                                         depth, hi))  # fmt: skip
            b = bias if stale else m.choice_bias(c)
            if n < lo and b < bias <= m.bias * math.exp(self.NOISE_SPREADS * m.spread):
                n = self._without_short_tail(
                    m.tokens_within(self.probe_target / bias - self.planned, depth, hi)
                )
            if n >= lo:
                if b < bias:  # compared as it may be, sized as it is
                    n_may = max(n, m.tokens_within(self.target / b - self.planned, depth, hi))
                    rate = n_may / max(b * (self.planned + m.chunk_time(n_may, depth)), 1e-12)
                    if rate > probe_rate:
                        probe, probe_rate, probe_n = n, rate, n_may
                else:
                    rate = n / max(bias * (self.planned + m.chunk_time(n, depth)), 1e-12)
                    if rate > best_rate:
                        best, best_rate = n, rate
            c = m.lower_class(c)
        if probe_rate > best_rate and probe_n >= self.PROBE_GAIN * best:
            return probe
        return best
