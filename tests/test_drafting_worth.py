"""Resting a batch's drafters when drafting measures slower than resting
(``edgespec.engine.drafting_worth``): the choice follows the measured steps, each regime is
measured again in windows whose interval doubles while they agree and starts over when the
choice flips, the steps right after a change are not counted, drafting that clearly pays is
never rested to check; and in the engine a rested step asks no draft, tells every drafter to
rest, is reported as rested, and decodes what target-only decodes."""

from __future__ import annotations

import pytest
from conftest import hf_greedy

from edgespec.config import EngineConfig, SamplingParams
from edgespec.drafters import build_drafter
from edgespec.engine import drafting_worth as dw
from edgespec.engine.drafting_worth import DRAFT, REST, DraftingWorth
from edgespec.engine.spec_engine import Request, SpecEngine
from edgespec.runner.target_runner import TargetRunner


def drive(worth: DraftingWorth, steps: int, rates: dict, rows: int = 8,
          plain_rate: float | None = None) -> list[str]:
    """``steps`` steps of ``rows`` sessions, each regime committing ``rates[regime]`` tokens a
    second (rows tokens a step resting); the regimes chosen, in order. ``rates`` may change
    from a step on: {"from": step, ...} entries are read as they come."""
    out = []
    for i in range(steps):
        regime = worth.choose(rows, plain_rate)
        rate = rates[regime] if i < rates.get("from", steps) else rates["then"][regime]
        tokens = rows if regime == REST else rows + 4
        worth.observe(rows, tokens, tokens / rate)
        out.append(regime)
    return out


def window_starts(regimes: list[str], chosen: str) -> list[int]:
    """Steps where a run of the regime not ``chosen`` begins."""
    return [i for i, r in enumerate(regimes)
            if r != chosen and (i == 0 or regimes[i - 1] == chosen)]


def test_drafting_slower_than_resting_rests_and_checks_drafting_ever_more_rarely():
    w = DraftingWorth()
    got = drive(w, 400, {DRAFT: 10.0, REST: 12.0})
    # drafting until the first window measures resting, then resting but for drafting windows
    assert got[:dw.FIRST_EXPLORE - 1] == [DRAFT] * (dw.FIRST_EXPLORE - 1)
    first_rest = got.index(REST)
    window = dw.SETTLE + dw.MEASURE
    assert got[first_rest:first_rest + window] == [REST] * window
    after = got[first_rest:]
    starts = window_starts(after, REST)
    assert len(starts) >= 3
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert all(b > a for a, b in zip(gaps, gaps[1:]))  # each agreeing window doubles the next gap
    assert all(after[s:s + window] == [DRAFT] * window for s in starts)
    assert after.count(REST) > 0.9 * len(after)
    assert w.rested == got.count(REST)


@pytest.mark.parametrize("rates", [{DRAFT: 10.0, REST: 12.0}, {DRAFT: 12.0, REST: 10.0},
                                   {DRAFT: 10.0, REST: 12.0, "from": 150,
                                    "then": {DRAFT: 14.0, REST: 10.0}}],
                         ids=["resting-wins", "drafting-wins", "flips"])
def test_the_next_regime_is_what_the_next_choice_gives_where_it_says(rates):
    """``next_regime`` (a guess a step run ahead makes) names the regime the next ``choose``
    picks whenever it names one (None only where a window ends: its judging decides), without
    changing what is chosen."""
    w, plain = DraftingWorth(), DraftingWorth()
    named = 0
    for i in range(400):
        guess = w.next_regime(8)
        regime = w.choose(8, None)
        assert regime == plain.choose(8, None)  # the guess changed nothing
        if guess is not None:
            assert guess == regime, i
            named += 1
        rate = rates[regime] if i < rates.get("from", 400) else rates["then"][regime]
        tokens = 8 if regime == REST else 12
        for x in (w, plain):
            x.observe(8, tokens, tokens / rate)
    assert named > 380


