"""What one verification step did (``StepReport``), for metrics and the bench's step totals."""

from __future__ import annotations

from typing import Sequence

from ..protocol.frozen_value import frozen_value
from ..protocol.request_stats import reaching


@frozen_value
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
    # verified drafts that held a token at each depth (what accepted_per_pos is out of; a
    # tree's by its longest path)
    drafted_per_pos: tuple[int, ...] = ()
    # the drafters rested: drafting measured slower than resting at this batch size
    # (``drafting_worth``), no session asked for a draft
    rested: bool = False
    # its forward was launched during the step before (``decode_ahead``): ``forward_s`` is the
    # wait for its verdicts, what was left of that forward by then
    ran_ahead: bool = False


def step_report(accepted: Sequence[int], drafted: Sequence[int], sessions: int, tokens: int,
                take_s: float, forward_s: float, commit_s: float,
                depths: Sequence[int] | None = None) -> StepReport:
    """The report of a step whose applied verdicts accepted ``accepted[i]`` of ``drafted[i]``
    draft tokens (one entry per session that committed); ``depths[i]``: the longest path of
    its draft (a tree's, branches included; default ``drafted``), what positions count."""
    return StepReport(sessions, tokens, sum(map(bool, drafted)), sum(drafted),
                      sum(accepted), _per_position(accepted), take_s, forward_s, commit_s,
                      _per_position(drafted if depths is None else depths))


def _per_position(lengths: Sequence[int]) -> tuple[int, ...]:
    """How many of ``lengths`` reach past each position: [#(n > 0), #(n > 1), ...]."""
    top = max(lengths, default=0)
    if top <= 0:
        return ()
    ending = [0] * (top + 1)  # how many lengths are n, n >= 1 (a step's rows: one pass)
    for n in lengths:
        if n > 0:
            ending[n] += 1
    return tuple(reaching(ending))
