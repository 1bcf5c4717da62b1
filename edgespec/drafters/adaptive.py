"""Adaptive draft length: how many draft tokens to verify next, learned from acceptance.

The schedule is transformers' heuristic (also PEARL's spirit): after a full accept the next draft
may be 2 tokens longer, after a rejection it is 1 shorter, within [k_min, k_max]. The drafters'
own confidence cut-offs decide where a draft stops being worth sending at all.

``plan`` decides whether a verification step should wait for a draft that is not there yet, and
whether to verify a draft at all: waiting costs the drafter's round trip (sub-millisecond in
process, a few milliseconds over the network) and every draft token widens the forward, which pays
only where drafts get accepted. It keeps an exponential average of accepted tokens per verified
draft and falls back to plain decoding where it is low, probing now and then, so a session whose
text turns repetitive is noticed.
"""

from __future__ import annotations


class DraftLength:
    def __init__(self, k_max: int, k_init: int | None = None, k_min: int = 1,
                 adaptive: bool = True):
        if not 1 <= k_min <= k_max:
            raise ValueError(f"need 1 <= k_min <= k_max, got {k_min}, {k_max}")
        self.k_min, self.k_max, self.adaptive = k_min, k_max, adaptive
        self.k = k_max if k_init is None else max(k_min, min(k_max, k_init))

        self.gain = 1.0  # exponential average of accepted tokens per verified draft
        self._since_probe = 0

    def update(self, drafted: int, accepted: int) -> int:
        """Record one verification of ``drafted`` tokens of which ``accepted`` passed."""
        if drafted > 0:
            self.gain = 0.7 * self.gain + 0.3 * accepted
            if self.adaptive:
                if accepted == drafted:
                    self.k = min(self.k_max, self.k + 2)
                else:
                    self.k = max(self.k_min, self.k - 1)
        return self.k

    def plan(self, wait_gain: float = 0.4, take_gain: float = 0.15, probe_every: int = 8
             ) -> tuple[int, int]:
        """(draft tokens to verify, draft tokens worth waiting for) for the next step.

        Below ``wait_gain`` accepted tokens per draft the step does not wait; below
        ``take_gain`` it verifies no draft at all (a draft token costs a few percent of a
        step, measured ~8% on 2 CPU cores, so rarely accepted drafts lose time). Every
        ``probe_every``-th such step verifies and waits anyway, to notice a change."""
        if not self.adaptive or self.gain >= wait_gain:
            self._since_probe = 0
            return self.k, self.k
        self._since_probe += 1
        if self._since_probe >= probe_every:
            self._since_probe = 0
            return self.k, self.k
        return (self.k if self.gain >= take_gain else 0), 0
