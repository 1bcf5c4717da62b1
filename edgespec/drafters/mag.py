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
``max_bigram_leaders`` tokens (the least recently seen are forgotten first, a sixteenth of the
table at once when it is full), each with at most ``max_bigram_followers`` followers (a new
follower replaces the least counted one).

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
import heapq


from ..config import SamplingParams
from .base import Branch, Draft, Drafter, DraftSession
from .suffix_match import (TokenArray, TokenPlaces, listed_suffix_match, longest_suffix_match,
                           match_branches)

__all__ = ["BigramTable", "MaGDrafter", "MaGSession", "TokenArray", "longest_suffix_match",
           "match_branches"]


class _Followers:
    __slots__ = ("counts", "total", "top", "used")

    def __init__(self, first: int, used: int) -> None:  # a leader seen once, with ``first``
        self.counts: dict[int, int] = {first: 1}  # at most max_followers entries
        self.total = 1  # every observation, evicted followers' included
        # the most counted follower (the first of equals), None where not known until read:
        # kept by ``observe`` where that is plain, else found by the next read
        self.top: int | None = first  # its share of ``total``: computed where it is read
        self.used = used  # the table's use count at its last use (observed or read)


class BigramTable:
    """Follower counts per leader token, bounded: at most ``max_leaders`` leaders (the least
    recently used forgotten first) and ``max_followers`` followers per leader (the least
    counted evicted). A leader's last use is a stamp from a count of uses, not its place in
    an ordered dict: a use (several a session-step: each observed pair, each read of a chain)
    is one attribute set where moving an entry to a dict's end was a call. A table that
    overflows forgets its least recently used leaders at once, found in one pass over the
    stamps, down to ``max_leaders - max_leaders // FORGET_SHARE`` (all but one: a table of
    fewer than FORGET_SHARE leaders forgets one at a time)."""

    FORGET_SHARE = 16

    def __init__(self, max_leaders: int = 16384, max_followers: int = 8) -> None:
        if max_leaders < 1 or max_followers < 1:
            raise ValueError("a bigram table needs room for at least one leader and follower")
        self.max_leaders, self.max_followers = max_leaders, max_followers
        self._followers: dict[int, _Followers] = {}
        self._uses = 0  # leaders' uses so far: a leader's ``used`` is the count at its last

    def __len__(self) -> int:
        return len(self._followers)

    def _forget(self) -> None:
        """Drop the least recently used leaders: back within ``max_leaders``, with room for
        ``max_leaders // FORGET_SHARE`` more."""
        table = self._followers
        gone = len(table) - self.max_leaders + self.max_leaders // self.FORGET_SHARE
        oldest = heapq.nsmallest(gone, table.items(), key=lambda kv: kv[1].used)
        for leader, _ in oldest:
            del table[leader]

    def observe(self, tokens: list[int]) -> None:
        table = self._followers
        get = table.get  # bound once: a pair costs a few lookups
        max_leaders, max_followers = self.max_leaders, self.max_followers
        uses = self._uses
        for a, b in zip(tokens, tokens[1:]):
            uses += 1
            entry = get(a)
            if entry is None:  # a new leader (most of a prompt's): its first follower its top
                table[a] = _Followers(b, uses)
                if len(table) > max_leaders:
                    self._forget()
                continue
            entry.used = uses
            counts = entry.counts
            top = entry.top
            entry.total += 1
            if b == top:  # the most counted follower counted again (most pairs): it stays
                counts[b] += 1
                continue
            seen = counts.get(b)
            if seen is not None:
                n = counts[b] = seen + 1
            else:
                if len(counts) >= max_followers:
                    gone = min(counts, key=counts.__getitem__)
                    del counts[gone]
                    if gone == top:  # all counted alike: the first went, which was the top
                        top = None
                n = counts[b] = 1
            # the top kept as it changes where that is plain (a follower now counted above
            # it); a tie with it is left to the next read (the first of equals in the
            # followers' order wins): a draft reads a leader's top more often than it changes
            if top is not None and n >= counts[top]:
                top = b if n > counts[top] else None
            entry.top = top
        self._uses = uses

    def followers(self, token: int) -> dict[int, int]:
        entry = self._followers.get(token)
        return dict(entry.counts) if entry else {}

    def best(self, token: int) -> tuple[int | None, float]:
        """(most frequent follower, its share of observed followers), or (None, 0)."""
        entry = self._followers.get(token)
        if entry is None or not entry.counts:
            return None, 0.0
        self._uses += 1
        entry.used = self._uses
        counts, nxt = entry.counts, entry.top
        if nxt is None:
            nxt = entry.top = max(counts, key=counts.__getitem__)
        return nxt, counts[nxt] / entry.total

    def chain(self, token: int, k: int, min_share: float) -> list[int]:
        """Up to k tokens, each the most frequent follower (``best``) of the one before,
        starting after ``token``: the chain ends before a follower whose share is below
        ``min_share``. Each leader read counts as a use of it, as ``best``'s does."""
        get = self._followers.get
        uses = self._uses
        out: list[int] = []
        for _ in range(k):
            entry = get(token)
            if entry is None:
                break
            counts, nxt = entry.counts, entry.top
            if nxt is None:
                if not counts:
                    break
                nxt = entry.top = max(counts, key=counts.__getitem__)
            uses += 1
            entry.used = uses
            if counts[nxt] / entry.total < min_share:
                break
            out.append(nxt)
            token = nxt
        self._uses = uses
        return out

    def runner_up(self, token: int, besides: int) -> tuple[int | None, float]:
        """(the most frequent follower of ``token`` other than ``besides``, its share), or
        (None, 0). A peek: unlike ``best`` it does not count as a use of the leader."""
        entry = self._followers.get(token)
        rest = {t: c for t, c in entry.counts.items() if t != besides} if entry else {}
        if entry is None or not rest:
            return None, 0.0
        nxt = max(rest, key=rest.__getitem__)
        return nxt, rest[nxt] / entry.total


