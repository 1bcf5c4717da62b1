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
(``probe_branches``: a session's branches probed likewise).
"""

from __future__ import annotations


DECAY = 0.85  # each verification's weight relative to the next one's
POSITION_PRIOR = 2.0  # trials of alpha a position's own rate starts from


class DecayedRate:
    """Successes per trial, recent verifications weighing most (``DECAY``), from a prior."""

    def __init__(self, prior: float, prior_trials: float):
        self.hits, self.trials = prior * prior_trials, prior_trials

    @property
    def rate(self) -> float:
        return self.hits / self.trials

    def observe(self, hits: float, trials: float) -> None:
        self.hits = DECAY * self.hits + hits
        self.trials = DECAY * self.trials + trials


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


class DraftLength:
    def __init__(self, k_max: int, k_init: int | None = None, k_min: int = 1,
                 adaptive: bool = True, prior_alpha: float = 0.5, prior_trials: float = 2.0,
                 probe_every: int = 8):
        if not 1 <= k_min <= k_max:
            raise ValueError(f"need 1 <= k_min <= k_max, got {k_min}, {k_max}")
        self.k_min, self.k_max, self.adaptive = k_min, k_max, adaptive
        self.k = k_max if k_init is None else max(k_min, min(k_max, k_init))
        # accepted draft tokens per draft token tested (a rejection ends a test)
        self.chain = DecayedRate(prior_alpha, prior_trials)
        # position j's own hits and trials: was its token accepted, the ones before it were?
        self.at = [DecayedRate(0.0, 0.0) for _ in range(k_max)]
        # position j's supply: did the draft taken hold a j-th token, when asked for one?
        self.held = [DecayedRate(1.0, 1.0) for _ in range(k_max)]
        self.branch = DecayedRate(0.1, 5.0)  # accepted branch tokens per branch token verified
        self._branch_probe = Prober(probe_every)

    @property
    def alpha(self) -> float:
        """Estimated probability that the next draft token is accepted."""
        return self.chain.rate

    def gains(self, k: int) -> list[float]:
        """Expected accepted tokens of a draft's 1st..k-th token (k at most k_max): each the
        chance that the draft holds it and that it and every token before it are accepted,
        non-increasing."""
        alpha, out, survive = self.alpha, [], 1.0
        for rate, held in zip(self.at[:k], self.holds(k)):
            survive *= (rate.hits + POSITION_PRIOR * alpha) / (rate.trials + POSITION_PRIOR)
            out.append(survive * held)
        return out

    def holds(self, k: int) -> list[float]:
        """The chance that the draft taken holds a 1st..k-th token (non-increasing)."""
        out, held = [], 1.0
        for supply in self.held[:k]:
            held = min(held, supply.rate)
            out.append(held)
        return out

    def supplied(self, asked: int, got: int) -> None:
        """Record a take: ``asked`` draft tokens wanted, ``got`` in the draft. The positions
        not asked for are taken to hold as the last one asked did (so that a few short takes
        do not cap the session's width for good: the positions past them are never asked)."""
        if asked <= 0:
            return
        for j, supply in enumerate(self.held[:asked]):
            supply.observe(1.0 if j < got else 0.0, 1.0)
        last = self.held[min(asked, len(self.held)) - 1].rate
        for supply in self.held[asked:]:
            supply.observe(last, 1.0)

    @property
    def beta(self) -> float:
        """Estimated accepted tokens per branch token verified (token trees)."""
        return self.branch.rate

    def update(self, drafted: int, accepted: int) -> int:
        """Record one verification of ``drafted`` tokens of which ``accepted`` passed."""
        if drafted > 0:
            self.chain.observe(accepted, accepted + (1 if accepted < drafted else 0))
            for j, rate in enumerate(self.at[:drafted]):  # positions past the first miss: no trial
                if j <= accepted:
                    rate.observe(1.0 if j < accepted else 0.0, 1.0)
            if self.adaptive:
                if accepted == drafted:
                    self.k = min(self.k_max, self.k + 2)
                else:
                    self.k = max(self.k_min, self.k - 1)
        return self.k

    def update_branches(self, verified: int, accepted: int) -> None:
        """Record one verification of ``verified`` branch tokens, ``accepted`` of them taken."""
        if verified > 0:
            self.branch.observe(accepted, verified)

    def probe_branches(self, budget: int, cap: int) -> int:
        """``budget`` branch tokens as planned, except that a step that could have had branches
        (``cap`` > 0) but was planned without any verifies a few (at most 2) now and then.
        Steps without room for branches (no chain, say) neither count nor reset the count."""
        if cap <= 0:
            return 0
        return self._branch_probe.planned(budget, min(cap, 2))
