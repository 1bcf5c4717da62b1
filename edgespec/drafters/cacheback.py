"""Cacheback drafting (after Ma, Gim, Zhong 2025): LRU tables of leader n-grams and their recent
followers, drafting by chained look-ups.

Three tables are consulted, narrowest first:
- the session's own (its prompt and every token the verifier confirmed);
- the drafter's (every confirmed token of every session this device served);
- the fleet's: a local mirror of the table the draft cache keeps in Redis, learned from every
  session any device's verifier finished, and pulled in the background by ``FleetSync`` so that
  a look-up never waits on the network.

A look-up takes the longest leader (3, 2, then 1 token) known to any table (the narrowest table
first at equal length) and proposes its most recent follower; the chain stops where no table
knows the tail, or (with only a one-token leader, weak evidence) after ``weak_limit`` tokens.
``mag+cacheback`` tries MaG's longest suffix match within the session first and chains Cacheback
only where it finds none.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import OrderedDict

import numpy as np

from ..config import SamplingParams
from ..protocol.fleet_table import MAX_FOLLOWERS, ORDERS, FleetTable, ngram_pairs
from .base import Branch, Draft, Drafter, DraftSession
from .mag import TokenArray, longest_suffix_match, match_branches

log = logging.getLogger("edgespec.cacheback")

BRANCH_DEPTH = 4  # the most tokens a Cacheback branch holds
# mag+cacheback's suffix match: 2-8 tokens, proposing up to 2 tokens per matched token
MATCH_MAX, MATCH_MIN, MATCH_TOKENS_PER_TOKEN = 8, 2, 2


class NgramTable:
    """leader n-gram -> followers (most recent first), at most ``max_leaders`` leaders (the
    least recently updated or used is forgotten first) of ``max_followers`` followers each."""

    def __init__(self, max_leaders: int = 1 << 16, max_followers: int = MAX_FOLLOWERS):
        if max_leaders < 1 or max_followers < 1:
            raise ValueError("an n-gram table needs room for one leader and one follower")
        self.max_leaders, self.max_followers = max_leaders, max_followers
        self._followers: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._followers)

    def observe(self, tokens: list[int], start: int = 0) -> None:
        with self.lock:
            for leader, follower in ngram_pairs(tokens, start):
                self._put(leader, follower)

    def _put(self, leader: tuple[int, ...], follower: int) -> None:
        table = self._followers
        followers = table.get(leader)
        if followers is None:
            table[leader] = [follower]
            if len(table) > self.max_leaders:
                table.popitem(last=False)
            return
        table.move_to_end(leader)
        if followers[0] != follower:
            if follower in followers:
                followers.remove(follower)
            followers.insert(0, follower)
            del followers[self.max_followers:]

    def replace(self, leader: tuple[int, ...], followers: list[int]) -> None:
        """Take an entry as another table holds it (a fleet pull)."""
        with self.lock:
            table = self._followers
            table[leader] = list(followers[: self.max_followers])
            table.move_to_end(leader)
            if len(table) > self.max_leaders:
                table.popitem(last=False)

    def follower(self, leader: tuple[int, ...]) -> int | None:
        """The most recent follower of ``leader``, or None."""
        with self.lock:
            followers = self._followers.get(leader)
            if not followers:
                return None
            self._followers.move_to_end(leader)
            return followers[0]

    def followers(self, leader: tuple[int, ...]) -> list[int]:
        """The followers of ``leader``, most recent first; a peek (not a use of the leader)."""
        with self.lock:
            return list(self._followers.get(leader, ()))


def next_token(tables: list[NgramTable], tokens: list[int]) -> tuple[int | None, int]:
    """(follower of the longest leader ending ``tokens`` that any table knows, the leader's
    length), the narrower table first at equal length; (None, 0) if none knows one."""
    token, n, _ = _lookup(tables, tokens, peek=False)
    return token, n


def _lookup(tables: list[NgramTable], tokens: list[int], peek: bool
            ) -> tuple[int | None, int, list[int]]:
    """``next_token``'s (token, order), and the followers of the leader and table that gave it,
    most recent first (only when ``peek``: then no table counts the look-up as a use)."""
    for n in ORDERS:
        if len(tokens) >= n:
            leader = tuple(tokens[-n:])
            for table in tables:
                if peek:
                    followers = table.followers(leader)
                    if followers:
                        return followers[0], n, followers
                else:
                    token = table.follower(leader)
                    if token is not None:
                        return token, n, []
    return None, 0, []


class CachebackSession(DraftSession):
    def __init__(self, drafter: "CachebackDrafter", tokens: list[int], params: SamplingParams):
        super().__init__(tokens, params)
        self.drafter = drafter
        self.table = NgramTable(drafter.session_leaders)
        self.table.observe(self.tokens)
        self._verified = len(tokens)  # tokens before this index are confirmed
        self._array = TokenArray()

    def propose(self, k: int) -> Draft:
        out: list[int] = []
        if self.drafter.with_mag and k > 0:
            out = self._suffix_match(k, self._array.of(self.tokens))
        if not out:
            out = self._chain(k)
        self.tokens.extend(out)
        return Draft(tokens=out)

    def propose_tree(self, k: int, width: int) -> Draft:
        if width <= 1:
            return self.propose(k)
        out: list[int] = []
        if self.drafter.with_mag and k > 0:
            arr = self._array.of(self.tokens)
            out = self._suffix_match(k, arr)
            if out:
                branches = match_branches(arr, out, k, MATCH_MAX, MATCH_MIN,
                                          MATCH_TOKENS_PER_TOKEN, width - 1)
        if not out:
            out = self._chain(k)
            branches = self._chain_branches(out, k, width - 1)
        self.tokens.extend(out)
        return Draft(tokens=out, branches=branches)

    def _chain_branches(self, chain: list[int], k: int, max_branches: int) -> list[Branch]:
        """Older followers of the leader behind each of ``chain``'s tokens, continued by peeked
        look-ups; rank 1 (the next most recent) at every position first, then rank 2, ..."""
        d = self.drafter
        tables = [self.table, d.table, d.fleet_mirror]
        ctx = self.tokens[-ORDERS[0]:]
        alternatives: list[list[int]] = []  # per position: the other followers, recent first
        weaks: list[int] = []  # per position: the chain's count of weak leaders there
        weak = 0
        for token in chain:
            _, order, followers = _lookup(tables, ctx, peek=True)
            weak = weak + 1 if order == 1 else 0
            alternatives.append([f for f in dict.fromkeys(followers) if f != token])
            weaks.append(weak)
            ctx = (ctx + [token])[-ORDERS[0]:]
        branches: list[Branch] = []
        for rank in range(max((len(a) for a in alternatives), default=0)):
            for i, alts in enumerate(alternatives):
                if rank < len(alts):
                    before = (self.tokens[-ORDERS[0]:] + chain[:i])[-ORDERS[0]:]
                    tokens = self._continue(tables, before, alts[rank], weaks[i],
                                            min(k - i, BRANCH_DEPTH))
                    branches.append(Branch(i, tuple(tokens)))
                    if len(branches) >= max_branches:
                        return branches
        return branches

    def _continue(self, tables: list[NgramTable], ctx: list[int], first: int, weak: int,
                  limit: int) -> list[int]:
        """``first`` and up to ``limit`` - 1 peeked look-ups after it (the chain's rules)."""
        out = [first]
        ctx = (ctx + [first])[-ORDERS[0]:]
        while len(out) < limit:
            token, order, _ = _lookup(tables, ctx, peek=True)
            if token is None:
                break
            weak = weak + 1 if order == 1 else 0
            if weak > self.drafter.weak_limit:
                break
            out.append(token)
            ctx = (ctx + [token])[-ORDERS[0]:]
        return out

    def _suffix_match(self, k: int, arr: np.ndarray) -> list[int]:
        """MaG's draft after ``arr`` (the session's tokens), or [] without a match."""
        n, p = longest_suffix_match(arr, MATCH_MAX, MATCH_MIN)
        return arr[p + n: p + n + min(k, MATCH_TOKENS_PER_TOKEN * n)].tolist() if n else []

    def _chain(self, k: int) -> list[int]:
        d = self.drafter
        tables = [self.table, d.table, d.fleet_mirror]
        ctx = self.tokens[-ORDERS[0]:]
        out: list[int] = []
        weak = 0
        while len(out) < k:
            token, order = next_token(tables, ctx)
            if token is None:
                break
            weak = weak + 1 if order == 1 else 0
            if weak > d.weak_limit:
                break
            out.append(token)
            ctx = (ctx + [token])[-ORDERS[0]:]
        return out

    def confirm(self, length: int) -> None:
        # everything before ``length`` was confirmed by the verifier: learn it
        if length > self._verified:
            self.table.observe(self.tokens[:length], self._verified)
            self.drafter.table.observe(self.tokens[:length], self._verified)
            self._verified = length

    def rollback(self, length: int) -> None:
        self.confirm(length)  # everything before a fix position was confirmed
        super().rollback(length)
        self._array.cut(length)

    def retract(self, length: int) -> None:
        # a cascade taking back this session's own draft: nothing was confirmed
        DraftSession.rollback(self, length)
        self._array.cut(length)


class CachebackDrafter(Drafter):
    cheap = True

    def __init__(self, fleet: FleetTable | None = None, with_mag: bool = False,
                 session_leaders: int = 1 << 16, drafter_leaders: int = 1 << 18,
                 fleet_leaders: int = 1 << 18, weak_limit: int = 1):
        self.name = "mag+cacheback" if with_mag else "cacheback"
        self.uses_fleet = True
        self.with_mag = with_mag
        self.session_leaders = session_leaders
        self.weak_limit = weak_limit
        self.table = NgramTable(drafter_leaders)
        self.fleet_mirror = NgramTable(fleet_leaders)
        self.fleet = fleet
        self.sync: FleetSync | None = None

    def open(self, tokens: list[int], params: SamplingParams) -> CachebackSession:
        return CachebackSession(self, tokens, params)

    def use_fleet(self, table: FleetTable | None, every_s: float = 1.0) -> None:
        """Pull ``table`` into the fleet mirror in the background, once per ``every_s``
        (None: stop pulling; the mirror keeps what it has)."""
        if self.sync is not None:
            self.sync.stop()
            self.sync = None
        self.fleet = table
        if table is not None:
            self.sync = FleetSync(table, self.fleet_mirror, every_s)
            self.sync.start()

    def snapshot(self):
        with self.table.lock, self.fleet_mirror.lock:
            return copy.deepcopy((self.table._followers, self.fleet_mirror._followers))

    def restore(self, state) -> None:
        own, fleet = copy.deepcopy(state)
        with self.table.lock, self.fleet_mirror.lock:
            self.table._followers, self.fleet_mirror._followers = own, fleet


class FleetSync(threading.Thread):
    """Copies what changed in a ``FleetTable`` into a local ``NgramTable``, in the background;
    a failed pull is retried on the next round (drafting goes on from the mirror as it is)."""

    def __init__(self, source: FleetTable, mirror: NgramTable, every_s: float = 1.0):
        super().__init__(daemon=True, name="cacheback-fleet-sync")
        self.source, self.mirror, self.every_s = source, mirror, every_s
        self.version = 0
        self.pulled = 0  # entries taken so far
        self._stop_event = threading.Event()

    def pull_now(self, max_rounds: int = 64) -> int:
        """Pull until the mirror is up to date (or ``max_rounds`` pieces); entries taken."""
        taken = 0
        for _ in range(max_rounds):
            piece = self.source.pull(self.version)
            if piece.version < self.version and not piece.entries:
                self.version = 0  # the table started over: pull it from the start
                continue
            for e in piece.entries:
                self.mirror.replace(e.leader, list(e.followers))
            taken += len(piece.entries)
            self.version = max(self.version, piece.version)
            if not piece.more:
                break
        self.pulled += taken
        return taken

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self.pull_now()
            except Exception as exc:  # the cache is away: draft from the mirror as it is
                log.debug("fleet table pull failed: %r", exc)
            self._stop_event.wait(self.every_s)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)
