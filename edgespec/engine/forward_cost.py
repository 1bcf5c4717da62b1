"""What a verification forward costs, fitted on the steps the engine ran.

A forward runs B rows padded to the widest, W tokens a row. Its seconds are modelled two ways:

- ``ForwardCost.fit``: ``fixed + per_token * B * W``, one slope over the token-rows (what the
  pace's batch scaling and ``--auto``'s stack choice read);
- ``ForwardCost.model`` (``CostModel``): ``fixed + per_row * B + per_token * B * W``, what the
  draft planner reads. A row and a token of a row differ: measured here (a 2-core AMD EPYC, the
  default model in bfloat16 on one thread, batch-invariant kernels) a row added ~17 ms to a 48 ms
  one-row step, while a one-row step with 3-8 draft tokens cost what a one-token row did. One
  slope over token-rows made a draft token look as dear as a row: drafting stopped at 4 rows
  where it paid.

Both are least squares over recent steps (older steps decay by ``decay`` a step), pulled towards
prior slopes (shares of the mean step) until the steps vary enough to tell them apart: a batch
that has only run one-token rows cannot tell a row from a token, and its probes (steps with a
short draft for every row) do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import overload

import numpy as np


@dataclass(frozen=True)
class CostModel:
    """seconds = fixed + per_row * rows + per_token * rows * width."""

    fixed: float
    per_row: float
    per_token: float

    @overload
    def seconds(self, rows: float, width: float) -> float: ...

    @overload
    def seconds(self, rows: float, width: np.ndarray) -> np.ndarray: ...

    def seconds(self, rows, width):
        """The forward's seconds at ``width`` tokens a row (a float, or an array of widths)."""
        return self.fixed + rows * (self.per_row + self.per_token * width)


class ForwardCost:
    """The verification forward's cost, fitted on the steps the engine ran (module docstring).
    ``prior_share``: the one-slope fit's prior, a share of a step's mean time per token-row;
    ``row_share``, ``token_share``: the two-slope model's priors."""

    def __init__(self, prior_share: float = 0.05, decay: float = 0.98, prior_weight: float = 4.0,
                 row_share: float = 0.1, token_share: float = 0.02):
        self.prior_share, self.decay, self.prior_weight = prior_share, decay, prior_weight
        self.row_share, self.token_share = row_share, token_share
        # decayed sums of x x^T and x * seconds, x = (1, rows, rows * width): both fits' data,
        # in Python floats (a handful of numbers a step: NumPy's calls cost more than the sums)
        self._xx = [[0.0] * 3 for _ in range(3)]
        self._xy = [0.0] * 3
        self._model: CostModel | None = None  # model()'s answer until the next step is seen

    @property
    def n(self) -> float:
        """The steps seen, decayed."""
        return self._xx[0][0]

    def observe(self, rows: int, width: int, seconds: float) -> None:
        """One forward of ``rows`` rows ``width`` tokens wide took ``seconds``."""
        tokens = rows * width
        if seconds <= 0 or tokens <= 0:
            return
        d = self.decay
        x = (1.0, float(rows), float(tokens))
        self._xx = [[d * v + xi * xj for v, xj in zip(row, x)] for row, xi in zip(self._xx, x)]
        self._xy = [d * v + xi * seconds for v, xi in zip(self._xy, x)]
        self._model = None

    def fit(self) -> tuple[float, float] | None:
        """(fixed, per_token) seconds over token-rows, or None before the first step."""
        n = self.n
        if n <= 0:
            return None
        mx, my = self._xx[0][2] / n, self._xy[0] / n
        var = self._xx[2][2] / n - mx * mx
        cov = self._xy[2] / n - mx * my
        prior = self.prior_share * my
        # the prior slope weighs as much as prior_weight steps spread by one token
        w = self.prior_weight / n
        slope = (cov + w * prior) / (var + w)
        # one preempted wide step must not stop drafting for a while: stay within 1/50..8x the
        # prior slope (a GPU's token a row costs ~1/100 of a step, this CPU's a third)
        slope = min(8 * prior, max(prior / 50, slope))
        fixed = max(1e-6, my - slope * mx)
        return float(fixed), float(slope)

    def model(self) -> CostModel | None:
        """The two-slope model (a row, a token of a row), or None before the first step: ridge
        least squares, the slopes pulled towards their priors with ``prior_weight`` steps'
        weight (so rows and tokens that have only varied together split their slope about as
        the priors do), each kept within 1/50..20x its prior. Solved once a step (kept until the
        next ``observe``)."""
        if self.n <= 0:
            return None
        if self._model is None:
            self._model = self._solve()
        return self._model

    def _solve(self) -> CostModel:
        my = self._xy[0] / self.n
        priors = (0.0, self.row_share * my, self.token_share * my)
        # each prior slope weighs as much as prior_weight steps one row (one token) apart:
        # a ridge of prior_weight on the two slopes' diagonal entries
        w, (xx0, xx1, xx2), xy = self.prior_weight, self._xx, self._xy
        lhs = [xx0, [xx1[0], xx1[1] + w, xx1[2]], [xx2[0], xx2[1], xx2[2] + w]]
        rhs = [xy[0], xy[1] + w * priors[1], xy[2] + w * priors[2]]
        solved = _solve3(lhs, rhs)
        per_row, per_token = (priors[1], priors[2]) if solved is None else solved[1:]
        per_row = float(min(20 * priors[1], max(priors[1] / 50, per_row)))
        per_token = float(min(20 * priors[2], max(priors[2] / 50, per_token)))
        fixed = (self._xy[0] - per_row * self._xx[0][1] - per_token * self._xx[0][2]) / self.n
        return CostModel(max(1e-6, float(fixed)), per_row, per_token)


def _solve3(a: list[list[float]], b: list[float]) -> tuple[float, float, float] | None:
    """x with a x = b for a symmetric positive definite 3 x 3 system (a ridge's normal
    equations), by an unrolled LDL^T factorisation in floats: no pivoting needed, as accurate as
    elimination with pivoting where Cramer's rule lost most digits on a steady wide batch's
    nearly singular sums, ~1 us where numpy.linalg.solve cost ~30 and a Python elimination
    ~15 (the planner solves once a step); None where a pivot is 0 (a not positive definite) or
    the result is not finite."""
    (a00, a01, a02), (a10, a11, a12), (a20, a21, a22) = a
    b0, b1, b2 = b
    if a00 == 0.0:
        return None
    l10, l20 = a10 / a00, a20 / a00
    d1, c12 = a11 - l10 * a01, a12 - l10 * a02
    if d1 == 0.0:
        return None
    l21 = (a21 - l20 * a01) / d1
    d2 = a22 - l20 * a02 - l21 * c12
    if d2 == 0.0:
        return None
    y1 = b1 - l10 * b0
    y2 = b2 - l20 * b0 - l21 * y1
    x2 = y2 / d2
    x1 = (y1 - c12 * x2) / d1
    x = ((b0 - a01 * x1 - a02 * x2) / a00, x1, x2)
    if not all(math.isfinite(v) for v in x):
        return None
    return x
