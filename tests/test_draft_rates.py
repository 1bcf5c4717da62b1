"""Sessions' draft-length state as arrays (``draft_rates``): a batch recorded at once learns what
each session would alone, and the planner reads every session's own figures from one call."""

import random

import numpy as np
import pytest

from edgespec.drafters.adaptive import DraftLength
from edgespec.drafters.draft_rates import DraftRates, RowsOf


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
        asked = np.array([rng.randint(0, 6) for _ in range(8)])
        got = np.array([rng.randint(0, a) if a else 0 for a in asked])
        drafted = np.array([rng.randint(0, 6) for _ in range(8)])
        accepted = np.array([rng.randint(0, d) for d in drafted])
        branches = np.array([rng.randint(0, 4) for _ in range(8)])
        taken = np.array([rng.randint(0, b) for b in branches])
        rows.record("supplied", asked, got)
        rows.record("update", drafted, accepted)
        rows.record("update_branches", branches, taken)
        for i, dl in enumerate(alone):
            dl.supplied(int(asked[i]), int(got[i]))
            dl.update(int(drafted[i]), int(accepted[i]))
            dl.update_branches(int(branches[i]), int(taken[i]))
    for a, b in zip(together, alone):
        assert a.k == b.k
        assert a.gains(6) == b.gains(6) and a.holds(6) == b.holds(6)
        assert a.alpha == b.alpha and a.beta == b.beta
    assert len({tuple(dl.gains(6)) for dl in together}) > 1  # the sessions did differ


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
