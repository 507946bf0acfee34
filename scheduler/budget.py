"""How many prompt tokens fit in a step without stalling the decoding users too long.

A step's time is modelled as

    t(D, P, d) = t_dec(D) + P * (c0 + c1 * (d + P / 2))

for D decode tokens and a P-token prompt chunk whose KV depth starts at d: attention makes
each prompt token cost more the more context it attends to, so the per-token cost grows
linearly with the chunk's mean depth. `t_dec` (a + b * D) is fitted on decode-only steps,
(c0, c1) on steps that carried a prompt chunk — both by exponentially weighted least
squares, so the model follows the machine as it warms up or gets busy. Until a term has
data, the chunk falls back to the minimum (measured, then grown) rather than a guess.

The fit lags a prefill that goes ever deeper: its points come from shallower chunks than
the one being planned (on the 2-core CPU at 8K depth, steps planned at 850 ms took 1,050–
1,100 ms). So the model also keeps `bias`, a fast moving average of measured / modelled
time over the steps it planned (those with both decode tokens and prompt chunks), and the
budget plans against the target divided by it: a model that runs behind is corrected
within a few steps, whatever the cause.
"""

from __future__ import annotations

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

    def fit(self) -> tuple[float, float]:
        """(k0, k1); a flat line through the mean while x has not varied enough."""
        mx, my = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mx * mx
        if var <= 1e-9 * max(1.0, mx * mx):
            return my, 0.0
        k1 = max(0.0, (self.sxy / self.n - mx * my) / var)
        return max(0.0, my - k1 * mx), k1


class StepCostModel:
    """The learned step-time model."""

    BIAS_GAIN = 0.3  # weight of the newest step in `bias`
    BIAS_RELAX = 0.05  # per decode-only step, `bias` moves this share back toward 1
    BIAS_RANGE = (0.5, 4.0)

    def __init__(self) -> None:
        self._dec = _Line()  # x = decode tokens, y = seconds
        self._tok = _Line()  # x = mean KV depth of the chunk, y = seconds per prompt token
        self.max_seen_chunk = 0
        self.bias = 1.0  # measured / modelled time of recent planned steps

    @property
    def knows_prompts(self) -> bool:
        return self._tok.ready

    def decode_time(self, n_decode: int) -> float:
        if not self._dec.ready:
            return 0.0
        a, b = self._dec.fit()
        return a + b * n_decode

    def step_time(self, n_decode: int, chunks: list[tuple[int, int]]) -> float:
        """Modelled seconds for a step of `n_decode` decode tokens and prompt `chunks` as
        (tokens, start depth); the decode part only while no prompt has been measured."""
        t = self.decode_time(n_decode)
        if self._tok.ready:
            t += sum(self.chunk_time(n, d) for n, d in chunks)
        return t

    def chunk_time(self, n: int, depth: int) -> float:
        """Modelled seconds for an n-token prompt chunk starting at KV depth `depth`."""
        c0, c1 = self._tok.fit()
        return n * (c0 + c1 * (depth + n / 2))

    def tokens_within(self, room_s: float, depth: int, cap: int) -> int:
        """Largest chunk from `depth` whose modelled time fits in `room_s` (at most `cap`,
        and at most twice the largest chunk measured: beyond that the model extrapolates)."""
        if room_s <= 0:
            return 0
        c0, c1 = self._tok.fit()
        lin = c0 + c1 * depth  # c1/2 * n^2 + lin * n <= room
        if c1 > 0:
            n = (-lin + math.sqrt(lin * lin + 2 * c1 * room_s)) / c1
        else:
            n = room_s / lin if lin > 0 else float(cap)
        return max(0, min(cap, 2 * max(self.max_seen_chunk, 1), int(n)))

    def observe(self, n_decode: int, chunks: list[tuple[int, int]], seconds: float) -> None:
        """One step: its decode tokens, its prompt chunks as (tokens, start depth), its time."""
        n_prompt = sum(n for n, _ in chunks)
        if n_prompt == 0:
            if n_decode:
                self._dec.add(n_decode, seconds)
                # Between prefills the bias relaxes: a transient (another process for a
                # while) must not shrink the next prompt's chunks for good.
                self.bias += self.BIAS_RELAX * (1.0 - self.bias)
            return
        if n_decode and self._dec.ready and self._tok.ready:  # a step the budget planned
            modelled = self.step_time(n_decode, chunks)
            if modelled > 0:
                lo, hi = self.BIAS_RANGE
                ratio = min(hi, max(lo, seconds / modelled))
                self.bias += self.BIAS_GAIN * (ratio - self.bias)
        rest = max(seconds - self.decode_time(n_decode), 0.0)
        depth = sum(n * (d + n / 2) for n, d in chunks) / n_prompt
        self._tok.add(depth, rest / n_prompt)
        self.max_seen_chunk = max(self.max_seen_chunk, n_prompt)

    def estimate(self) -> dict[str, float]:
        """The model's current figures (for /metrics)."""
        out: dict[str, float] = {}
        if self._dec.ready:
            out["decode_base_s"], out["decode_per_token_s"] = self._dec.fit()
        if self._tok.ready:
            out["prompt_token_s"], out["prompt_token_per_kv_cell_s"] = self._tok.fit()
        return out


class StepTimeBudget:
    """The time left for prompt chunks in the step being planned.

    Unbounded when no decoder is protected (prompts then use full batches) or no target is
    set. `protected` (default: all `n_decode`) counts the decoders whose pauses the target
    bounds; the scheduler leaves out those with one token so far, admitted with the
    prompts now waiting (see `Scheduler.schedule`), so each request may see one long gap,
    between its first and second token, and none after.
    The first chunk granted gets at least `min_chunk` tokens, so prefill always progresses
    — also before the model has seen any prompt (it measures that chunk, then grows).
    Chunks are sized to 85% of the target divided by the model's `bias`: the step's own
    Python and jitter come on top of the engine time the model predicts.
    """

    HEADROOM = 0.85

    def __init__(
        self,
        model: StepCostModel,
        max_stall_s: float | None,
        n_decode: int,
        min_chunk: int,
        protected: int | None = None,
    ) -> None:
        self.model = model
        self.bounded = (
            max_stall_s is not None and (n_decode if protected is None else protected) > 0
        )
        target = (max_stall_s or 0.0) * self.HEADROOM / model.bias
        self.left = target - model.decode_time(n_decode)
        self.min_chunk = min_chunk
        self._granted = False

    def grant(self, n_max: int, depth: int) -> int:
        """Tokens (at most `n_max`) a prompt at KV depth `depth` may prefill in this step."""
        if not self.bounded:
            return n_max
        floor = 0 if self._granted else min(self.min_chunk, n_max)
        n = self.model.tokens_within(self.left, depth, n_max) if self.model.knows_prompts else 0
        n = max(n, floor)
        if n:
            self._granted = True
            if self.model.knows_prompts:
                self.left -= self.model.chunk_time(n, depth)
        return n
