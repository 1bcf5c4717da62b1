"""The draft-length state of many sessions at once, a row a session, as arrays.

What ``adaptive.DraftLength`` learns of one session (the chain's acceptance, each position's
own rate, each position's supply, the branches' rate, the next draft length) is kept here for
all of the engine's sessions together, row r for the session in KV slot r, so that a step reads
every session's expected gains in a few array operations and records every verdict in one
(vLLM's persistent batch: the sessions' state in arrays, updated together). A ``DraftLength``
is a view of one row; the engine's planner and commit read and write whole batches
(``gains``, ``holds``, ``supplied``, ``update``, ``update_branches``).

The rates are decayed successes per trial (``DECAY``: each verification weighs that much less
than the next one), element by element, so a row's figures do not depend on the batch it was
recorded in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

DECAY = 0.85  # each verification's weight relative to the next one's
POSITION_PRIOR = 2.0  # trials of alpha a position's own rate starts from
BRANCH_PRIOR = (0.1, 5.0)  # accepted branch tokens per branch token, and its weight in trials


class DraftRates:
    """Rows of sessions' draft-length state: ``rows`` sessions drafting up to ``k_max`` tokens.
    The schedule of the next length (``k``) is transformers' heuristic: 2 longer after a full
    accept, 1 shorter after a rejection, within [k_min, k_max] (fixed with ``adaptive=False``).
    """

    def __init__(self, rows: int, k_max: int, k_min: int = 1, adaptive: bool = True,
                 prior_alpha: float = 0.5, prior_trials: float = 2.0):
        if not 1 <= k_min <= k_max:
            raise ValueError(f"need 1 <= k_min <= k_max, got {k_min}, {k_max}")
        self.k_min, self.k_max, self.adaptive = k_min, k_max, adaptive
        self.prior_alpha, self.prior_trials = prior_alpha, prior_trials
        n, K = rows, k_max
        self.chain_hits, self.chain_trials = np.empty(n), np.empty(n)  # [R]
        self.at_hits, self.at_trials = np.empty((n, K)), np.empty((n, K))  # [R, K]
        self.held_hits, self.held_trials = np.empty((n, K)), np.empty((n, K))  # [R, K]
        self.branch_hits, self.branch_trials = np.empty(n), np.empty(n)  # [R]
        self.k = np.empty(n, dtype=np.int64)  # [R]: the next draft's length
        self.generation = np.zeros(n, dtype=np.int64)  # [R]: resets of the row (a new session)
        self._positions = np.arange(K)[None]  # [1, K]
        self.reset(np.arange(n))

    @property
    def rows(self) -> int:
        return len(self.k)

    def reset(self, rows: np.ndarray | int, k_init: int | None = None) -> None:
        """Rows back to the priors (a new session in the slot)."""
        k = self.k_max if k_init is None else max(self.k_min, min(self.k_max, k_init))
        self.chain_hits[rows] = self.prior_alpha * self.prior_trials
        self.chain_trials[rows] = self.prior_trials
        self.at_hits[rows] = 0.0  # a position's own rate: its hits and trials
        self.at_trials[rows] = 0.0
        self.held_hits[rows] = 1.0  # a position's supply: held when asked, from one trial
        self.held_trials[rows] = 1.0
        self.branch_hits[rows] = BRANCH_PRIOR[0] * BRANCH_PRIOR[1]
        self.branch_trials[rows] = BRANCH_PRIOR[1]
        self.k[rows] = k
        self.generation[rows] += 1

    def alpha(self, rows: np.ndarray) -> np.ndarray:
        """[B]: each row's chance that its next draft token is accepted."""
        return self.chain_hits[rows] / self.chain_trials[rows]

    def beta(self, rows: np.ndarray) -> np.ndarray:
        """[B]: accepted tokens per branch token verified."""
        return self.branch_hits[rows] / self.branch_trials[rows]

    def holds(self, rows: np.ndarray, ks: np.ndarray) -> np.ndarray:
        """[B, max(ks)]: the chance that row b's draft holds its 1st..ks[b]-th token when taken
        (non-increasing along a row), 0 past ks[b] (ks cut to k_max)."""
        ks = np.minimum(ks, self.k_max)
        width = int(ks.max(initial=0))
        # ``take``: a row gather in a fraction of fancy indexing's time on these small arrays
        supply = self.held_hits.take(rows, 0)[:, :width] / self.held_trials.take(rows, 0)[:, :width]
        held = np.minimum.accumulate(supply, axis=1) if width else supply
        return np.where(np.arange(width)[None] < ks[:, None], held, 0.0)

    def gains(self, rows: np.ndarray, ks: np.ndarray) -> np.ndarray:
        """[B, max(ks)]: the expected accepted tokens of row b's 1st..ks[b]-th draft token
        (``adaptive.DraftLength.gains``), 0 past ks[b]; non-increasing along a row."""
        return self.gains_holds(rows, ks)[0]

    def gains_holds(self, rows: np.ndarray, ks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``gains`` and ``holds`` at once (the gains are weighed by the holds)."""
        held = self.holds(rows, ks)
        width = held.shape[1]
        alpha = self.alpha(rows)[:, None]
        rate = (self.at_hits.take(rows, 0)[:, :width] + POSITION_PRIOR * alpha) / \
            (self.at_trials.take(rows, 0)[:, :width] + POSITION_PRIOR)
        return rate.cumprod(1) * held, held

    def supplied(self, rows: np.ndarray, asked: np.ndarray, got: np.ndarray) -> None:
        """Record takes: row b asked ``asked[b]`` draft tokens, its draft held ``got[b]``. The
        positions not asked for are taken to hold as the last one asked did (so that a few
        short takes do not cap a session's width for good: the positions past them are never
        asked); a row that asked nothing says nothing."""
        if not asked.all():
            on = asked > 0
            rows, asked, got = rows[on], asked[on], got[on]
            if not len(rows):
                return
        j = self._positions
        asked_j = j < asked[:, None]
        hits = self.held_hits.take(rows, 0)
        trials = DECAY * self.held_trials.take(rows, 0) + 1.0  # every position: one more trial
        last = np.minimum(asked, self.k_max) - 1  # [B]: the last position asked
        at = np.arange(len(rows))
        last_rate = (DECAY * hits[at, last] + (last < got)) / trials[at, last]
        self.held_hits[rows] = DECAY * hits + np.where(asked_j, j < got[:, None],
                                                       last_rate[:, None])
        self.held_trials[rows] = trials

    def update(self, rows: np.ndarray, drafted: np.ndarray, accepted: np.ndarray) -> None:
        """Record verifications: row b verified ``drafted[b]`` draft tokens, of which
        ``accepted[b]`` passed (a rejection ends a test: positions past the first miss get no
        trial); its next length follows the schedule. A row that drafted nothing: unchanged."""
        if not drafted.all():
            on = drafted > 0
            rows, drafted, accepted = rows[on], drafted[on], accepted[on]
            if not len(rows):
                return
        self.chain_hits[rows] = DECAY * self.chain_hits[rows] + accepted
        self.chain_trials[rows] = DECAY * self.chain_trials[rows] + accepted + \
            (accepted < drafted)
        j = self._positions
        tried = (j < drafted[:, None]) & (j <= accepted[:, None])
        hits, trials = self.at_hits.take(rows, 0), self.at_trials.take(rows, 0)
        self.at_hits[rows] = np.where(tried, DECAY * hits + (j < accepted[:, None]), hits)
        self.at_trials[rows] = np.where(tried, DECAY * trials + 1.0, trials)
        if self.adaptive:
            k = self.k[rows]
            self.k[rows] = np.where(accepted == drafted, np.minimum(self.k_max, k + 2),
                                    np.maximum(self.k_min, k - 1))

    def update_branches(self, rows: np.ndarray, verified: np.ndarray,
                        accepted: np.ndarray) -> None:
        """Record verifications of ``verified[b]`` branch tokens, ``accepted[b]`` taken."""
        if not verified.any():
            return
        on = verified > 0
        rows = rows[on]
        self.branch_hits[rows] = DECAY * self.branch_hits[rows] + accepted[on]
        self.branch_trials[rows] = DECAY * self.branch_trials[rows] + verified[on]


class HasRow(Protocol):
    """What ``RowsOf`` reads of a session's draft length: its table and row."""

    table: DraftRates
    row: int


class RowsOf:
    """Sessions' rows grouped by the table holding them, for a batch call: the engine's
    sessions share one table; a test may hand sessions with tables of their own."""

    def __init__(self, lengths: Sequence[HasRow]):
        first = lengths[0].table if lengths else None
        if all(dl.table is first for dl in lengths):
            self.groups = [] if first is None else \
                [(first, np.fromiter((dl.row for dl in lengths), np.int64, len(lengths)),
                  np.arange(len(lengths)))]
            return
        by: dict[int, tuple[DraftRates, list[int], list[int]]] = {}
        for i, dl in enumerate(lengths):
            _, rows, at = by.setdefault(id(dl.table), (dl.table, [], []))
            rows.append(dl.row)
            at.append(i)
        self.groups = [(t, np.array(r, dtype=np.int64), np.array(at, dtype=np.int64))
                       for t, r, at in by.values()]

    def values(self, n: int, what: str) -> np.ndarray:
        """[n]: each session's ``k`` (its next draft length), ``alpha`` or ``beta``."""
        def read(table: DraftRates, rows: np.ndarray) -> np.ndarray:
            got = getattr(table, what)
            return got(rows) if callable(got) else got[rows]

        if len(self.groups) == 1:
            return read(*self.groups[0][:2])
        out = None
        for table, rows, at in self.groups:
            part = read(table, rows)
            if out is None:
                out = np.empty(n, dtype=part.dtype)
            out[at] = part
        return out if out is not None else np.zeros(0, dtype=np.int64)

    def gains_holds(self, n: int, ks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[n, max(ks)] each: the sessions' ``DraftRates.gains`` and ``holds`` at ``ks``, in
        the sessions' order."""
        if len(self.groups) == 1:
            table, rows, _ = self.groups[0]
            return table.gains_holds(rows, ks)
        width = int(ks.max(initial=0))
        gains, holds = np.zeros((n, width)), np.zeros((n, width))
        for table, rows, at in self.groups:
            g, h = table.gains_holds(rows, ks[at])
            gains[at, :g.shape[1]], holds[at, :h.shape[1]] = g, h
        return gains, holds

    def record(self, what: str, *values: np.ndarray) -> None:
        """Each group's ``supplied``, ``update`` or ``update_branches`` with ``values`` (one
        array per argument, in the sessions' order)."""
        if len(self.groups) == 1:  # in the sessions' order already
            table, rows, _ = self.groups[0]
            getattr(table, what)(rows, *values)
            return
        for table, rows, at in self.groups:
            getattr(table, what)(rows, *(v[at] for v in values))


