"""The draft planner: draft tokens and branch tokens handed out where they pay, and what a step
asks of the store (the forward cost it weighs them against: ``test_forward_cost``)."""

from contextlib import contextmanager

import pytest
from fitted_cost import fitted

from edgespec.engine.draft_planner import (ForwardCost, allocate, allocate_branches,
                                           expected_rate, wait_worth)


def geometric(alpha: float, cap: int) -> list[float]:
    return [alpha ** m for m in range(1, cap + 1)]


def padded_rate(model, gains, ks, branches=None, betas=None):
    """The step's expected tokens a second as the planner models it: rows padded to the
    widest."""
    gain = len(ks) + sum(sum(g[:k]) for g, k in zip(gains, ks))
    widths = list(ks)
    if branches is not None:
        gain += sum(b * n for b, n in zip(betas, branches))
        widths = [k + n for k, n in zip(ks, branches)]
    return gain / model.seconds(len(ks), 1 + max(widths))


def test_allocate_before_any_step_keeps_the_caps():
    assert allocate([geometric(0.1, 4), geometric(0.9, 6)], ForwardCost()) == [4, 6]


def test_allocate_drafts_nothing_where_acceptance_is_below_the_cost():
    cost = fitted(0.040, 0.004)  # a draft token costs 10% of a step
    assert allocate([geometric(0.05, 8)], cost) == [0]
    assert allocate([geometric(0.05, 8)] * 4, cost) == [0] * 4


def test_one_good_session_drafts_for_all_but_not_in_a_batch_too_wide_to_pay():
    """Every row is padded to the widest: a draft widens the batch. Every session then drafts
    to that width (free); a batch of many weak sessions stops one strong one drafting."""
    cost = fitted(0.040, 0.002)
    ks = allocate([geometric(0.05, 8), geometric(0.95, 8)], cost)
    assert ks[0] == ks[1] > 0
    assert allocate([geometric(0.05, 8)] * 15 + [geometric(0.95, 8)], cost) == [0] * 16


def test_allocate_keeps_each_sessions_cap():
    cost = fitted(0.040, 0.0005)
    assert allocate([geometric(0.9, 2), geometric(0.9, 6)], cost) == [2, 6]


def test_allocate_drafts_less_when_tokens_are_dear():
    cheap = allocate([geometric(0.7, 8)] * 4, fitted(0.040, 0.0005))
    dear = allocate([geometric(0.7, 8)] * 4, fitted(0.040, 0.004))
    assert sum(dear) < sum(cheap)


def test_a_drafter_right_in_runs_drafts_longer_than_a_geometric_one_of_its_first_token():
    """A first token right 1 time in 3 and the rest right when it is (MaG's runs), against a
    geometric drafter right 1 time in 3 at each token."""
    cost = fitted(0.040, 0.002)
    runs = allocate([[0.33] * 8], cost)[0]
    geom = allocate([geometric(0.33, 8)], cost)[0]
    assert runs > geom


def test_the_allocated_width_is_the_best_of_all_widths():
    cost = fitted(0.040, 0.003)
    fit = cost.model()
    gains = [geometric(0.6, 8), geometric(0.35, 8), [0.7] * 3 + [0.1] * 5]
    best = allocate(gains, cost)
    for d in range(9):
        other = [min(8, d)] * 3
        assert padded_rate(fit, gains, other) <= padded_rate(fit, gains, best) + 1e-12


def test_the_step_waits_for_a_draft_as_long_as_it_is_worth():
    cost = fitted(0.040, 0.002)
    gains, ks = [geometric(0.9, 4), geometric(0.02, 4), geometric(0.9, 4)], [4, 4, 0]
    rate = expected_rate(gains, ks, cost)
    assert rate == pytest.approx(padded_rate(cost.model(), gains, ks))
    # a wait costs the batch rate tokens a second: 3.1 expected tokens are worth 3.1 / rate s
    waits = wait_worth(gains, ks, cost, 10.0)
    assert waits == pytest.approx([sum(gains[0]) / rate, sum(gains[1]) / rate, 0.0])
    assert waits[1] < 0.001 < waits[0]
    assert wait_worth(gains, ks, cost, 0.010) == [0.010, pytest.approx(waits[1]), 0.0]
    assert wait_worth(gains, ks, ForwardCost(), 0.010) == [0.010, 0.010, 0.0]  # no step yet


