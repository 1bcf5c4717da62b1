"""A generation as the verifier's handlers see it (``Ticket``: its output so far, how it ended,
who follows it), and why the scheduler refuses one (``QueueFull``, ``TooSlowForDeadline``,
``ShuttingDown``). Handler threads wait on a ticket; the scheduler's thread publishes to it.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from edgespec.engine.spec_engine import Request, Result
from edgespec.protocol.token_logprob import TokenLogprob

from .pace import PaceVerdict

log = logging.getLogger("edgespec.verifier")


class QueueFull(Exception):
    """Refused for want of room or of time; ``retry_after_s``: when to try again (0: not said)."""

    retry_after_s: float = 0.0


class TooSlowForDeadline(QueueFull):
    """The measured pace and the work ahead would not finish the call within its deadline."""

    def __init__(self, verdict: PaceVerdict):
        super().__init__(verdict.reason())
        self.retry_after_s = verdict.retry_after_s


class ShuttingDown(Exception):
    """The verifier is stopping; the session can be resumed elsewhere or after a restart."""


def new_session_id() -> str:
    return uuid.uuid4().hex


@dataclass
class Ticket:
    """One generation as the handlers see it: the output so far and how it ended. Several
    handlers may follow one ticket (a client that resumed its stream), each from its own
    position."""

    request: Request
    device: str | None
    # gives back the device's reservation (admission picked the device for this ticket); the
    # scheduler calls it once the session exists or will not
    release_pick: Callable[[], None] | None = None
    session_id: str = field(default_factory=new_session_id)
    tokens: list[int] = field(default_factory=list)  # output committed so far
    # with ``request.logprobs``: the logprobs of ``tokens`` past ``request.committed``, each
    # chunk's added before its tokens are published
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # with ``request.prompt_logprobs``: the prompt's (each token's after the first), set once
    # its prompt is in, before any token is published
    prompt_logprobs: list[TokenLogprob] | None = None
    result: Result | None = None
    error: Exception | None = None
    followers: int = 0
    # handlers handed this running ticket (a resume) that do not follow it yet: an orphan
    # cancel is void while one is on its way (``Admission.follow`` takes it up)
    claims: int = 0
    submitted: bool = False  # queued once: a submitted ticket no longer held has ended
    cond: threading.Condition = field(default_factory=threading.Condition)
    created: float = field(default_factory=time.monotonic)
    last_token_at: float | None = None
    # called (from the scheduler thread) after every change: new tokens, the end
    listeners: list = field(default_factory=list)
    # a resumed or re-created session that changes kernel sets here (``protocol.lineage``)
    kernels_switched: bool = False
    # its caller named its drafter (``device_id``): never handed to another (``handover``)
    pinned: bool = False
    # the boards it had before ``device`` (handed over), each with its share of the board
    # figures (``metrics.board_figures``): credited when it finishes
    earlier_boards: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokens = list(self.request.committed)

    def _notify(self) -> None:
        for fn in list(self.listeners):
            try:
                fn()
            except Exception:  # a reader's trouble (a closed event loop) stays its own
                log.exception("a listener of session %s failed", self.session_id)

    @property
    def ended(self) -> bool:
        return self.result is not None or self.error is not None

    def add_logprobs(self, entries: list[TokenLogprob]) -> None:
        with self.cond:
            self.logprobs.extend(entries)

    def set_prompt_logprobs(self, entries: list[TokenLogprob]) -> None:
        with self.cond:
            self.prompt_logprobs = entries

    def logprobs_of(self, start: int, stop: int) -> list[TokenLogprob]:
        """The logprobs of ``tokens[start:stop]`` (positions past ``request.committed``)."""
        skip = len(self.request.committed)
        with self.cond:
            return self.logprobs[max(0, start - skip):max(0, stop - skip)]

    def publish(self, new: list[int]) -> None:
        with self.cond:
            self.tokens.extend(new)
            self.cond.notify_all()
        self._notify()

    def finish(self, result: Result) -> None:
        with self.cond:
            self.result = result
            self.cond.notify_all()
        self._notify()

    def fail(self, exc: Exception) -> None:
        with self.cond:
            if not self.ended:
                self.error = exc
            self.cond.notify_all()
        self._notify()

    def wait(self, cursor: int, timeout: float) -> list[int]:
        """Tokens after ``cursor`` (waiting up to ``timeout`` for some, or for the end)."""
        with self.cond:
            if len(self.tokens) <= cursor and not self.ended:
                self.cond.wait(timeout)
            return self.tokens[cursor:]
