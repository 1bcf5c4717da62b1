"""The verification forward's cost model (``engine/forward_cost.py``), fitted from the steps it
observes: fixed + per row + per token of a row, priors where the steps cannot tell them apart,
solved once a step, exactly even on a steady batch's near-singular sums. What the planner does
with it: ``test_draft_planner``."""

import pytest
from fitted_cost import fitted

from edgespec.engine.draft_planner import ForwardCost


def test_cost_fit_recovers_a_linear_cost():
    fixed, per_token = fitted(0.040, 0.002).fit()
    assert fixed == pytest.approx(0.040, rel=0.05)
    assert per_token == pytest.approx(0.002, rel=0.1)


def test_cost_fit_uses_the_prior_slope_until_token_counts_vary():
    cost = ForwardCost(prior_share=0.05)
    assert cost.fit() is None and cost.model() is None
    for _ in range(10):
        cost.observe(1, 1, 0.040)
    fixed, per_token = cost.fit()
    assert per_token == pytest.approx(0.05 * 0.040, rel=0.01)
    assert fixed + per_token == pytest.approx(0.040, rel=0.01)


def test_the_cost_model_tells_a_row_from_a_token_of_a_row():
    """This CPU: a row ~17 ms, a token of a row ~1 ms, over a 30 ms fixed part."""
    model = fitted(0.030, 0.001, per_row=0.017).model()
    assert model.fixed == pytest.approx(0.030, rel=0.1)
    assert model.per_row == pytest.approx(0.017, rel=0.1)  # the priors' pull: a few percent
    assert model.per_token == pytest.approx(0.001, rel=0.1)
    assert model.seconds(4, 3) == pytest.approx(0.030 + 4 * 0.017 + 12 * 0.001, rel=0.02)


def test_the_cost_model_tells_a_row_from_a_token_at_128_sessions():
    """A GPU-like step (4 ms, 0.1 ms a row, 0.02 ms a token) at 120-128 sessions of 9 and 16
    tokens: its least squares, wide in their numbers, are solved, not left to the priors."""
    shapes = tuple((rows, width) for rows in (120, 124, 128) for width in (9, 16))
    model = fitted(0.004, 2e-5, per_row=1e-4, shapes=shapes).model()
    assert model.per_token == pytest.approx(2e-5, rel=0.05)
    assert model.seconds(128, 9) == pytest.approx(0.004 + 128 * 1e-4 + 128 * 9 * 2e-5,
                                                  rel=0.05)


def test_rows_that_only_varied_together_with_tokens_split_their_slope_by_the_priors():
    """Steps of one-token rows only cannot tell a row from a token: the model keeps their sum
    and splits it about as its priors do (a row dearer than a token), until probes tell."""
    cost = ForwardCost(row_share=0.1, token_share=0.02)
    for _ in range(30):
        for rows in (1, 2, 3, 4):
            cost.observe(rows, 1, 0.030 + 0.018 * rows)
    model = cost.model()
    assert model.per_row + model.per_token == pytest.approx(0.018, rel=0.1)
    assert model.per_row > model.per_token > 0
    for _ in range(30):  # probes: rows 3 tokens wide, as dear as one-token rows
        cost.observe(4, 3, 0.030 + 0.018 * 4)
        for rows in (1, 4):
            cost.observe(rows, 1, 0.030 + 0.018 * rows)
    model = cost.model()
    assert model.per_row == pytest.approx(0.018, rel=0.1) and model.per_token < 0.001


def test_the_cost_model_is_solved_once_a_step_and_again_after_each():
    cost = fitted(0.040, 0.002)
    first = cost.model()
    assert cost.model() is first  # the planner asks it several times a step
    cost.observe(8, 9, 1.0)  # a slow wide step: the fit moves
    assert cost.model() != first and cost.model().per_token > first.per_token


def _exact_solution(a, b):
    """a x = b in exact rational arithmetic (Gaussian elimination over Fractions)."""
    from fractions import Fraction

    m = [[Fraction(v) for v in row] + [Fraction(r)] for row, r in zip(a, b)]
    for c in range(3):
        p = max(range(c, 3), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, 3):
            f = m[r][c] / m[c][c]
            m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    x = [Fraction(0)] * 3
    for r in (2, 1, 0):
        x[r] = (m[r][3] - sum(m[r][k] * x[k] for k in range(r + 1, 3))) / m[r][r]
    return x


@pytest.mark.parametrize("rows,width", [(1, 1), (8, 5), (64, 9), (256, 64), (1024, 64)])
def test_the_cost_models_solve_is_exact_on_a_steady_batchs_near_singular_sums(rows, width):
    """A server whose every step runs the same batch gives the fit nearly singular sums (only
    the prior's ridge tells a row from a token): the 3 x 3 solve still agrees with exact
    arithmetic to 1e-7 (Cramer's rule was off by a third at 256 x 64)."""
    from edgespec.engine.forward_cost import _solve3

    cost = ForwardCost()
    for _ in range(500):
        cost.observe(rows, width, 0.001 * (1 + 0.01 * rows + 0.001 * rows * width))
    w, (xx0, xx1, xx2), xy = cost.prior_weight, cost._xx, cost._xy
    my = xy[0] / cost.n
    lhs = [xx0, [xx1[0], xx1[1] + w, xx1[2]], [xx2[0], xx2[1], xx2[2] + w]]
    rhs = [xy[0], xy[1] + w * cost.row_share * my, xy[2] + w * cost.token_share * my]
    got, exact = _solve3(lhs, rhs), _exact_solution(lhs, rhs)
    assert got is not None
    for g, e in zip(got, exact):
        assert abs(g - float(e)) <= 1e-7 * abs(float(e))
    assert _solve3([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [3.0, 6.0, 9.0]], [1.0, 2.0, 3.0]) is None
