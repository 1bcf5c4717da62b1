"""Adaptive draft length: how many draft tokens to verify next, learned from acceptance.

The schedule is transformers' heuristic (also PEARL's spirit): after a full accept the next draft
may be 2 tokens longer, after a rejection it is 1 shorter, within [k_min, k_max]. The drafters'
own confidence cut-offs decide where a draft stops being worth sending at all.

``worth_waiting`` decides whether a verification step should wait for a draft that is not there
yet: waiting costs the drafter's round trip (sub-millisecond in process, a few milliseconds over
the network), which pays only where drafts get accepted. It keeps an exponential average of
accepted tokens per verified draft; below ``min_gain`` the step takes what is there without
waiting, except one step in ``probe_every``, so a session whose text turns repetitive is noticed.
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

    def worth_waiting(self, min_gain: float = 0.4, probe_every: int = 8) -> bool:
        if not self.adaptive or self.gain >= min_gain:
            self._since_probe = 0
            return True
        self._since_probe += 1
        if self._since_probe >= probe_every:
            self._since_probe = 0
            return True
        return False
