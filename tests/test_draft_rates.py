"""Sessions' draft-length state as arrays (``draft_rates``): a batch recorded at once learns what
each session would alone, and the planner reads every session's own figures from one call."""

import random

import numpy as np
import pytest

from edgespec.drafters.adaptive import DraftLength
from edgespec.drafters.draft_rates import DECAY, POSITION_PRIOR, DraftRates, RowsOf


class OneSession:
    """The rules for one session in plain floats, a rate at a time (the oracle the arrays are
    held to): decayed hits and trials from a prior; a position's rate pulled towards alpha."""

    def __init__(self, k_max: int):
        self.k_max, self.k = k_max, k_max
        self.chain = [0.5 * 2.0, 2.0]
        self.at = [[0.0, 0.0] for _ in range(k_max)]
        self.held = [[1.0, 1.0] for _ in range(k_max)]
        self.branch = [0.1 * 5.0, 5.0]

    @staticmethod
    def _observe(rate: list, hits: float, trials: float) -> None:
        rate[0], rate[1] = DECAY * rate[0] + hits, DECAY * rate[1] + trials

    def supplied(self, asked: int, got: int) -> None:
        if asked <= 0:
            return
        for j in range(min(asked, self.k_max)):
            self._observe(self.held[j], 1.0 if j < got else 0.0, 1.0)
        last = self.held[min(asked, self.k_max) - 1]
        last_rate = last[0] / last[1]
        for j in range(asked, self.k_max):
            self._observe(self.held[j], last_rate, 1.0)

    def update(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self._observe(self.chain, accepted, accepted + (accepted < drafted))
        for j in range(min(drafted, self.k_max)):
            if j <= accepted:
                self._observe(self.at[j], 1.0 if j < accepted else 0.0, 1.0)
        self.k = min(self.k_max, self.k + 2) if accepted == drafted else max(1, self.k - 1)

    def update_branches(self, verified: int, accepted: int) -> None:
        if verified > 0:
            self._observe(self.branch, accepted, verified)

    def holds(self, k: int) -> list[float]:
        out, held = [], 1.0
        for hits, trials in self.held[:k]:
            held = min(held, hits / trials)
            out.append(held)
        return out

    def gains(self, k: int) -> list[float]:
        alpha, out, survive = self.chain[0] / self.chain[1], [], 1.0
        for (hits, trials), held in zip(self.at[:k], self.holds(k)):
            survive *= (hits + POSITION_PRIOR * alpha) / (trials + POSITION_PRIOR)
            out.append(survive * held)
        return out


def _random_step(rng: random.Random, n: int, k_max: int, asks: list[int]) -> dict:
    """One step's takes (asked, got), verdicts (drafted, accepted) and branches (verified,
    accepted) for n sessions, as ``RowsOf.record`` takes them."""
    asked = np.array([rng.choice(asks) for _ in range(n)])
    drafted = np.array([rng.randint(0, k_max) for _ in range(n)])
    branches = np.array([rng.randint(0, 3) for _ in range(n)])
    # a draft may hold more than was asked, and more than k_max
    return {"supplied": (asked, np.array([rng.randint(0, a + 2) for a in asked])),
            "update": (drafted, np.array([rng.randint(0, d) for d in drafted])),
            "update_branches": (branches, np.array([rng.randint(0, b) for b in branches]))}


def _record(rows: RowsOf, each: list, step: dict) -> None:
    """The step recorded for the batch in one call a kind, and for ``each`` session alone."""
    for what, values in step.items():
        rows.record(what, *values)
        for i, one in enumerate(each):
            getattr(one, what)(*(int(v[i]) for v in values))


def test_a_batch_recorded_at_once_learns_what_each_session_learns_alone():
    """Eight sessions' takes and verdicts recorded in one call a step, against the same
    sessions each with a table of its own fed one at a time: the same rates, bit for bit, and
    the same next lengths."""
    rng = random.Random(3)
    table = DraftRates(8, k_max=6)
    together = [DraftLength.of_row(table, r) for r in range(8)]
    alone = [DraftLength(6) for _ in range(8)]
    rows = RowsOf(together)
    for _ in range(60):
        _record(rows, alone, _random_step(rng, 8, 6, list(range(7))))
    for a, b in zip(together, alone):
        assert a.k == b.k
        assert a.gains(6) == b.gains(6) and a.holds(6) == b.holds(6)
        assert a.alpha == b.alpha and a.beta == b.beta
    assert len({tuple(dl.gains(6)) for dl in together}) > 1  # the sessions did differ


def test_the_arrays_follow_the_rules_of_one_session_in_plain_floats():
    """Rows of a table recorded in batches (slots 5, 2, 7 of 8) against the one-session rules
    in floats: the same gains, holds, alpha, beta and next length."""
    rng = random.Random(11)
    table = DraftRates(8, k_max=5)
    views = [DraftLength.of_row(table, r) for r in (5, 2, 7)]
    oracles = [OneSession(5) for _ in views]
    rows = RowsOf(views)
    for _ in range(80):
        _record(rows, oracles, _random_step(rng, 3, 5, [0, 1, 3, 5, 7]))
        for v, o in zip(views, oracles):
            assert v.k == o.k
            assert v.gains(5) == pytest.approx(o.gains(5), rel=1e-12)
            assert v.holds(5) == pytest.approx(o.holds(5), rel=1e-12)
            assert v.alpha == pytest.approx(o.chain[0] / o.chain[1], rel=1e-12)
            assert v.beta == pytest.approx(o.branch[0] / o.branch[1], rel=1e-12)


def test_a_view_of_a_row_taken_by_a_later_session_refuses_to_write():
    """A session's draft length kept after it ended must not teach the slot's next session."""
    table = DraftRates(2, k_max=4)
    old = DraftLength.of_row(table, 0)
    DraftLength.of_row(table, 0)  # the slot's next session
    with pytest.raises(RuntimeError, match="later session"):
        old.update(4, 4)
    with pytest.raises(ValueError, match="of_row"):
        DraftLength(6, table=table, row=1)  # a row's settings are its table's


def test_gains_asked_past_the_longest_draft_are_cut_to_it():
    table = DraftRates(2, k_max=3)
    gains, holds = table.gains_holds(np.array([0, 1]), np.array([5, 2]))
    assert gains.shape == holds.shape == (2, 3)
    assert gains[0].tolist() == pytest.approx([0.5, 0.25, 0.125]) and gains[1, 2] == 0.0


def test_a_new_session_in_a_slot_starts_from_the_priors():
    table = DraftRates(2, k_max=4)
    first = DraftLength.of_row(table, 1)
    for _ in range(10):
        first.update(4, 0)
    assert first.alpha < 0.1 and first.k == 1
    second = DraftLength.of_row(table, 1)  # the slot's next session
    assert second.alpha == 0.5 and second.k == 4
    assert second.gains(3) == pytest.approx([0.5, 0.25, 0.125])


def test_sessions_of_different_tables_read_together_keep_their_own_figures():
    """A batch holding sessions of two tables (a test's, or sizes apart): each session's gains
    and length are its own, in the batch's order."""
    a, b = DraftRates(3, k_max=4), DraftRates(2, k_max=6)
    mixed = [DraftLength.of_row(a, 2), DraftLength.of_row(b, 0), DraftLength.of_row(a, 0)]
    for _ in range(8):
        mixed[1].update(6, 6)  # always right: longer drafts, higher gains
        mixed[2].update(4, 0)
    rows = RowsOf(mixed)
    ks = rows.values(3, "k")
    assert ks.tolist() == [dl.k for dl in mixed] == [4, 6, 1]
    gains, holds = rows.gains_holds(3, ks)
    assert gains.shape == (3, 6)
    for i, dl in enumerate(mixed):
        assert gains[i, :dl.k].tolist() == dl.gains(dl.k)
        assert not gains[i, dl.k:].any() and not holds[i, dl.k:].any()
