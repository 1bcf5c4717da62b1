"""Suffix matching over a session's tokens: MaG's and Cacheback's lookup of where the context's
last tokens occurred before.

``longest_suffix_match`` answers on a NumPy array of the tokens (``TokenArray`` keeps one beside
a session's list). ``TokenPlaces`` keeps, beside the list, each token's earlier positions, so
that ``listed_suffix_match`` finds the candidates without scanning the context and compares them
on the list itself: in a step's drafting at 64 sessions, the array's half-dozen small NumPy
calls a match (a comparison over the whole context, its nonzero, the slices turned into lists)
cost more than the comparisons. Both give the same answer: the longest n in
[min_ngram, max_ngram] whose run of the last n tokens occurs earlier with a token after it, the
most recent such place.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .base import Branch

class TokenArray:
    """A session's tokens as a NumPy array kept beside its list, extended by what was appended
    since the last read: turning a 1,000-token list into an array cost 31 us, six times a match
    on it (read for trees' branches and contexts with many candidates). The session
    tells it of a rollback (``cut``: both of its rollbacks do); a list changed behind its back
    is read again whole when that shows in its last mirrored token, and only then."""

    def __init__(self) -> None:
        self._buf = np.empty(256, dtype=np.int64)
        self._n = 0  # leading entries that mirror the list

    def cut(self, length: int) -> None:
        """The list was cut to ``length`` tokens."""
        if length < self._n:
            self._n = length

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


class TokenPlaces:
    """Each token's positions in a session's list, kept beside the list as ``TokenArray`` keeps
    its array, as links: ``last[t]``, the last position holding t, and ``before[i]``, the
    position before i holding the same token (-1 where none). A match walks a token's places
    most recent first, as it compares them; appending a token is two writes, and a closed
    session's index is a dict of ints and a list (a list per token cost a sixtieth of a
    session-step to free, bench-host at 64 sessions). What was appended since the last read is
    indexed, a rollback it is told of (``cut``) unlinks the positions past it, and a list
    changed behind its back is indexed again whole when that shows in its last indexed token
    (and ``array``, the same list's ``TokenArray`` if it has one, read less often, is then read
    again whole too)."""

    def __init__(self, array: TokenArray | None = None) -> None:
        self.last: dict[int, int] = {}
        self.before: list[int] = []  # [len(indexed)]: the previous place of each one's token
        self._mirror: list[int] = []  # the tokens indexed, in order
        self._array = array

    def cut(self, length: int) -> None:
        """The list was cut to ``length`` tokens."""
        mirror, before, last = self._mirror, self.before, self.last
        while len(mirror) > length:
            token, prev = mirror.pop(), before.pop()
            if prev < 0:
                del last[token]
            else:
                last[token] = prev

    def of(self, tokens: list[int]) -> TokenPlaces:
        """This index, brought up to ``tokens``; valid until the next call."""
        mirror, before, last = self._mirror, self.before, self.last
        n = len(mirror)
        if n > len(tokens) or (n and mirror[-1] != tokens[n - 1]):
            self._mirror, self.before, self.last = mirror, before, last = [], [], {}
            n = 0
            if self._array is not None:
                self._array.cut(0)
        get, link = last.get, before.append
        for i, token in enumerate(tokens[n:], n):
            link(get(token, -1))
            last[token] = i
        mirror.extend(tokens[n:])
        return self

    def places(self, token: int) -> list[int]:
        """``token``'s positions, ascending."""
        out, e, before = [], self.last.get(token, -1), self.before
        while e >= 0:
            out.append(e)
            e = before[e]
        return out[::-1]


def listed_suffix_match(tokens: list[int], places: TokenPlaces, max_ngram: int,
                        min_ngram: int, array: Callable[[], np.ndarray]) -> tuple[int, int]:
    """``longest_suffix_match`` of ``tokens`` (non-empty), from their ``TokenPlaces``: the
    earlier places of the last token are compared one by one on the list, most recent first,
    up to ``SCAN_CANDIDATES`` of them; where more are left to compare, all are narrowed
    together on ``array()`` (the tokens as an array)."""
    last = len(tokens) - 1
    # (conditionals, not min(): builtins.min parses its keywords on every call, five times
    # the comparison, and this runs for every drafting call and candidate)
    top = max_ngram if max_ngram < last else last
    if top < min_ngram:
        return 0, -1
    before = places.before
    e = before[last]  # the last token's place before its own
    n, end, scanned = 0, -1, 0
    while e >= 0:
        if e + 1 <= n:  # no earlier run can be longer
            break
        if scanned == SCAN_CANDIDATES:  # many: the array's match (narrowed together)
            return longest_suffix_match(array(), max_ngram, min_ngram)
        scanned += 1
        limit = top if top <= e else e + 1
        m = 1  # tokens[e] == tokens[last]
        while m < limit and tokens[e - m] == tokens[last - m]:
            m += 1
        if m > n:
            n, end = m, e
            if n == top:
                break
        e = before[e]
    if n < min_ngram:
        return 0, -1
    return n, end - n + 1


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


