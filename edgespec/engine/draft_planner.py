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
from dataclasses import dataclass

import numpy as np

from .forward_cost import CostModel, ForwardCost

__all__ = ["BatchGains", "CostModel", "ForwardCost", "allocate", "allocate_branches",
           "expected_rate", "probe_every", "wait_worth"]


@dataclass(frozen=True)
class BatchGains:
    """A batch's draft positions as the planner reads them, a row a session."""

    gains: np.ndarray  # [B, K] float: the m-th draft token's expected accepted tokens, 0 past cap
    holds: np.ndarray  # [B, K] float: the chance its draft holds that token when taken, 0 past cap
    caps: np.ndarray  # [B] int: the most draft tokens each session may verify
    betas: np.ndarray | None = None  # [B] float: accepted tokens per branch token verified

    @classmethod
    def of_lists(cls, gains: Sequence[Sequence[float]],
                 holds: Sequence[Sequence[float]] | None = None) -> "BatchGains":
        """From each session's gains (its length is its cap) and holds (None: always held)."""
        caps = np.array([len(g) for g in gains], dtype=np.int64)
        K = int(caps.max(initial=0))
        g_m, h_m = np.zeros((len(caps), K)), np.zeros((len(caps), K))
        for i, c in enumerate(caps):
            g_m[i, :c] = gains[i]
            h_m[i, :c] = 1.0 if holds is None else holds[i][:c]
        return cls(g_m, h_m, caps)

    def cut(self, ks: Sequence[int] | np.ndarray) -> "BatchGains":
        """The same batch with each session's cap cut to ks."""
        caps = np.minimum(self.caps, np.asarray(ks, dtype=np.int64))
        if (caps == self.caps).all():
            return self
        on = np.arange(self.gains.shape[1])[None] < caps[:, None]
        return BatchGains(np.where(on, self.gains, 0.0), np.where(on, self.holds, 0.0), caps,
                          self.betas)


def _batch(gains: "BatchGains | Sequence[Sequence[float]]",
           holds: Sequence[Sequence[float]] | None = None) -> BatchGains:
    return gains if isinstance(gains, BatchGains) else BatchGains.of_lists(gains, holds)


def allocate(gains: BatchGains | Sequence[Sequence[float]], cost: ForwardCost,
             holds: Sequence[Sequence[float]] | None = None) -> list[int]:
    """Draft tokens per session that maximise the next step's expected tokens per second.
    gains[i][m]: the expected accepted tokens of session i's (m+1)-th draft token (its length is
    the session's cap; non-increasing); holds[i][m]: the chance that its draft holds that token
    when taken (None: always); or a ``BatchGains`` holding both. Before any step, every cap."""
    batch = _batch(gains, holds)
    model = cost.model()
    if model is None:
        return batch.caps.tolist()
    rows = len(batch.caps)
    # ndarray methods, not NumPy's functions: a step plans once, and the functions' wrappers
    # cost as much as the sums on these few numbers
    gain = rows + batch.gains.sum(0).cumsum()  # [D]: a token a row + drafts 1..d
    none_holds = (1.0 - batch.holds).prod(0)  # [D]: no row's draft holds a d-th token
    width = 1.0 + (1.0 - none_holds).cumsum()  # [D]: the forward's expected width at d
    rates = np.concatenate([[rows / model.seconds(rows, 1)], gain / model.seconds(rows, width)])
    best = int(rates.argmax())  # the first best: ties go to the narrower forward
    return np.minimum(batch.caps, best).tolist()


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


def expected_rate(gains: BatchGains | Sequence[Sequence[float]], ks: Sequence[int],
                  cost: ForwardCost) -> float | None:
    """The step's expected tokens per second with ks draft tokens a session (None before any
    step)."""
    model = cost.model()
    if model is None:
        return None
    return _rate_of(_batch(gains).cut(ks).gains.sum(1), ks, model)


def _rate_of(own: np.ndarray, ks: Sequence[int], model: CostModel) -> float:
    """The step's expected tokens per second, each session's draft worth own[b] tokens."""
    return (len(ks) + float(own.sum())) / model.seconds(len(ks), 1 + max(ks, default=0))


def wait_worth(gains: BatchGains | Sequence[Sequence[float]], ks: Sequence[int],
               cost: ForwardCost, wait_s: float | Sequence[float]) -> list[float]:
    """How long (at most ``wait_s``, or each session's own) the step should wait for each
    session's draft: its expected tokens' worth in the step's time, G / rate, since a wait
    delays every row by as much (the batch decodes ``rate`` tokens a second as planned). 0
    without a draft; before any step, ``wait_s`` for each with one."""
    k = np.asarray(ks, dtype=np.int64)
    model = cost.model()
    if model is None:
        return np.where(k > 0, wait_s, 0.0).tolist()
    own = _batch(gains).cut(ks).gains.sum(1)  # [B]: each session's expected tokens
    rate = _rate_of(own, ks, model)
    return np.where(k > 0, np.minimum(wait_s, own / rate), 0.0).tolist()


def allocate_branches(betas: Sequence[float] | np.ndarray, caps: Sequence[int],
                      gains: BatchGains | Sequence[Sequence[float]], ks: Sequence[int],
                      cost: ForwardCost) -> list[int]:
    """Branch tokens per session (each at most its cap) on top of chains of ks tokens: the
    width, from the chains' up, that maximises the step's expected tokens per second, filled.
    betas[i]: session i's accepted tokens per branch token verified; a session whose branches
    were never accepted (beta 0) gets none."""
    model = cost.model()
    if model is None:
        return list(caps)
    k, cap, beta = (np.asarray(ks, dtype=np.int64), np.asarray(caps, dtype=np.int64),
                    np.asarray(betas, dtype=float))
    rows, base = len(k), int(k.max(initial=0))
    chains = rows + float(_batch(gains).cut(ks).gains.sum())
    widths = np.arange(base, int((k + cap).max(initial=0)) + 1)  # [W]: draft nodes a row
    filled = np.where(beta[None] > 0, np.minimum(cap[None], widths[:, None] - k[None]), 0)
    gain = chains + (filled * beta[None]).sum(1)  # [W]
    rates = gain / model.seconds(rows, 1 + widths)
    return filled[int(np.argmax(rates))].tolist()
