"""Adaptive draft length: how many draft tokens to verify next, learned from acceptance.

The schedule is transformers' heuristic (also PEARL's spirit): after a full accept the next draft
may be 2 tokens longer, after a rejection it is 1 shorter, within [k_min, k_max]. The drafters'
own confidence cut-offs decide where a draft stops being worth sending at all.

``alpha`` estimates the probability that a draft token is accepted given that the tokens before it
were (successes over trials, recent verifications weighing most). ``gains`` refines it position by
position: the expected accepted tokens of a draft's m-th token, S(m) = p_1 * ... * p_m with p_j
measured at position j (pulled towards alpha while position j has few trials). A drafter whose
drafts are right in runs (MaG: all of a draft or none of it) has a first-token rate well under
alpha, which a geometric alpha^m would overrate. Each gain is also weighed by the chance that
the draft holds that many tokens when the step takes it (``supplied``: a board slower than the
verifier's steps often has fewer ready than asked, and an absent token widens the batch for
nothing). The engine's planner
(``edgespec.engine.draft_planner``) turns the gains and the measured cost of a wider forward into
the number of draft tokens a step verifies (and waits for), 0 where drafting does not pay; a step
planned without drafts is probed now and then (``Prober``, held by the engine), so a batch whose
text turns repetitive is noticed. ``beta`` is the same for token trees: accepted branch tokens per
branch token verified, which the planner weighs against a wider forward's cost
(``probe_branches``: a session's branches probed likewise). A ``DraftLength`` is one session's
row of a ``draft_rates.DraftRates`` table, where the engine reads and records whole batches.
"""

from __future__ import annotations

import numpy as np

from .draft_rates import DraftRates


class Prober:
    """Lets every ``every``-th step that was planned without any (drafts, or branches) verify a
    few anyway, so that an estimate that dropped to "not worth it" is measured again."""

    def __init__(self, every: int = 8):
        self.every, self.since = every, 0
        self.probing = False  # whether the last ``planned`` probed

    def planned(self, n: int, small: int) -> int:
        """``n`` as planned, or ``small`` on a probing step when ``n`` is 0."""
        self.probing = False
        if n > 0:
            self.since = 0
            return n
        self.since += 1
        if self.since >= self.every:
            self.since, self.probing = 0, True
            return small
        return 0

    def due_within(self, steps: int) -> bool:
        """Whether one of the next ``steps`` steps probes if they too are planned without
        drafts (read after this step's ``planned``): the steps before a probe tell the
        drafters to draft for it (``step_planning.told_wants``)."""
        return self.since + steps >= self.every


class DraftLength:
    """One session's draft length: a view of its row in a ``DraftRates`` table (the engine's
    sessions share one; alone, a table of one row)."""

    def __init__(self, k_max: int, k_init: int | None = None, k_min: int = 1,
                 adaptive: bool = True, prior_alpha: float = 0.5, prior_trials: float = 2.0,
                 probe_every: int = 8, *, table: DraftRates | None = None, row: int = 0):
        if table is None:
            table = DraftRates(1, k_max, k_min, adaptive, prior_alpha, prior_trials)
        elif (k_max, k_min, adaptive, prior_alpha, prior_trials) != \
                (table.k_max, table.k_min, table.adaptive, table.prior_alpha,
                 table.prior_trials):
            raise ValueError("a row's settings are its table's: build the view with of_row")
        self.table, self.row = table, row
        self._rows = np.array([row])
        table.reset(row, k_init)
        self._generation = int(table.generation[row])  # the row is this session's until reset
        self._branch_probe = Prober(probe_every)

    @classmethod
    def of_row(cls, table: DraftRates, row: int, probe_every: int = 8) -> "DraftLength":
        """Row ``row`` of ``table``, back at its priors: a new session's."""
        return cls(table.k_max, None, table.k_min, table.adaptive, table.prior_alpha,
                   table.prior_trials, probe_every, table=table, row=row)

    @property
    def k(self) -> int:
        """The next draft's length."""
        return int(self.table.k[self.row])

    @property
    def k_max(self) -> int:
        return self.table.k_max

    @property
    def alpha(self) -> float:
        """Estimated probability that the next draft token is accepted."""
        return float(self.table.alpha(self._rows)[0])

    @property
    def beta(self) -> float:
        """Estimated accepted tokens per branch token verified (token trees)."""
        return float(self.table.beta(self._rows)[0])

    def gains(self, k: int) -> list[float]:
        """Expected accepted tokens of a draft's 1st..k-th token (k at most k_max): each the
        chance that the draft holds it and that it and every token before it are accepted,
        non-increasing."""
        k = min(k, self.table.k_max)
        return self.table.gains(self._rows, np.array([k]))[0].tolist()

    def holds(self, k: int) -> list[float]:
        """The chance that the draft taken holds a 1st..k-th token (non-increasing)."""
        k = min(k, self.table.k_max)
        return self.table.holds(self._rows, np.array([k]))[0].tolist()

    def supplied(self, asked: int, got: int) -> None:
        """Record a take: ``asked`` draft tokens wanted, ``got`` in the draft
        (``DraftRates.supplied``)."""
        self._check_own()
        self.table.supplied(self._rows, np.array([asked]), np.array([got]))

    def update(self, drafted: int, accepted: int) -> int:
        """Record one verification of ``drafted`` tokens of which ``accepted`` passed; returns
        the next length."""
        self._check_own()
        self.table.update(self._rows, np.array([drafted]), np.array([accepted]))
        return self.k

    def update_branches(self, verified: int, accepted: int) -> None:
        """Record one verification of ``verified`` branch tokens, ``accepted`` of them taken."""
        self._check_own()
        self.table.update_branches(self._rows, np.array([verified]), np.array([accepted]))

    def _check_own(self) -> None:
        """A write through a view whose row was reset since (its session ended and the slot's
        next session took the row) would teach the new session the old one's verdicts."""
        if int(self.table.generation[self.row]) != self._generation:
            raise RuntimeError(f"draft-length row {self.row} belongs to a later session now")

    def probe_branches(self, budget: int, cap: int) -> int:
        """``budget`` branch tokens as planned, except that a step that could have had branches
        (``cap`` > 0) but was planned without any verifies a few (at most 2) now and then.
        Steps without room for branches (no chain, say) neither count nor reset the count."""
        if cap <= 0:
            return 0
        return self._branch_probe.planned(budget, min(cap, 2))
