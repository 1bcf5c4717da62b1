"""Adaptive draft length: how many draft tokens to verify next, learned from acceptance.

The schedule is transformers' heuristic (also PEARL's spirit): after a full accept the next draft
may be 2 tokens longer, after a rejection it is 1 shorter, within [k_min, k_max]. The drafters'
own confidence cut-offs decide where a draft stops being worth sending at all.
"""

from __future__ import annotations


class DraftLength:
    def __init__(self, k_max: int, k_init: int | None = None, k_min: int = 1,
                 adaptive: bool = True):
        if not 1 <= k_min <= k_max:
            raise ValueError(f"need 1 <= k_min <= k_max, got {k_min}, {k_max}")
        self.k_min, self.k_max, self.adaptive = k_min, k_max, adaptive
        self.k = k_max if k_init is None else max(k_min, min(k_max, k_init))

    def update(self, drafted: int, accepted: int) -> int:
        """Record one verification of ``drafted`` tokens of which ``accepted`` passed."""
        if self.adaptive and drafted > 0:
            if accepted == drafted:
                self.k = min(self.k_max, self.k + 2)
            else:
                self.k = max(self.k_min, self.k - 1)
        return self.k
