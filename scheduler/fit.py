"""Exponentially weighted least squares with non-negative coefficients: the step-cost fit.

Step costs are sums of non-negative parts (a fixed cost, a cost per token, per KV cell
attended), so a negative coefficient is never a cost, only noise fitted; and a machine
warms up, gets busy, goes deeper into a prompt, so old steps must fade.
"""

from __future__ import annotations

import itertools
import math


class NonNegativeFit:
    """y = sum(k_i * x_i), every k_i >= 0, old points weighted down by `decay` per point.

    With a handful of terms the exact solution is cheap: solve the normal equations on
    every subset of terms and keep the best whose terms are all >= 0. A fit with more terms
    must cut the residual by MORE_TERMS (a parsimony rule, as an information criterion
    would): with chunks of one size the prompt terms are collinear, and a fit that splits
    noise between them predicts other sizes badly. Where the data cannot tell two
    explanations apart, `first` names the terms to believe (see StepCostModel)."""

    RIDGE = 1e-9  # relative, keeps near-collinear terms (similar chunks) solvable
    MORE_TERMS = 0.9  # a fit with more terms must have under 90% of the residual

    def __init__(self, k: int, decay: float = 0.98, first: tuple[int, ...] = ()) -> None:
        self.k = k
        # a fit without any of the terms in `first` counts one term more (see _solve)
        self._first = set(first)
        self.decay = decay
        self.n = 0.0  # weighted points
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

    def predict(self, x: tuple[float, ...]) -> float:
        return sum(c * v for c, v in zip(self.fit(), x, strict=True)) if self.ready else 0.0

    def _solve(self) -> list[float]:
        """The subset of terms with the least residual / MORE_TERMS^complexity; a subset's
        complexity is its size, one more where it leaves out every term of `first`."""
        best: tuple[float, list[float]] | None = None
        for size in range(1, self.k + 1):
            for subset in itertools.combinations(range(self.k), size):
                ks = _solve_normal(self.xx, self.xy, subset, self.RIDGE)
                if ks is None or min(ks) < 0 or not all(map(math.isfinite, ks)):
                    continue
                coefs = [0.0] * self.k
                for i, v in zip(subset, ks, strict=True):
                    coefs[i] = v
                cx = size + (1 if self._first and not set(subset) & self._first else 0)
                score = max(self._residual(coefs), 0.0) / self.MORE_TERMS**cx
                if best is None or score < best[0] * (1 - 1e-9):
                    best = (score, coefs)
        return best[1] if best else [0.0] * self.k

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
