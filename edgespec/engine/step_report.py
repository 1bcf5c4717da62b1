"""What one verification step did (``StepReport``), for metrics and the bench's step totals."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class StepReport:
    """What one verification step did, for metrics."""

    sessions: int  # rows in the forward
    tokens: int  # tokens in the forward (one own token per row + draft tokens)
    drafts: int  # sessions whose non-empty draft was verified
    drafted: int
    accepted: int
    accepted_per_pos: tuple[int, ...]  # accepted draft tokens by position in the draft
    take_s: float  # waiting for and taking drafts
    forward_s: float  # the forward + verification
    commit_s: float


def step_report(accepted: Sequence[int], drafted: Sequence[int], sessions: int, tokens: int,
                take_s: float, forward_s: float, commit_s: float) -> StepReport:
    """The report of a step whose applied verdicts accepted ``accepted[i]`` of ``drafted[i]``
    draft tokens (one entry per session that committed)."""
    per_pos = [0] * max(accepted, default=0)
    for a in accepted:
        for i in range(a):
            per_pos[i] += 1
    return StepReport(sessions, tokens, sum(1 for d in drafted if d), sum(drafted),
                      sum(accepted), tuple(per_pos), take_s, forward_s, commit_s)