# -- token trees: branch tokens where they pay ----------------------------------------------------


def test_branches_before_any_step_keep_the_caps():
    assert allocate_branches([0.01], [8], [geometric(0.5, 4)], [4], ForwardCost()) == [8]


def test_branches_are_left_out_where_they_rarely_pay_and_kept_where_tokens_are_cheap():
    gains, ks = [geometric(0.5, 4)] * 2, [4, 4]
    dear = fitted(0.040, 0.004)  # a CPU: a token costs 10% of a step
    assert allocate_branches([0.1, 0.1], [8, 8], gains, ks, dear) == [0, 0]
    cheap = fitted(0.040, 0.00005)  # a GPU-like forward: width is almost free
    assert allocate_branches([0.1, 0.1], [8, 8], gains, ks, cheap) == [8, 8]


def test_branches_fill_the_width_the_chains_already_pay_for():
    dear = fitted(0.040, 0.004)
    gains, ks = [geometric(0.9, 6), geometric(0.5, 2)], [6, 2]
    assert allocate_branches([0.05, 0.05], [8, 8], gains, ks, dear) == [0, 4]
    assert allocate_branches([0.0, 0.0], [8, 8], gains, ks, dear) == [0, 0]  # never accepted


def test_the_allocated_branch_width_is_the_best_of_all_widths():
    cost = fitted(0.040, 0.002)
    fit = cost.model()
    gains, ks, betas, caps = [geometric(0.6, 3), geometric(0.4, 2)], [3, 2], [0.3, 0.2], [8, 8]
    sides = allocate_branches(betas, caps, gains, ks, cost)
    for width in range(3, 12):
        other = [min(c, width - k) for c, k in zip(caps, ks)]
        assert padded_rate(fit, gains, ks, other, betas) <= \
            padded_rate(fit, gains, ks, sides, betas) + 1e-12


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


# -- in the engine: what a step asks of the store -------------------------------------------------


@contextmanager
def _never_right_pair(tiny, new_tokens: int = 20, board: str | None = None,
                      inline: bool = True):
    """An engine drafting with MaG in process (``inline``: in the step's thread, else in a
    drafting thread; ``board``: for a board of that name, through a store, no drafting here)
    for two sessions whose drafts were rejected 20 times, on a CPU's fitted cost (a draft token
    a row costs 10% of a step): (engine, sessions)."""
    from edgespec.config import EngineConfig
    from edgespec.drafters import build_drafter
    from edgespec.engine.spec_engine import Request, SpecEngine
    from edgespec.protocol.local_store import LocalSessionStore
    from edgespec.runner.target_runner import TargetRunner

    runner = TargetRunner(tiny.model, n_slots=4, max_len=256)
    where = {"store": LocalSessionStore(None, runner.vocab_size)} if board else \
        {"drafter": build_drafter("mag")}
    # the planner and its probes alone: resting on measured steps (drafting_worth) is a layer
    # above them, tested in test_drafting_worth
    with SpecEngine(runner, config=EngineConfig(max_draft=4, draft_inline=inline,
                                                rest_drafters=False),
                    stop_ids=set(), **where) as engine:
        acts = [engine.add(Request([1, 5, 6, 7], new_tokens), device=board),
                engine.add(Request([1, 8, 9], new_tokens), device=board)]
        engine.cost = fitted(0.040, 0.004)
        for act in acts:
            for _ in range(20):
                act.draft_len.update(4, 0)  # never right
        yield engine, acts


