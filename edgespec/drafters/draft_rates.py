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
# the columns of a row's scalars (``DraftRates._data``); its positions' columns from _POSITIONS
_CHAIN_HITS, _CHAIN_TRIALS, _BRANCH_HITS, _BRANCH_TRIALS, _HELD_TRIALS, _POSITIONS = range(6)


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
        # one row of floats a session, so that a batch reads and writes it in one gather and
        # one scatter (a NumPy call on these few numbers costs more than its arithmetic):
        # [chain hits, chain trials, branch hits, branch trials, held trials, at hits x K,
        # at trials x K, held hits x K]; the properties below are views of its columns
        self._data = np.empty((n, _POSITIONS + 3 * K))
        self._at, self._tried, self._held = (slice(_POSITIONS + i * K, _POSITIONS + (i + 1) * K)
                                             for i in range(3))
        self.k = np.empty(n, dtype=np.int64)  # [R]: the next draft's length
        self.generation = np.zeros(n, dtype=np.int64)  # [R]: resets of the row (a new session)
        # [K + 1, K]: row m holds positions 0..m-1 (a batch's "position j < m[b]" masks,
        # gathered: a broadcast comparison costs several times a gather on these shapes)
        self._below = np.arange(K + 1)[:, None] > np.arange(K)[None]
        self._below_ones = self._below.astype(np.float64)  # the same as 1.0 and 0.0
        # [K + 1, 2K]: for ``update``'s positions' hits and trials side by side (``_at``, then
        # ``_tried``): row m tests positions 0..m-1 of both; adds 1.0 to the hits of 0..m-1
        # and to every trial (masked by the test)
        self._tested = np.concatenate([self._below, self._below], 1)
        self._passed_or_tried = np.concatenate([self._below_ones, np.ones((K + 1, K))], 1)
        # [2(K + 1)]: the next length after a draft of length k, index k after a rejection,
        # K + 1 + k after a full accept (the schedule: 1 shorter, or 2 longer)
        lengths = np.arange(K + 1)
        self._k_next = np.concatenate([np.maximum(k_min, lengths - 1),
                                       np.minimum(k_max, lengths + 2)])
        # a new session's row: the chain's prior, no position tested yet, every position's
        # supply held from one trial, the branches' prior
        self._prior = np.zeros(_POSITIONS + 3 * K)
        self._prior[[_CHAIN_HITS, _CHAIN_TRIALS]] = prior_alpha * prior_trials, prior_trials
        self._prior[self._held] = 1.0
        self._prior[_HELD_TRIALS] = 1.0
        self._prior[[_BRANCH_HITS, _BRANCH_TRIALS]] = (BRANCH_PRIOR[0] * BRANCH_PRIOR[1],
                                                        BRANCH_PRIOR[1])
        self.reset(np.arange(n))

    @property
    def rows(self) -> int:
        return len(self.k)

    # views of ``_data``'s columns (properties, so that a copy of the table has its own)
    @property
    def chain_hits(self) -> np.ndarray:  # [R]: decayed accepted draft tokens
        return self._data[:, _CHAIN_HITS]

    @property
    def chain_trials(self) -> np.ndarray:  # [R]: decayed tests of a draft token
        return self._data[:, _CHAIN_TRIALS]

    @property
    def branch_hits(self) -> np.ndarray:  # [R]: decayed accepted branch tokens
        return self._data[:, _BRANCH_HITS]

    @property
    def branch_trials(self) -> np.ndarray:  # [R]: decayed verified branch tokens
        return self._data[:, _BRANCH_TRIALS]

    @property
    def held_trials(self) -> np.ndarray:  # [R]: a supply's trials (the same at every position)
        return self._data[:, _HELD_TRIALS]

    @property
    def at_hits(self) -> np.ndarray:  # [R, K]: each position's own accepted tests
        return self._data[:, self._at]

    @property
    def at_trials(self) -> np.ndarray:  # [R, K]: each position's own tests
        return self._data[:, self._tried]

    @property
    def held_hits(self) -> np.ndarray:  # [R, K]: each position's takes that held it
        return self._data[:, self._held]

    def reset(self, rows: np.ndarray | int, k_init: int | None = None) -> None:
        """Rows back to the priors (a new session in the slot)."""
        k = self.k_max if k_init is None else max(self.k_min, min(self.k_max, k_init))
        self._data[rows] = self._prior  # one write of the priors' row (``__init__``)
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
        return self.gains_holds(rows, ks)[1]

    def gains(self, rows: np.ndarray, ks: np.ndarray) -> np.ndarray:
        """[B, max(ks)]: the expected accepted tokens of row b's 1st..ks[b]-th draft token
        (``adaptive.DraftLength.gains``), 0 past ks[b]; non-increasing along a row."""
        return self.gains_holds(rows, ks)[0]

    def gains_holds(self, rows: np.ndarray, ks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``gains`` and ``holds`` at once (the gains are weighed by the holds)."""
        ks = np.minimum(ks, self.k_max)
        width = int(ks.max(initial=0))
        # ``take``: a row gather in a fraction of fancy indexing's time on these small arrays
        b = self._data.take(rows, 0)  # [B, C]
        held_from, at_from, tried_from = self._held.start, self._at.start, self._tried.start
        supply = b[:, held_from:held_from + width] / b[:, _HELD_TRIALS, None]
        held = np.minimum.accumulate(supply, axis=1) if width else supply
        held *= self._below_ones.take(ks, 0)[:, :width]  # 0 past ks[b] (supplies are >= 0)
        alpha = b[:, _CHAIN_HITS, None] / b[:, _CHAIN_TRIALS, None]
        rate = (b[:, at_from:at_from + width] + POSITION_PRIOR * alpha) / \
            (b[:, tried_from:tried_from + width] + POSITION_PRIOR)
        return rate.cumprod(1) * held, held

    def supplied(self, rows: np.ndarray, asked: np.ndarray, got: np.ndarray) -> None:
        """Record takes: row b asked ``asked[b]`` draft tokens, its draft held ``got[b]``. The
        positions not asked for are taken to hold as the last one asked did (so that a few
        short takes do not cap a session's width for good: the positions past them are never
        asked); a row that asked nothing says nothing."""
        if np.count_nonzero(asked) < len(asked):
            on = asked > 0
            rows, asked, got = rows[on], asked[on], got[on]
            if not len(rows):
                return
        K = self.k_max
        b = self._data.take(rows, 0)  # [B, C]
        hits = b[:, self._held]  # [B, K] (a view of b)
        trials = DECAY * b[:, _HELD_TRIALS] + 1.0  # [B]: every position, one more trial
        asked = np.minimum(asked, K)  # [B]: the positions asked (the last: asked - 1)
        last_rate = (DECAY * b[np.arange(len(rows)), self._held.start - 1 + asked] +
                     (asked <= got)) / trials
        held = np.where(self._below.take(asked, 0), self._below_ones.take(np.minimum(got, K), 0),
                        last_rate[:, None])  # held where asked, else as the last asked
        hits *= DECAY
        hits += held
        b[:, _HELD_TRIALS] = trials
        self._data[rows] = b

    def update(self, rows: np.ndarray, drafted: np.ndarray, accepted: np.ndarray) -> None:
        """Record verifications: row b verified ``drafted[b]`` draft tokens, of which
        ``accepted[b]`` passed (a rejection ends a test: positions past the first miss get no
        trial); its next length follows the schedule. A row that drafted nothing: unchanged."""
        if np.count_nonzero(drafted) < len(drafted):
            on = drafted > 0
            rows, drafted, accepted = rows[on], drafted[on], accepted[on]
            if not len(rows):
                return
        K = self.k_max
        b = self._data.take(rows, 0)  # [B, C]
        chain = b[:, _CHAIN_HITS:_CHAIN_TRIALS + 1]  # [B, 2]: hits, trials (a view of b)
        chain *= DECAY
        chain += accepted[:, None]
        b[:, _CHAIN_TRIALS] += accepted < drafted  # a miss: one more trial
        # the positions' hits and trials side by side, each tested up to the first miss
        tested = self._tested.take(np.minimum(np.minimum(drafted, accepted + 1), K), 0)
        positions = b[:, self._at.start:self._tried.stop]  # [B, 2K] (a view of b)
        added = self._passed_or_tried.take(np.minimum(accepted, K), 0)  # [B, 2K]
        np.copyto(positions, DECAY * positions + added, where=tested)
        self._data[rows] = b
        if self.adaptive:
            full = self.k.take(rows) + (K + 1) * (accepted == drafted)
            self.k[rows] = self._k_next.take(full)

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
                [(first, np.array([dl.row for dl in lengths], dtype=np.int64),
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