def test_drafting_faster_than_resting_keeps_drafting():
    w = DraftingWorth()
    got = drive(w, 400, {DRAFT: 14.0, REST: 12.0})
    starts = window_starts(got, DRAFT)
    assert starts and starts[0] == dw.FIRST_EXPLORE - 1
    assert len(starts) >= 3
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert all(b > a for a, b in zip(gaps, gaps[1:]))
    assert got.count(DRAFT) > 0.9 * len(got)
    assert w.windows == len(starts)


def test_no_window_where_the_chosen_regime_has_no_steps_measured():
    """Batch sizes that keep changing: a window comes only at one whose chosen regime has
    counted steps (a window elsewhere would learn nothing and cost its steps)."""
    w = DraftingWorth()
    for i in range(200):  # a new batch size every step: never measured twice anywhere
        assert w.choose(1 + i, None) == DRAFT
        w.observe(1 + i, 5, 1.0)
    assert w.windows == 0 and w.rested == 0
    got = drive(w, 12, {DRAFT: 10.0, REST: 12.0}, rows=300)  # long due, at a batch size new
    first = got.index(REST)  # once its drafting is measured (MIN_WEIGHT), the window comes
    assert first == 3 and w.windows == 1
    assert got[first:] == [REST] * (len(got) - first)


def test_drafting_that_clearly_pays_is_never_rested_to_check():
    w = DraftingWorth()
    # the forward fit's plain rate 10 tokens a second; drafting measures 13 (>= 1.25x)
    got = drive(w, 300, {DRAFT: 13.0, REST: 12.0}, plain_rate=10.0)
    assert got == [DRAFT] * 300 and w.windows == 0
    # against resting as measured: one window shows drafting 1.5x resting, and no more come
    w = DraftingWorth()
    got = drive(w, 600, {DRAFT: 18.0, REST: 12.0})
    assert w.windows == 1 and got.count(REST) == dw.SETTLE + dw.MEASURE
    # drafting at 12 is not a clear win over 10: resting is measured, and wins here
    w = DraftingWorth()
    got = drive(w, 300, {DRAFT: 12.0, REST: 13.0}, plain_rate=10.0)
    assert w.windows > 0 and got[-1] == REST


def test_only_a_window_changes_the_choice_against_the_chosen_regimes_last_steps():
    w = DraftingWorth()
    got = drive(w, 60, {DRAFT: 14.0, REST: 12.0})
    assert got[-1] == DRAFT and w.choices == {8: DRAFT}
    for _ in range(10):  # drafting slows (a session's opening, or for good): no window yet
        assert w.choose(8, None) == DRAFT
        w.observe(8, 8, 8 / 6.0)
    assert w.preferred(8) == DRAFT
    # the next window measures resting against drafting's last steps, not the older ones
    got = drive(w, 200, {DRAFT: 6.0, REST: 12.0})
    assert got[-1] == REST and w.choices == {8: REST}
    w = DraftingWorth()
    got = drive(w, 300, {DRAFT: 12.0, REST: 12.2})  # resting 1.7% faster: within the margin
    assert got[-1] == DRAFT and got.count(DRAFT) > 0.9 * len(got)


def test_a_server_slowing_down_does_not_make_the_chosen_regime_look_worse():
    """Both regimes slow down together as the sessions' contexts grow: drafting, 8% faster
    than resting at every moment, keeps being chosen (a rate measured long ago would make the
    regime measured now look the slower)."""
    w = DraftingWorth()
    got = []
    for i in range(600):
        regime = w.choose(8, None)
        scale = 1.0 - i / 1000  # 40% slower by the end
        rate = (13.0 if regime == DRAFT else 12.0) * scale
        w.observe(8, 8, 8 / rate)
        got.append(regime)
    assert w.preferred(8) == DRAFT and got.count(DRAFT) > 0.9 * len(got)