def _plan_until_a_probe(engine, acts) -> tuple[list[list[int]], list[list[int]]]:
    """Plan steps (at most 40) up to the first that asks for drafts: what each step told the
    sessions' drafters, and what it asked of them."""
    told, ks = [], []
    while len(ks) < 40 and (not ks or max(ks[-1]) == 0):
        ks.append([w.k for w in engine._plan()])
        told.append([a.wanted for a in acts])
    return told, ks


def test_the_engine_asks_for_no_draft_where_drafts_do_not_pay_and_probes_all_rows_at_once(tiny):
    # a drafting thread: its drafts are waited for as long as they are worth (drafted in the
    # step's thread, every draft is ready when taken and no wait is weighed)
    with _never_right_pair(tiny, inline=False) as (engine, acts):
        from edgespec.engine.draft_planner import probe_every

        every = probe_every(engine.cost, 2, 2)
        assert every > 8  # a probe costs 8 token-rows' 4 ms a 48 ms step: within 2%, rarely
        plans, told = [], []
        for _ in range(every):
            plans.append(engine._plan())
            told.append([act.wanted for act in acts])
        for wants in plans[:-1]:
            assert [(w.k, w.wait) for w in wants] == [(0, False), (0, False)]
        assert [(w.k, w.wait, w.wait_s) for w in plans[-1]] == \
            [(1, True, engine.wait_ms / 1000)] * 2  # a probe: every row, waited for
        # the drafters rest between probes (told 0: nothing drafted ahead), and the step
        # before a probe tells the drafting thread here to draft for it (1 asked: a lead of 4;
        # boards are told two steps before: test_boards_are_told_of_a_probe_two_steps_ahead)
        assert told == [[0, 0]] * (every - 2) + [[1, 1]] * 2
        for _ in range(20):
            acts[0].draft_len.update(4, 4)  # one session's drafts now always right
        wants = engine._plan()
        # the width one session pays for; the other fills it to its own cap (1 after its misses)
        assert (wants[0].k, wants[1].k) == (4, 1)
        engine.step()  # each verdict tells the drafter what its step asked (its lead follows)
        for act in acts:
            assert act.wanted is not None and engine.store.sessions[act.sid].wanted == act.wanted
        assert wants[0].wait and 0 < wants[1].wait_s < wants[0].wait_s <= engine.wait_ms / 1000


def test_told_wants_gives_boards_two_steps_notice_of_a_probe():
    from edgespec.drafters.adaptive import Prober
    from edgespec.engine.step_planning import told_wants

    told = {1: [], 2: []}
    for notice, seen in told.items():
        prober = Prober(6)
        for _ in range(7):
            ks = [prober.planned(0, 2)] * 3
            seen.append(told_wants(ks, prober, True, notice)[0])
        assert told_wants([0, 0], prober, False, notice) == [1, 1]  # not adaptive: never rests
    # steps 1-5 plan nothing, step 6 probes with 2, step 7 plans nothing
    assert told[1] == [0, 0, 0, 0, 1, 2, 0]
    assert told[2] == [0, 0, 0, 1, 1, 2, 0]


def test_a_rested_batch_drafts_again_as_soon_as_drafts_pay(tiny):
    """Drafters told 0 hold nothing ahead, so the planner's next ask is capped at 0; once its
    drafts pay again (acceptance measured, sessions gone, a cheaper forward), the step tells
    them 1 (their leads grow back) and the next one asks for drafts, without waiting for a
    probe. A probe's period follows the batch, but a probe comes only where it was told of."""
    with _never_right_pair(tiny) as (engine, acts):
        for _ in range(2):
            assert [w.k for w in engine._plan()] == [0, 0]
        assert [a.wanted for a in acts] == [0, 0]  # resting
        every = engine.prober.every
        engine.cost = fitted(0.040, 0.0001)  # a probe now cheaper: it comes sooner, but told of
        told, ks = _plan_until_a_probe(engine, acts)
        assert len(ks) + 2 < every  # sooner than the cycle began planning it
        assert told == [[0, 0]] * (len(ks) - 2) + [[1, 1]] * 2  # the step before it told
        for _ in range(3):
            engine._plan()  # rest again
        assert [a.wanted for a in acts] == [0, 0]
        for act in acts:
            for _ in range(20):
                act.draft_len.update(4, 4)  # now always right
        wants = engine._plan()
        assert [w.k for w in wants] == [0, 0] and [a.wanted for a in acts] == [1, 1]
        assert min(w.k for w in engine._plan()) > 0


