"""The drafter interface every drafting algorithm implements.

A ``Drafter`` opens one ``DraftSession`` per generation. A draft session keeps its own belief of
the sequence (``tokens``: prompt, committed output and its own not-yet-verified draft); ``propose``
extends that belief by up to k tokens, ``rollback`` truncates it to a position (a fix from the
verifier), ``append`` adds a known token (the verifier's token at the fix position).

Cascades (``cascade.py``) use two more hooks: ``check`` (a session that can, a model drafter's,
verifies another drafter's proposal in one forward) and ``retract`` (drop the session's own
unverified tokens, which is not a fix: nothing before the cut was confirmed by the verifier).

Token trees: ``propose_tree(k, width)`` may add ``Branch``es to its draft, alternative
continuations the verifier checks in the same forward (``edgespec.verify.trees``). The session's
belief stays the chain (``Draft.tokens``); branches are never appended to ``tokens``, and when
the verifier accepts one, the fix carries the branch's tokens (``Fix.tokens``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Sequence

from ..config import SamplingParams
from ..protocol.contract import Branch  # the one branch shape (a draft and its alternatives)


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    # alternatives to some of ``tokens`` (``propose_tree``); each hangs from the chain
    branches: list[Branch] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class Checked(Draft):
    """What ``DraftSession.check`` appended: the first ``accepted`` tokens of the proposal, then
    the session's own next token (``tokens``)."""

    accepted: int = 0
    # the own token's top probability reached the drafter's confidence cut-off
    confident: bool = True


class DraftSession(ABC):
    can_check: bool = False  # whether ``check`` works (model drafters)

    def __init__(self, tokens: list[int], params: SamplingParams):
        self.tokens = list(tokens)
        self.params = params

    @abstractmethod
    def propose(self, k: int) -> Draft:
        """Draft up to k tokens after ``self.tokens`` and append them to it. May return fewer,
        or none when nothing is likely to be accepted."""

    def propose_tree(self, k: int, width: int) -> Draft:
        """``propose(k)``, plus up to ``width`` - 1 alternatives (``Draft.branches``) at the
        positions where the drafter had other likely candidates, each at most k tokens long.
        With ``width`` <= 1 it is exactly ``propose(k)`` (drafting threads always call this).
        The default has no branches: a chain."""
        return self.propose(k)

    def confirm(self, length: int) -> None:
        """The verifier committed the session's first ``length`` tokens, and they are the ones
        this session holds (a fix that agreed with its draft, so nothing is rolled back). A
        drafter that learns from verified tokens learns them here; the default learns
        nothing."""

    def rollback(self, length: int) -> None:
        if not 0 <= length <= len(self.tokens):
            raise ValueError(f"cannot roll back to {length}: session has {len(self.tokens)} tokens")
        del self.tokens[length:]

    def append(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def check(self, proposal: list[int], lenient_prob: float | None = None) -> Checked:
        """Verify another drafter's ``proposal`` for the tokens after ``self.tokens``: keep its
        longest prefix this session agrees with, add the session's own next token, append both
        to ``self.tokens``. ``lenient_prob``: also agree with a proposed token that is this
        session's second choice with at least that probability (greedy sessions). The default
        session cannot check (statistical drafters have no distribution to check with)."""
        raise NotImplementedError(f"{type(self).__name__} cannot check proposals")

    def retract(self, length: int) -> None:
        """Drop this session's own draft tokens from ``length`` on. Unlike ``rollback`` it is
        not a verifier's fix: sessions that learn from fixes override it to learn nothing."""
        self.rollback(length)

    def close(self) -> None:
        """Release what the session holds (a KV slot for model drafters)."""


class Drafter(ABC):
    name: str = "drafter"
    # How long a verification step should wait for this drafter's next chunk by default: about
    # the time it needs to draft a few tokens.
    wait_ms: float = 10.0
    uses_fleet: bool = False  # drafts from the fleet-wide table (``use_fleet``)
    # drafts a chunk in microseconds, no model forward (statistical drafters): a drafting loop
    # in process does several of its jobs a turn (``DraftChannel.jobs_at_once``)
    cheap: bool = False
    # sessions' chunks ``propose_many`` drafts together, a token of each a forward (a llama.cpp
    # drafter's sequences of one context); 1: one session at a time
    batch_jobs: int = 1
    # every token it drafts is one of the tokens it was given (its sessions' prompts and
    # verified output, checked where they entered): drafting in the verifier's own thread
    # (``engine.inline_drafts``), its drafts enter the store unchecked (the forward's own
    # guard, ``DraftShape.rows_outside``, still stands). A board's drafts are always checked.
    context_ids: bool = False

    @abstractmethod
    def open(self, tokens: list[int], params: SamplingParams) -> DraftSession:
        """Start drafting for a session whose sequence so far is ``tokens``."""

    def snapshot(self):
        """What the drafter has learned across sessions (None: nothing), for ``restore``."""
        return None

    def restore(self, state) -> None:
        """Go back to a ``snapshot`` (benchmarks repeat a prompt without learning from it)."""

    def propose_many(self, jobs: Sequence[tuple[DraftSession, int]], width: int) -> list[Draft]:
        """Each job's proposal (its session, k): ``propose_tree(k, width)``, one session after
        another; a drafter with ``batch_jobs`` > 1 drafts them together."""
        return [session.propose_tree(k, width) for session, k in jobs]

    def use_fleet(self, table) -> None:
        """Draft also from a fleet-wide table (a ``FleetTable``), synchronised in the
        background; None stops that. Drafters that learn nothing across devices ignore it."""
