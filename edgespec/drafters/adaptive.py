"""Adaptive draft length: how many draft tokens to verify next, learned from acceptance.

The schedule is transformers' heuristic (also PEARL's spirit): after a full accept the next draft
may be 2 tokens longer, after a rejection it is 1 shorter, within [k_min, k_max]. The drafters'
own confidence cut-offs decide where a draft stops being worth sending at all.

``alpha`` estimates the probability that a draft token is accepted given that the tokens before
it were (successes over trials, recent verifications weighing most); the engine's planner
(``edgespec.draft_planner``) turns it and the measured cost of a wider forward into the number of
draft tokens a step verifies (and waits for), 0 where drafting does not pay. A session planned
without drafts is probed now and then (``probe``), so a session whose text turns repetitive is
noticed. ``beta`` is the same for token trees: accepted branch tokens per branch token verified,
which the planner weighs against a wider forward's cost (``probe_branches`` likewise).
"""

from __future__ import annotations


class DraftLength:
    def __init__(self, k_max: int, k_init: int | None = None, k_min: int = 1,
                 adaptive: bool = True, prior_alpha: float = 0.5, prior_trials: float = 2.0):
        if not 1 <= k_min <= k_max:
            raise ValueError(f"need 1 <= k_min <= k_max, got {k_min}, {k_max}")
        self.k_min, self.k_max, self.adaptive = k_min, k_max, adaptive
        self.k = k_max if k_init is None else max(k_min, min(k_max, k_init))

        self._since_probe = 0
        self._hits = prior_alpha * prior_trials  # decayed accepted draft tokens ...
        self._trials = prior_trials  # ... and decayed draft tokens tested (each reject ends one)
        self._since_branch_probe = 0
        self._branch_hits = 0.5  # decayed accepted branch tokens (prior: 0.1 per token) ...
        self._branch_trials = 5.0  # ... and decayed branch tokens verified

    @property
    def alpha(self) -> float:
        """Estimated probability that the next draft token is accepted."""
        return self._hits / self._trials

    def update(self, drafted: int, accepted: int) -> int:
        """Record one verification of ``drafted`` tokens of which ``accepted`` passed."""
        if drafted > 0:
            self._hits = 0.85 * self._hits + accepted
            self._trials = 0.85 * self._trials + accepted + (1 if accepted < drafted else 0)
            if self.adaptive:
                if accepted == drafted:
                    self.k = min(self.k_max, self.k + 2)
                else:
                    self.k = max(self.k_min, self.k - 1)
        return self.k

    @property
    def beta(self) -> float:
        """Estimated accepted tokens per branch token verified (token trees)."""
        return self._branch_hits / self._branch_trials

    def update_branches(self, verified: int, accepted: int) -> None:
        """Record one verification of ``verified`` branch tokens, ``accepted`` of them taken."""
        if verified > 0:
            self._branch_hits = 0.85 * self._branch_hits + accepted
            self._branch_trials = 0.85 * self._branch_trials + verified

    def probe_branches(self, side: int, cap: int, probe_every: int = 8) -> int:
        """``side`` branch tokens as planned, except that every ``probe_every``-th step that
        could have had branches (``cap`` > 0) but was planned without any verifies a few (at
        most 2) anyway, to measure ``beta`` again. Steps without room for branches (no chain,
        say) neither count nor reset the count."""
        if cap <= 0:
            return 0
        if side > 0:
            self._since_branch_probe = 0
            return side
        self._since_branch_probe += 1
        if self._since_branch_probe >= probe_every:
            self._since_branch_probe = 0
            return min(cap, 2)
        return 0

    def probe(self, k: int, probe_every: int = 8) -> int:
        """``k`` as planned, except that every ``probe_every``-th step planned without a draft
        verifies a short one anyway, to measure acceptance again."""
        if k > 0 or not self.adaptive:
            self._since_probe = 0
            return k
        self._since_probe += 1
        if self._since_probe >= probe_every:
            self._since_probe = 0
            return min(self.k, 2)
        return 0
