"""The drafting loop of drafters that choose each token from their own logits (the torch model
drafter, llama.cpp's), without torch.

Each step feeds the tokens not yet cached, chooses the next token (``token_choice.choose_token``:
the argmax when greedy, else the session's keyed sample), and stops early when the drafter's
confidence (its top probability) falls below ``min_confidence``; the first token is always
offered. A stop keeps the logits it stopped on (``LogitsDraftSession._held``), so that the next
proposal, which offers that token first, starts from them instead of feeding the last token
again: a board's chunks stop on confidence often (a quarter of llama.cpp's two-token chunks on
Spec-Bench), and each such feed was a whole forward of the board's, for logits it had.

Token trees (``propose_tree``): the chain is ``propose``'s, token for token, and the branches come
from the distributions its forwards already computed, with no forward of their own: at each
drafted position the drafter's next most likely tokens, each a one-token branch when its
probability is at least ``branch_min_prob``. Of those, the ``width`` - 1 with the highest path
probability (the chain's token probabilities before the position times the alternative's) are
kept, best first; so early positions, which are the likelier to be reached, are preferred.
"""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

from .base import Branch, Draft, DraftSession
from .token_choice import choose_token, top_tokens


class BranchPicker:
    """Collects a model draft's one-token alternatives position by position (``add``) and keeps
    the ``max_branches`` most likely to be on the target's path (``branches``)."""

    def __init__(self, max_branches: int, min_prob: float):
        self.max_branches, self.min_prob = max_branches, min_prob
        self.reach = 1.0  # the drafter's probability of the chain so far
        self.candidates: list[tuple[float, int, int]] = []  # (path probability, at, token)

    def add(self, at: int, probs: np.ndarray, token: int) -> None:
        """Draft position ``at`` chose ``token`` from the probabilities ``probs`` [V]."""
        for alt, p in top_tokens(probs, self.max_branches + 1):
            if alt != token and p >= self.min_prob:
                self.candidates.append((self.reach * p, at, alt))
        self.reach *= float(probs[token])

    def branches(self) -> list[Branch]:
        best = sorted(self.candidates, key=lambda c: (-c[0], c[1]))[: self.max_branches]
        return [Branch(at, (token,)) for _, at, token in best]


class LogitsDrafterKnobs(Protocol):
    """What ``LogitsDraftSession`` reads of its session's drafter."""

    min_confidence: float
    branch_min_prob: float


class LogitsDraftSession(DraftSession):
    """Subclasses keep ``kv_len`` and provide ``_max_len``, ``_feed`` and ``_unfeed``; their
    ``drafter`` has ``min_confidence`` and ``branch_min_prob``."""

    kv_len: int  # positions of self.tokens[:kv_len] are cached; the last token is fed next
    drafter: LogitsDrafterKnobs  # a subclass narrows it to its own drafter class
    # (length, the logits [V] after tokens[:length]) where a proposal stopped on confidence:
    # then the cache holds every token (kv_len == length), until the next proposal takes them
    _held: tuple[int, np.ndarray] | None = None

    def _holds_logits(self) -> bool:
        """Whether the session still ends where a confidence stop kept its logits, its cache
        holding every token (true after a rollback that removed nothing: a fix that agrees
        with the whole draft)."""
        return self._held is not None and self._held[0] == len(self.tokens) == self.kv_len

    def _take_held(self) -> np.ndarray | None:
        """The logits a confidence stop kept, if the session still ends there (a fix or a
        rollback since: None, and the cache gives its last position back, so that the last
        token is fed next as usual)."""
        if self._holds_logits():
            assert self._held is not None
            logits, self._held = self._held[1], None
            return logits
        self._settle()
        return None

    def _settle(self) -> None:
        """Drop kept logits: the last token is the one fed next (what ``check`` and the
        subclasses' rollbacks assume)."""
        self._held = None
        if self.tokens and self.kv_len >= len(self.tokens):
            self._unfeed(self.kv_len - len(self.tokens) + 1)

    def _max_len(self) -> int:
        """The most tokens a session holds."""
        raise NotImplementedError

    def _feed(self, feed: list[int]):
        """Run ``feed`` after the cached positions and cache it; the logits [V] after it (any
        array NumPy can read)."""
        raise NotImplementedError

    def _unfeed(self, n: int) -> None:
        """Forget the last ``n`` cached positions."""
        raise NotImplementedError

    def propose(self, k: int) -> Draft:
        return self._propose(k, 1)

    def propose_tree(self, k: int, width: int) -> Draft:
        return self._propose(k, width)

    def _propose(self, k: int, width: int) -> Draft:
        proposal = Proposing(self, k, width)
        while (feed := proposal.feed()) is not None:
            proposal.took(self._feed(feed))
        return proposal.draft()


class Proposing:
    """One proposal of a ``LogitsDraftSession`` under way, a token a forward: ``feed`` says what
    to run next (None: done), ``took`` takes the logits after it. Several sessions' proposals
    can so share each forward (``propose_together``)."""

    def __init__(self, session: LogitsDraftSession, k: int, width: int):
        self.session, self.k = session, k
        self.out: list[int] = []
        self.picker = BranchPicker(width - 1, session.drafter.branch_min_prob) \
            if width > 1 else None
        self.done = False

    def feed(self) -> list[int] | None:
        """The tokens to run next (the session's not yet cached), or None when done. Logits a
        confidence stop kept are taken first, with no forward."""
        s = self.session
        while True:
            if self.done or len(self.out) >= self.k or len(s.tokens) + 1 > s._max_len():
                self.done = True
                return None
            held = s._take_held()
            if held is None:
                break
            self.took(held)
        return s.tokens[s.kv_len:]

    def took(self, logits) -> None:
        """The logits [V] after the feed (the session's cache now holds it)."""
        s = self.session
        # keyed by the absolute position the token will take: len(s.tokens)
        token, conf, probs = choose_token(logits, s.params, len(s.tokens))
        if self.out and conf < s.drafter.min_confidence:  # the first token is always offered
            s._held = (len(s.tokens), logits)  # the next proposal starts from them
            self.done = True
            return
        if self.picker is not None:
            self.picker.add(len(self.out), probs, token)
        self.out.append(token)
        s.tokens.append(token)

    def draft(self) -> Draft:
        return Draft(tokens=self.out,
                     branches=self.picker.branches() if self.picker is not None else [])


def propose_together(proposals: list[Proposing],
                     feed_many: Callable[[list[tuple[LogitsDraftSession, list[int]]]], list]
                     ) -> list[Draft]:
    """Every proposal run to its end, a token of each a round, each round's feeds in one call
    (``feed_many``: the sessions and their feeds -> the logits after each, the sessions'
    caches moved on)."""
    while True:
        going = [(p, f) for p in proposals if (f := p.feed()) is not None]
        if not going:
            return [p.draft() for p in proposals]
        for (p, _), logits in zip(going, feed_many([(p.session, f) for p, f in going])):
            p.took(logits)