def test_boards_are_told_of_a_probe_two_steps_ahead(tiny):
    """Without a drafting thread here (boards through the store), the two steps before a probe
    tell the drafters of it: a board drafts for a commit while the next step runs."""
    from edgespec.engine.draft_planner import probe_every

    with _never_right_pair(tiny, board="board-1") as (engine, acts):
        assert engine.worker is None and all(a.drafter == "board-1" for a in acts)
        every = probe_every(engine.cost, 2, 2)
        told = []
        for _ in range(every):
            engine._plan()
            told.append([a.wanted for a in acts])
        assert engine.prober.probing
        assert told == [[0, 0]] * (every - 3) + [[1, 1]] * 3
        for _ in range(10):
            engine._plan()  # resting, the next probe 7 steps away
        engine.cost = fitted(0.040, 0.0001)  # probes now cheap: due at once, yet told of first
        told, ks = _plan_until_a_probe(engine, acts)
        assert told == [[1, 1]] * 3 and len(ks) == 3


def test_a_probe_measures_acceptance_not_the_drafters_supply(tiny):
    """A probe asks drafters that rested until just before it: what its take finds is not
    recorded as their supply (``holds``; a step that asks for drafts records it)."""
    import numpy as np

    with _never_right_pair(tiny, new_tokens=100) as (engine, acts):
        probes = 0
        while probes < 2 and engine.active:
            held = engine.rates.held_trials.copy()
            engine.cost = fitted(0.040, 0.004)  # not the steps' own timing: a probe each 17th
            engine.step()
            if engine.prober.probing:  # it asked every session for a draft: not recorded
                probes += 1
                assert all(a.wanted for a in acts if a in engine.active)
                assert np.array_equal(engine.rates.held_trials, held)
        assert probes == 2


def test_a_draft_that_holds_fewer_tokens_than_asked_is_asked_for_as_many_as_pay():
    """A board slower than the steps holds about 2 tokens when the step takes its draft: the
    forward is as wide as the drafts taken, so asking for more costs what it brings."""
    cost = fitted(0.040, 0.004)  # a CPU: a token a row costs 10% of a step
    holds = [1.0, 1.0, 0.3, 0.1, 0.05, 0.0, 0.0, 0.0]
    right = [0.95 ** m for m in range(1, 9)]
    gains = [[a * h for a, h in zip(right, holds)]]
    asked = allocate(gains, cost, [holds])[0]
    assert asked > allocate(gains, cost)[0]  # as if every asked token widened the row
    assert asked >= 3  # a 3rd token, held 30% of the time, pays for its expected width
    many = allocate(gains * 8, cost, [holds] * 8)  # eight such rows: width is dearer
    assert len(set(many)) == 1 and many[0] <= asked


def test_rows_that_each_hold_a_long_draft_now_and_then_are_planned_as_wide_as_they_come():
    """Four rows each holding 8 tokens a quarter of the time and none otherwise: one of them
    usually does, so the forward is usually 9 wide, not the 3 of each row's expected length."""
    cost = fitted(0.040, 0.004)
    holds = [0.25] * 8
    gains = [[0.95 ** m * 0.25 for m in range(1, 9)]]
    alone = allocate(gains, cost, [holds])[0]
    four = allocate(gains * 4, cost, [holds] * 4)
    assert alone > 0 and len(set(four)) == 1 and four[0] < alone


