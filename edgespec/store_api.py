"""The contract between the verifier engine and a session store (in process or in Redis).

The engine drives a store through four calls per session life: ``create`` (a new session, or a
resumed one whose committed output is already known), ``take_when_ready`` (the drafts to verify
this step), ``commit_many`` (the verdicts) and ``close``. ``edgespec.session.LocalSessionStore``
and ``cache_service.store.RedisSessionStore`` implement it.

Failure rules the engine relies on:
- ``take_when_ready`` and ``commit_many`` answer per session: one session's trouble (it vanished
  from the cache, a refused commit) is reported in its own slot, never raised for the batch;
- they raise only when the store itself is unreachable; nothing was then applied by
  ``take_when_ready``, and ``commit_many`` may be retried with the same verdicts (a commit that
  did land is recognised by its position and answered as before, not applied twice);
- ``close`` never raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

from .config import SamplingParams

if TYPE_CHECKING:
    from .session import Fix, TakenDraft, Verdict


@dataclass(frozen=True)
class DraftWant:
    """What the verifier asks of one session's draft this step."""

    session_id: str
    k: int  # take at most k draft tokens
    wait_for: int  # tokens worth waiting for (the deadline still bounds the wait)
    side: int = 0  # the most branch tokens (trees) to take with the draft


@dataclass(frozen=True)
class CommitOutcome:
    """One verdict's fate: applied (``fix`` set when the draft did not hold the token), or
    refused with ``error``."""

    fix: Fix | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class SessionVanished(Exception):
    """The store no longer holds the session (expired, or lost with a non-persistent Redis)."""


class SessionStore(Protocol):
    wait_ms: float  # the store's suggested draft deadline

    def create(self, session_id: str, prompt: list[int], params: SamplingParams,
               drafter: str | None, max_new_tokens: int,
               committed: Sequence[int] = (), verify: str = "exact") -> None: ...

    def take_when_ready(self, wants: list[DraftWant], wait_s: float
                        ) -> list[TakenDraft | SessionVanished]: ...

    def commit_many(self, verdicts: list[Verdict]) -> list[CommitOutcome]: ...

    def close(self, session_id: str, finish_reason: str = "stop") -> None: ...