class MaGSession(DraftSession):
    def __init__(self, drafter: "MaGDrafter", tokens: list[int], params: SamplingParams):
        super().__init__(tokens, params)
        self.drafter = drafter
        self._verified = len(tokens)  # tokens before this index are confirmed (prompt/committed)
        self._array = TokenArray()  # read only for trees and contexts with many candidates
        self._places = TokenPlaces(self._array)

    def propose(self, k: int) -> Draft:
        out, _ = self._chain(k)
        self.tokens.extend(out)
        return Draft(out)

    def propose_tree(self, k: int, width: int) -> Draft:
        if width <= 1:
            return self.propose(k)
        d = self.drafter
        out, matched = self._chain(k)
        if matched:
            branches = match_branches(self._array.of(self.tokens), out, k, d.max_ngram, d.min_ngram,
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

    def _chain(self, k: int) -> tuple[list[int], bool]:
        """The draft after the session's tokens, and whether a suffix match made it (else the
        bigram fallback did)."""
        d, tokens = self.drafter, self.tokens
        n, p = listed_suffix_match(tokens, self._places.of(tokens), d.max_ngram, d.min_ngram,
                                   lambda: self._array.of(tokens))
        if n:
            limit = n * d.tokens_per_match_token
            if limit > k:
                limit = k
            return tokens[p + n: p + n + limit], True
        return (d.bigrams.chain(tokens[-1], k, d.bigram_min_share) if tokens else []), False

    def confirm(self, length: int) -> None:
        # everything before ``length`` was verified: let the bigram table learn it
        if length > self._verified:
            self.drafter.bigrams.observe(self.tokens[self._verified - 1: length])
            self._verified = length

    def rollback(self, length: int) -> None:
        self.confirm(length)  # everything before a fix position was verified
        super().rollback(length)
        self._array.cut(length)
        self._places.cut(length)

    def retract(self, length: int) -> None:
        super().rollback(length)  # a cascade's correction, not the verifier's: learn nothing
        self._array.cut(length)
        self._places.cut(length)


class MaGDrafter(Drafter):
    name = "mag"
    cheap = True
    context_ids = True  # its drafts are its sessions' own tokens and the pairs it counted

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
