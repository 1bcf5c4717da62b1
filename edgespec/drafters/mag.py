"""MaG, the max-gram drafter (after CS-Drafting's statistical bottom drafter).

Propose: find the longest suffix of the session's tokens (up to ``max_ngram``) that also occurs
earlier in the prompt or output, and propose the tokens that followed its most recent earlier
occurrence. Output that copies its input (summaries, RAG answers, code edits, translations of
names) is drafted almost for free.

Fallback: when no suffix of length >= ``min_ngram`` matches, chain a bigram table: for each token,
its most frequent follower. The table is learned by the drafter itself, across all of its
sessions: it counts the token pairs of every prompt it opens and of every stretch of output the
verifier confirmed (the tokens before a fix). So a device that serves many requests of one kind
learns that kind's frequent continuations. A bigram is proposed only when that follower made up
at least ``bigram_min_share`` of the token's observed followers, so rare guesses cost no
verification width. The table is bounded, however long the drafter lives: at most
``max_bigram_leaders`` tokens (the least recently seen is forgotten first), each with at most
``max_bigram_followers`` followers (a new follower replaces the least counted one).

Drafting only where acceptance is likely: a suffix match of n tokens proposes at most
``n * tokens_per_match_token`` tokens, so a one-token match (weak evidence) sends a short draft
and a long match a long one.

Token trees (``propose_tree``): the chain is ``propose``'s. Its branches are the other earlier
occurrences of a suffix match (any length from ``max_ngram`` down to ``min_ngram``; longer
matches first, then the more recent) whose continuation, limited like a chain from a match of
that length, differs from the chain's: a branch starts at the first differing position and holds
the rest of that continuation. In the bigram fallback, a position's branch is its leader's most
frequent follower other than the chain's token (one token), offered when its share is at least
half ``bigram_min_share``, one per position, the first positions first.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import numpy as np

from ..config import SamplingParams
from .base import Branch, Draft, Drafter, DraftSession


class _Followers:
    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}  # at most max_followers entries
        self.total = 0  # every observation, evicted followers' included


class BigramTable:
    """Follower counts per leader token, bounded: at most ``max_leaders`` leaders (least recently
    used evicted) and ``max_followers`` followers per leader (least counted evicted)."""

    def __init__(self, max_leaders: int = 16384, max_followers: int = 8) -> None:
        if max_leaders < 1 or max_followers < 1:
            raise ValueError("a bigram table needs room for at least one leader and follower")
        self.max_leaders, self.max_followers = max_leaders, max_followers
        self._followers: OrderedDict[int, _Followers] = OrderedDict()

    def __len__(self) -> int:
        return len(self._followers)

    def observe(self, tokens: list[int]) -> None:
        table = self._followers
        for a, b in zip(tokens, tokens[1:]):
            entry = table.get(a)
            if entry is None:
                entry = table[a] = _Followers()
                if len(table) > self.max_leaders:
                    table.popitem(last=False)
            else:
                table.move_to_end(a)
            counts = entry.counts
            if b in counts:
                counts[b] += 1
            else:
                if len(counts) >= self.max_followers:
                    del counts[min(counts, key=counts.__getitem__)]
                counts[b] = 1
            entry.total += 1

    def followers(self, token: int) -> dict[int, int]:
        entry = self._followers.get(token)
        return dict(entry.counts) if entry else {}

    def best(self, token: int) -> tuple[int | None, float]:
        """(most frequent follower, its share of observed followers), or (None, 0)."""
        entry = self._followers.get(token)
        if entry is None or not entry.counts:
            return None, 0.0
        self._followers.move_to_end(token)
        nxt = max(entry.counts, key=entry.counts.__getitem__)
        return nxt, entry.counts[nxt] / entry.total

    def runner_up(self, token: int, besides: int) -> tuple[int | None, float]:
        """(the most frequent follower of ``token`` other than ``besides``, its share), or
        (None, 0). A peek: unlike ``best`` it does not count as a use of the leader."""
        entry = self._followers.get(token)
        rest = {t: c for t, c in entry.counts.items() if t != besides} if entry else {}
        if entry is None or not rest:
            return None, 0.0
        nxt = max(rest, key=rest.__getitem__)
        return nxt, rest[nxt] / entry.total


class TokenArray:
    """A session's tokens as a NumPy array kept beside its list, extended by what was appended
    since the last read: a suffix match reads the whole context each chunk, and turning a
    1,000-token list into an array cost 31 us a chunk, six times the match itself. The session
    tells it of a rollback (``cut``: both of its rollbacks do); a list changed behind its back
    is read again whole when that shows in its last mirrored token, and only then."""

    def __init__(self) -> None:
        self._buf = np.empty(256, dtype=np.int64)
        self._n = 0  # leading entries that mirror the list

    def cut(self, length: int) -> None:
        """The list was cut to ``length`` tokens."""
        self._n = min(self._n, length)

    def of(self, tokens: list[int]) -> np.ndarray:
        """[len(tokens)] int64: ``tokens``, a view valid until the next call."""
        n = len(tokens)
        if self._n > n or (self._n and self._buf[self._n - 1] != tokens[self._n - 1]):
            self._n = 0
        if n > len(self._buf):
            grown = np.empty(max(n, 2 * len(self._buf)), dtype=np.int64)
            grown[:self._n] = self._buf[:self._n]
            self._buf = grown
        if n > self._n:
            self._buf[self._n:n] = tokens[self._n:n]
        self._n = n
        return self._buf[:n]


SCAN_CANDIDATES = 16  # up to this many earlier places of the last token: one by one


def longest_suffix_match(arr: np.ndarray, max_ngram: int, min_ngram: int) -> tuple[int, int]:
    """(n, p): the longest n in [min_ngram, max_ngram] such that the last n tokens of ``arr``
    occur earlier at ``p`` (most recent such p, with at least one token after it), else (0, -1).

    The candidates are the earlier positions holding the last token. A few (a context that
    repeats itself: MaG's case) are compared one by one, most recent first, stopping at the first
    run of ``max_ngram`` tokens or where no earlier run could be longer. Many are narrowed
    together, token by token backwards to those whose run still matches (a handful of small
    vector operations whatever ``max_ngram``, not one scan of ``arr`` per length)."""
    length = len(arr)
    top = min(max_ngram, length - 1)
    if top < min_ngram:
        return 0, -1
    ends = (arr[: length - 1] == arr[length - 1]).nonzero()[0]  # the match's last token at e
    n, end = (_match_one_by_one if len(ends) <= SCAN_CANDIDATES else _match_together)(
        arr, ends, top)
    if n < min_ngram:
        return 0, -1
    return n, end - n + 1


def _match_one_by_one(arr: np.ndarray, ends: np.ndarray, top: int) -> tuple[int, int]:
    """(the longest run, capped at ``top``, of tokens ending at a candidate e that equals the
    same run ending ``arr``; the most recent e with it), or (0, -1) without candidates."""
    suffix = arr[len(arr) - top:].tolist()[::-1]  # suffix[m] = arr[-1 - m]
    n, end = 0, -1
    for e in reversed(ends.tolist()):
        if e + 1 <= n:  # ascending candidates: no earlier run can be longer
            break
        window = arr[max(0, e - top + 1): e + 1].tolist()[::-1]  # window[m] = arr[e - m]
        m = 1  # window[0] == suffix[0]: a candidate holds the last token
        while m < len(window) and window[m] == suffix[m]:
            m += 1
        if m > n:
            n, end = m, e
            if n == top:
                break
    return n, end


def _match_together(arr: np.ndarray, ends: np.ndarray, top: int) -> tuple[int, int]:
    """``_match_one_by_one``'s answer, every candidate narrowed at once."""
    length = len(arr)
    n, end = 0, -1
    for m in range(top):
        if m:
            ends = ends[ends >= m]  # a token at e - m to compare
            ends = ends[arr[ends - m] == arr[length - 1 - m]]
        if ends.size == 0:
            break
        n, end = m + 1, int(ends[-1])  # ascending: the last is the most recent
    return n, end


def match_branches(arr: np.ndarray, chain: list[int], k: int, max_ngram: int, min_ngram: int,
                   tokens_per_match_token: int, max_branches: int) -> list[Branch]:
    """Alternatives to ``chain`` (the draft after ``arr``) from the other earlier occurrences of
    a suffix of ``arr`` of n in [min_ngram, max_ngram] tokens: each occurrence's continuation
    (at most min(k, n * tokens_per_match_token) tokens) that differs from the chain gives a
    branch from its first differing position on. Longer matches first, then the more recent;
    one branch per (position, first token); at most ``max_branches``."""
    length, depth = len(arr), len(chain)
    top = min(max_ngram, length - 1)
    if max_branches <= 0 or depth == 0 or top < min_ngram:
        return []
    # run[j]: how many tokens ending at j equal the same number ending arr (j < length - 1, so
    # a continuation follows), capped at max_ngram
    alive = np.ones(length - 1, dtype=bool)
    run = np.zeros(length - 1, dtype=np.int64)
    for m in range(top):
        alive[:m] = False  # no token at j - m
        alive[m:] &= arr[: length - 1 - m] == arr[length - 1 - m]
        if not alive.any():
            break
        run += alive
    found = np.flatnonzero(run >= min_ngram)
    if found.size == 0:
        return []
    n = run[found]
    order = np.lexsort((-found, -n))  # longest match first, then most recent
    found, n = found[order], n[order]
    limits = np.minimum(k, n * tokens_per_match_token)
    # continuations as rows, compared with the chain where both have a token
    steps = np.arange(depth)
    at = found[:, None] + 1 + steps
    valid = (at < length) & (steps < limits[:, None])
    conts = np.where(valid, arr[np.minimum(at, length - 1)], -1)
    differs = valid & (conts != np.asarray(chain, dtype=arr.dtype))
    first = differs.argmax(axis=1)
    branches: list[Branch] = []
    seen: set[tuple[int, int]] = set()
    for row in np.flatnonzero(differs.any(axis=1)):
        i, start = int(first[row]), int(found[row]) + 1
        tokens = arr[start + i: start + int(limits[row])].tolist()
        if (i, tokens[0]) in seen:
            continue
        seen.add((i, tokens[0]))
        branches.append(Branch(i, tuple(tokens)))
        if len(branches) >= max_branches:
            break
    return branches


class MaGSession(DraftSession):
    def __init__(self, drafter: "MaGDrafter", tokens: list[int], params: SamplingParams):
        super().__init__(tokens, params)
        self.drafter = drafter
        self._verified = len(tokens)  # tokens before this index are confirmed (prompt/committed)
        self._array = TokenArray()

    def propose(self, k: int) -> Draft:
        out, _ = self._chain(k, self._array.of(self.tokens))
        self.tokens.extend(out)
        return Draft(tokens=out)

    def propose_tree(self, k: int, width: int) -> Draft:
        if width <= 1:
            return self.propose(k)
        d = self.drafter
        arr = self._array.of(self.tokens)
        out, matched = self._chain(k, arr)
        if matched:
            branches = match_branches(arr, out, k, d.max_ngram, d.min_ngram,
                                      d.tokens_per_match_token, width - 1)
        else:
            branches = []
            for i, token in enumerate(out[: width - 1]):
                leader = out[i - 1] if i else self.tokens[-1]
                alt, share = d.bigrams.runner_up(leader, token)
                if alt is not None and share >= d.bigram_min_share / 2:
                    branches.append(Branch(i, (alt,)))
        self.tokens.extend(out)
        return Draft(tokens=out, branches=branches)

    def _chain(self, k: int, arr: np.ndarray) -> tuple[list[int], bool]:
        """The draft after ``arr`` (the session's tokens), and whether a suffix match made it
        (else the bigram fallback did)."""
        d = self.drafter
        n, p = longest_suffix_match(arr, d.max_ngram, d.min_ngram)
        if n:
            limit = min(k, n * d.tokens_per_match_token)
            return arr[p + n: p + n + limit].tolist(), True
        out: list[int] = []
        last = self.tokens[-1] if self.tokens else None
        while last is not None and len(out) < k:
            nxt, share = d.bigrams.best(last)
            if nxt is None or share < d.bigram_min_share:
                break
            out.append(nxt)
            last = nxt
        return out, False

    def confirm(self, length: int) -> None:
        # everything before ``length`` was verified: let the bigram table learn it
        if length > self._verified:
            self.drafter.bigrams.observe(self.tokens[self._verified - 1: length])
            self._verified = length

    def rollback(self, length: int) -> None:
        self.confirm(length)  # everything before a fix position was verified
        super().rollback(length)
        self._array.cut(length)

    def retract(self, length: int) -> None:
        super().rollback(length)  # a cascade's correction, not the verifier's: learn nothing
        self._array.cut(length)


class MaGDrafter(Drafter):
    name = "mag"
    cheap = True

    def __init__(self, max_ngram: int = 8, min_ngram: int = 1, tokens_per_match_token: int = 2,
                 bigram_min_share: float = 0.5, max_bigram_leaders: int = 16384,
                 max_bigram_followers: int = 8):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens_per_match_token = tokens_per_match_token
        self.bigram_min_share = bigram_min_share
        self.bigrams = BigramTable(max_bigram_leaders, max_bigram_followers)

    def open(self, tokens: list[int], params: SamplingParams) -> MaGSession:
        self.bigrams.observe(tokens)
        return MaGSession(self, tokens, params)

    def snapshot(self):
        return copy.deepcopy(self.bigrams)

    def restore(self, state) -> None:
        self.bigrams = copy.deepcopy(state)