def test_probes_come_as_rarely_as_keeps_their_cost_within_two_percent_of_the_steps():
    from edgespec.engine.draft_planner import MIN_PROBE_EVERY, PROBE_SHARE, probe_every

    dear = fitted(0.036, 0.018)  # a token a row costing half a step's fixed part
    every, model = probe_every(dear, 4, 2), dear.model()
    probe_s, step_s = model.per_token * 4 * 2, model.seconds(4, 1)
    assert every >= probe_s / (PROBE_SHARE * step_s) > every - 1 and every > 8
    assert probe_every(fitted(0.006, 0.000001), 64, 2) == MIN_PROBE_EVERY  # width nearly free
    assert probe_every(ForwardCost(), 4, 2) == MIN_PROBE_EVERY


def test_four_rows_draft_where_a_row_is_dear_and_a_token_of_a_row_cheap():
    """This CPU's forward: a row ~17 ms, a token of a row ~1 ms. Four rows drafting 8 tokens
    each cost 36 token-rows, 36 ms more: worth it at 90% acceptance, and a short draft at 30%."""
    cost = fitted(0.030, 0.001, per_row=0.017)
    assert allocate([geometric(0.9, 8)] * 4, cost) == [8] * 4
    assert 0 < allocate([geometric(0.3, 8)] * 4, cost)[0] < 8


def test_the_batch_budget_shortens_the_longest_drafts_first():
    """``cap_to_budget`` in one pass equals shortening the longest draft (the earliest of
    equals) one token at a time until the batch fits."""
    import random

    import numpy as np

    from edgespec.engine.step_planning import cap_to_budget

    rng = random.Random(7)
    for _ in range(300):
        ks = [rng.randint(0, 8) for _ in range(rng.randint(1, 12))]
        budget = rng.randint(0, sum(ks) + 3)
        slow = list(ks)
        while sum(slow) > budget:
            slow[slow.index(max(slow))] -= 1
        assert cap_to_budget(np.array(ks), budget).tolist() == slow, (ks, budget)


def test_no_step_asks_for_a_draft_past_the_end_of_a_requests_output(tiny):
    """A session with 3 output tokens left verifies at most 2 draft tokens (its step's own
    token is the third); with 1 left, none: whatever its acceptance and the planner's width,
    no draft token is verified that could only be cut off the output."""
    from edgespec.config import EngineConfig
    from edgespec.drafters import build_drafter
    from edgespec.engine.spec_engine import Request, SpecEngine
    from edgespec.runner.target_runner import TargetRunner

    for adaptive in (False, True):
        runner = TargetRunner(tiny.model, n_slots=4, max_len=256)
        with SpecEngine(runner, config=EngineConfig(max_draft=4, adaptive=adaptive),
                        drafter=build_drafter("mag"), stop_ids=set()) as engine:
            acts = [engine.add(Request([1, 5, 6, 7], 3)), engine.add(Request([1, 8, 9], 1)),
                    engine.add(Request([1, 8, 9, 4], 20))]
            engine.cost = fitted(0.040, 0.0004)  # a draft token costs 1% of a step
            for act in acts:
                for _ in range(20):
                    act.draft_len.update(4, 4)  # always right
            assert [w.k for w in engine._plan()] == [2, 0, 4], adaptive
    # a loosely verified session is not cut: drafts past its end may confirm a mismatch before
    # it (FLy's window), and the store does not tell its drafter where the output ends
    runner = TargetRunner(tiny.model, n_slots=4, max_len=256)
    with SpecEngine(runner, config=EngineConfig(max_draft=4, adaptive=False, verify="loose"),
                    drafter=build_drafter("mag"), stop_ids=set()) as engine:
        acts = [engine.add(Request([1, 5, 6, 7], 3, verify="exact")),
                engine.add(Request([1, 5, 6, 7], 3))]
        assert [a.verify for a in acts] == ["exact", "loose"]
        for act in acts:
            for _ in range(20):
                act.draft_len.update(4, 4)  # always right
        assert [w.k for w in engine._plan()] == [2, 4]
        assert [engine.store.sessions[a.sid].output_end for a in acts] == [7, None]
