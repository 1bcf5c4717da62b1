"""How many draft tokens each session should verify in the next step, from measured costs.

A verification forward runs B rows padded to the widest, W = 1 + the most draft tokens of a row:
it costs about ``fixed + per_row * B + per_token * B * W`` seconds (``forward_cost``: fitted on
the steps the engine ran). So a draft token is paid for by the width it adds to every row, not by
itself: one session drafting 4 tokens in a batch of 8 costs 32 token-rows. A session's m-th draft
token is worth S(m) expected tokens (``DraftLength.gains``: the chance that it and the ones before
it are accepted, measured). ``allocate`` picks the width D of drafts (0..the longest cap) that
maximises the step's expected tokens per second, B + sum over sessions of S(1..min(D, cap)), over
the forward's seconds; every session then drafts min(D, cap) tokens (within the width, free). A
board slower than the steps holds fewer tokens than asked when the step takes its draft: S then
counts only the tokens it holds, and the forward is as wide as the longest draft taken
(``holds``: the chance that a session's draft holds its m-th token; the expected width counts
position m with the chance that some row holds it, 1 - prod(1 - holds_i(m)), the rows taken as
independent). So a batch whose drafts are rarely accepted is decoded plainly (D = 0: no wider
forward, no wait), and drafts shrink as a batch grows or a token gets dearer.

Token trees the same way (``allocate_branches``): after the chains, a session's branch tokens are
worth beta expected tokens each (its measured accepted branch tokens per branch token); a width
that raises the step's expected tokens per second is filled with them. A batch planned without
drafts is probed now and then, as rarely as keeps the probes' cost within 2% of the steps' time
(``probe_every``). ``wait_worth``: how long a session's draft is worth the step waiting for it
(its expected tokens against what the whole batch loses while it waits).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .forward_cost import CostModel, ForwardCost

__all__ = ["CostModel", "ForwardCost", "allocate", "allocate_branches", "expected_rate",
           "probe_every", "wait_worth"]


def _rate(model: CostModel, gain: float, rows: int, width: float) -> float:
    return gain / model.seconds(rows, width)


def allocate(gains: Sequence[Sequence[float]], cost: ForwardCost,
             holds: Sequence[Sequence[float]] | None = None) -> list[int]:
    """Draft tokens per session that maximise the next step's expected tokens per second.
    gains[i][m]: the expected accepted tokens of session i's (m+1)-th draft token (its length is
    the session's cap; non-increasing); holds[i][m]: the chance that its draft holds that token
    when taken (None: always). Before any step, every cap."""
    model = cost.model()
    caps = [len(g) for g in gains]
    if model is None:
        return caps
    rows = len(gains)
    holds = holds if holds is not None else [[1.0] * c for c in caps]
    width = 1.0  # the forward's expected width at the draft width tried
    gain, best, best_rate = float(rows), 0, _rate(model, rows, rows, 1)  # a token a row
    for d in range(1, max(caps, default=0) + 1):
        none_holds = 1.0  # the chance that no row's draft holds a d-th token
        for g, h in zip(gains, holds):
            if len(g) >= d:
                gain += g[d - 1]
                none_holds *= 1.0 - h[d - 1]
        width += 1.0 - none_holds
        r = _rate(model, gain, rows, width)
        if r > best_rate:
            best, best_rate = d, r
    return [min(c, best) for c in caps]


PROBE_SHARE = 0.02  # of the steps' time, what probing a batch without drafts may cost
MIN_PROBE_EVERY = 8


def probe_every(cost: ForwardCost, rows: int, width: int) -> int:
    """Steps between two probes of a batch planned without drafts: a probe widens every row by
    ``width`` tokens, so it comes once in as many steps as keep its cost within PROBE_SHARE of
    theirs, and never more often than every MIN_PROBE_EVERY-th (before any step: that)."""
    model = cost.model()
    if model is None or rows <= 0:
        return MIN_PROBE_EVERY
    probe_s = model.per_token * rows * width
    return max(MIN_PROBE_EVERY, math.ceil(probe_s / (PROBE_SHARE * model.seconds(rows, 1))))


def expected_rate(gains: Sequence[Sequence[float]], ks: Sequence[int], cost: ForwardCost
                  ) -> float | None:
    """The step's expected tokens per second with ks draft tokens a session (None before any
    step)."""
    model = cost.model()
    if model is None:
        return None
    gain = len(ks) + sum(sum(g[:k]) for g, k in zip(gains, ks))
    return _rate(model, gain, len(ks), 1 + max(ks, default=0))


def wait_worth(gains: Sequence[Sequence[float]], ks: Sequence[int], cost: ForwardCost,
               wait_s: float) -> list[float]:
    """How long (at most ``wait_s``) the step should wait for each session's draft: its
    expected tokens' worth in the step's time, G / rate, since a wait delays every row by as
    much (the batch decodes ``rate`` tokens a second as planned). 0 without a draft; before any
    step, ``wait_s`` for each with one."""
    rate = expected_rate(gains, ks, cost)
    return [0.0 if k <= 0 else wait_s if rate is None else min(wait_s, sum(g[:k]) / rate)
            for g, k in zip(gains, ks)]


def allocate_branches(betas: list[float], caps: list[int], gains: Sequence[Sequence[float]],
                      ks: list[int], cost: ForwardCost) -> list[int]:
    """Branch tokens per session (each at most its cap) on top of chains of ks tokens: the
    width, from the chains' up, that maximises the step's expected tokens per second, filled.
    betas[i]: session i's accepted tokens per branch token verified; a session whose branches
    were never accepted (beta 0) gets none."""
    model = cost.model()
    if model is None:
        return list(caps)
    rows, base = len(ks), max(ks, default=0)
    chains = rows + sum(sum(g[:k]) for g, k in zip(gains, ks))

    def filled(width: int) -> list[int]:  # width: draft nodes a row
        return [min(c, width - k) if b > 0 else 0 for b, c, k in zip(betas, caps, ks)]

    best, best_rate = base, 0.0
    for width in range(base, max((k + c for k, c in zip(ks, caps)), default=0) + 1):
        gain = chains + sum(b * n for b, n in zip(betas, filled(width)))
        r = _rate(model, gain, rows, 1 + width)
        if r > best_rate:
            best, best_rate = width, r
    return filled(best)