def test_a_flip_starts_the_interval_over():
    w = DraftingWorth()
    got = drive(w, 600, {DRAFT: 15.0, REST: 12.0, "from": 300,
                         "then": {DRAFT: 9.0, REST: 12.0}})
    assert got[299] == DRAFT or got[290:300].count(DRAFT) > 0
    assert got[-1] == REST  # drafting got slower: the next window found it so
    flip = next(i for i in range(300, 600) if got[i:i + 20] == [REST] * 20)
    # after the flip, drafting windows come FIRST_EXPLORE steps apart again, then rarer
    starts = window_starts(got[flip:], REST)
    assert starts and starts[0] < 2 * dw.FIRST_EXPLORE


def test_the_steps_right_after_a_change_of_regime_are_not_counted():
    w = DraftingWorth()
    for _ in range(dw.SETTLE):
        assert w.choose(4, None) == DRAFT
        w.observe(4, 4, 100.0)  # a board catching up: absurdly slow, not counted
    assert w.rates == {}
    for _ in range(3):  # MIN_WEIGHT: three steps decayed
        w.choose(4, None)
        w.observe(4, 8, 1.0)
    assert w.rates[4].draft.rate == pytest.approx(8.0)
    assert w.rates[4].rest.rate is None


def test_a_batch_size_not_measured_follows_the_nearest_measured_one():
    w = DraftingWorth()
    drive(w, 200, {DRAFT: 10.0, REST: 12.0}, rows=8)
    assert w.preferred(8) == REST and w.preferred(7) == REST and w.preferred(1) == REST
    assert DraftingWorth().preferred(3) == DRAFT  # nothing measured: the planner decides


# -- in the engine --------------------------------------------------------------------------------
PROMPTS = [[1, 10, 11, 12, 13, 10, 11, 12, 13, 10], [1, 30, 31, 30, 31, 30]]


@pytest.fixture(scope="module")
def runner(looping):
    return TargetRunner(looping.model, n_slots=4, max_len=256)


def _run(looping, runner, cfg, steps_out):
    with SpecEngine(runner, build_drafter("mag", looping, runner), cfg, stop_ids={2}) as eng:
        step = eng.step

        def recorded():
            report = step()
            if report is not None:
                steps_out.append((report, [a.wanted for a in eng.active]))
            return report
        eng.step = recorded
        results = eng.generate_many([Request(p, 40, SamplingParams()) for p in PROMPTS])
        return eng, results


def test_a_rested_step_asks_no_draft_tells_drafters_to_rest_and_decodes_target_only(
        looping, runner, monkeypatch):
    monkeypatch.setattr(DraftingWorth, "preferred", lambda self, rows: REST)
    monkeypatch.setattr(dw, "FIRST_EXPLORE", 10_000)  # no drafting window: every step rests
    steps: list = []
    eng, results = _run(looping, runner, EngineConfig(max_draft=4, window=8), steps)
    assert [r.token_ids for r in results] == [hf_greedy(looping.model, p, 40) for p in PROMPTS]
    assert steps and all(r.rested and r.drafted == 0 for r, _ in steps)
    assert all(w == 0 for _, wanted in steps for w in wanted)  # every drafter told to rest
    assert eng.worth is not None and eng.worth.rested == len(steps)


def test_drafting_steps_are_not_rested_and_keep_drafting_opts_out(looping, runner,
                                                                  monkeypatch):
    monkeypatch.setattr(DraftingWorth, "preferred", lambda self, rows: DRAFT)
    monkeypatch.setattr(dw, "FIRST_EXPLORE", 10_000)
    steps: list = []
    _, results = _run(looping, runner, EngineConfig(max_draft=4, window=8), steps)
    assert not any(r.rested for r, _ in steps)
    assert [r.token_ids for r in results] == [hf_greedy(looping.model, p, 40) for p in PROMPTS]
    with SpecEngine(runner, None, EngineConfig(rest_drafters=False)) as eng:
        assert eng.worth is None
    with SpecEngine(runner, None, EngineConfig(adaptive=False)) as eng:
        assert eng.worth is None
