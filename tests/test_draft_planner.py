"""The draft planner: forward cost fitted from steps, draft tokens handed out where they pay."""

import pytest

from edgespec.engine.draft_planner import ForwardCost, allocate, allocate_branches


def fitted(fixed: float, per_token: float, counts=(1, 2, 5, 9, 3, 6)) -> ForwardCost:
    cost = ForwardCost()
    for _ in range(20):
        for t in counts:
            cost.observe(t, fixed + per_token * t)
    return cost


def test_cost_fit_recovers_a_linear_cost():
    fixed, per_token = fitted(0.040, 0.002).fit()
    assert fixed == pytest.approx(0.040, rel=0.05)
    assert per_token == pytest.approx(0.002, rel=0.1)


def test_cost_fit_uses_the_prior_slope_until_token_counts_vary():
    cost = ForwardCost(prior_share=0.05)
    assert cost.fit() is None
    for _ in range(10):
        cost.observe(1, 0.040)
    fixed, per_token = cost.fit()
    assert per_token == pytest.approx(0.05 * 0.040, rel=0.01)
    assert fixed + per_token == pytest.approx(0.040, rel=0.01)


def test_allocate_before_any_step_keeps_the_caps():
    assert allocate([0.1, 0.9], [4, 6], ForwardCost()) == [4, 6]


def test_allocate_drafts_nothing_where_acceptance_is_below_the_cost():
    cost = fitted(0.040, 0.004)  # a draft token costs 10% of a step
    assert allocate([0.05], [8], cost) == [0]
    ks = allocate([0.05, 0.9], [8, 8], cost)
    assert ks[0] == 0 and ks[1] > 0


def test_allocate_drafts_longer_where_acceptance_is_higher():
    cost = fitted(0.040, 0.002)
    low, high = allocate([0.3, 0.9], [8, 8], cost)
    assert 0 < low < high <= 8


def test_allocate_drafts_less_per_session_when_tokens_are_dear():
    cheap = allocate([0.7] * 4, [8] * 4, fitted(0.040, 0.0005))
    dear = allocate([0.7] * 4, [8] * 4, fitted(0.040, 0.008))
    assert sum(dear) < sum(cheap)


def test_each_allocated_token_raises_the_expected_rate():
    cost = fitted(0.040, 0.003)
    alphas, caps = [0.6, 0.35, 0.8], [8, 8, 8]
    fixed, per_token = cost.fit()

    def rate(ks):
        gain = sum(1 + sum(a ** m for m in range(1, k + 1)) for a, k in zip(alphas, ks))
        return gain / (fixed + per_token * (len(ks) + sum(ks)))

    best = allocate(alphas, caps, cost)
    for i in range(3):  # one token more or less for any session does not do better
        for d in (-1, 1):
            other = list(best)
            other[i] += d
            if 0 <= other[i] <= caps[i]:
                assert rate(other) <= rate(best) + 1e-12


# -- token trees: branch tokens where they pay ----------------------------------------------------
def test_branches_before_any_step_keep_the_caps():
    assert allocate_branches([0.01], [8], [0.5], [4], ForwardCost()) == [8]


def test_branches_are_left_out_where_they_rarely_pay_and_kept_where_tokens_are_cheap():
    alphas, ks = [0.5, 0.5], [4, 4]
    dear = fitted(0.040, 0.004)  # a CPU: a token costs 10% of a step
    assert allocate_branches([0.1, 0.1], [8, 8], alphas, ks, dear) == [0, 0]
    assert allocate_branches([0.1, 0.6], [8, 8], alphas, ks, dear) == [0, 8]
    cheap = fitted(0.040, 0.00005)  # a GPU-like forward: width is almost free
    assert allocate_branches([0.1, 0.1], [8, 8], alphas, ks, cheap) == [8, 8]


def test_each_allocated_branch_token_raises_the_expected_rate():
    cost = fitted(0.040, 0.002)
    fixed, per_token = cost.fit()
    alphas, ks, betas, caps = [0.6, 0.4], [3, 2], [0.08, 0.2], [8, 8]

    def rate(sides):
        gain = sum(1 + sum(a ** m for m in range(1, k + 1)) for a, k in zip(alphas, ks))
        gain += sum(b * s for b, s in zip(betas, sides))
        return gain / (fixed + per_token * (len(ks) + sum(ks) + sum(sides)))

    sides = allocate_branches(betas, caps, alphas, ks, cost)
    for i in range(2):
        for delta in (-1, 1):
            other = list(sides)
            other[i] += delta
            if 0 <= other[i] <= caps[i]:
                assert rate(other) <= rate(sides) + 1e-12


def test_a_session_without_branches_is_probed_now_and_then():
    from edgespec.drafters.adaptive import DraftLength

    dl = DraftLength(8)
    assert dl.beta == pytest.approx(0.1)
    planned = [dl.probe_branches(0, 6) for _ in range(16)]
    assert planned.count(2) == 2 and planned.count(0) == 14  # a short probe every 8th step
    for i in range(7):  # steps with no room for branches (no chain) do not reset the count
        assert dl.probe_branches(0, 6) == 0
        assert dl.probe_branches(0, 0) == 0
    assert dl.probe_branches(0, 6) == 2
    dl.update_branches(8, 0)
    low = dl.beta
    dl.update_branches(4, 4)
    assert 0 < low < dl.beta
