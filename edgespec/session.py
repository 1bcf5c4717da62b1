"""The session protocol (query-and-correct, docs/architecture.md), in process.

One ``SessionState`` per generation holds what the shared draft cache holds in the distributed
system: the prompt, the committed tokens, the current draft beyond them, and the epoch. The
drafter pushes chunks (``push_draft``), the verifier takes a draft (``take_draft``) and commits
its verdict (``commit``), which may publish a ``Fix``. All positions are absolute indices into
prompt + output.

Rules:
- a chunk carries the epoch it was drafted under and the position it starts at; a stale epoch or
  a gap/overlap is refused, so a late chunk is never verified against the wrong prefix;
- a commit appends accepted + the verifier's own token; when the draft did not hold that token at
  that position (a rejection, a bonus token past the draft, or no draft), the epoch is bumped, the
  draft dropped, and a fix (epoch, position, token) published;
- fixes are kept in an ordered, bounded log with increasing ids, so a drafter reads what it
  missed (the Redis stream of the distributed cache).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from .config import SamplingParams
from .fleet_table import FleetTable, record_output
from .sampling import SparseQ
from .store_api import CommitOutcome, DraftWant, SessionVanished


class StaleChunkError(Exception):
    """A draft chunk from an old epoch or at the wrong position."""


@dataclass(frozen=True)
class Fix:
    id: int
    epoch: int
    position: int  # the verifier's token goes here; the drafter rolls back to this length
    token: int


@dataclass(frozen=True)
class Verdict:
    """The verifier's decision on one session's draft taken under ``epoch``."""

    session_id: str
    epoch: int
    start: int  # position of the first draft token (the committed end before this verdict)
    n_accepted: int
    token: int
    finish_reason: str = ""  # set on the session's last verdict: "stop" or "length"

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)


@dataclass
class TakenDraft:
    epoch: int
    start: int  # position of the first draft token
    tokens: list[int]
    q: list[SparseQ] | None


@dataclass
class SessionState:
    session_id: str
    prompt: list[int]
    committed: list[int] = field(default_factory=list)
    draft: list[int] = field(default_factory=list)
    draft_q: list[SparseQ] | None = None
    epoch: int = 0
    drafter_idle: bool = False  # the drafter has nothing more for the current draft end
    has_drafter: bool = False
    params: SamplingParams = field(default_factory=SamplingParams)
    done: bool = False
    fixes: deque = field(default_factory=lambda: deque(maxlen=256))
    _next_fix_id: int = 1

    @property
    def end(self) -> int:
        """Position after the last committed token."""
        return len(self.prompt) + len(self.committed)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.committed

    def push_draft(self, epoch: int, start: int, tokens: list[int],
                   q: list[SparseQ] | None = None, idle: bool = False, window: int = 1 << 30
                   ) -> int:
        """Append a drafted chunk; returns how many tokens were kept (the window bounds it)."""
        if self.done:
            raise StaleChunkError(f"session {self.session_id} is finished")
        if epoch != self.epoch:
            raise StaleChunkError(f"chunk from epoch {epoch}, session is at epoch {self.epoch}")
        expected = self.end + len(self.draft)
        if start != expected:
            raise StaleChunkError(f"chunk starts at {start}, the draft ends at {expected}")
        if q is not None and len(q) != len(tokens):
            raise ValueError("a chunk needs one q' per token")
        keep = max(0, min(len(tokens), window - len(self.draft)))
        if keep and (q is None) != (self.draft_q is None) and self.draft:
            raise ValueError("a draft mixes deterministic and sampled chunks")
        if keep:
            if not self.draft:
                self.draft_q = None if q is None else []
            self.draft.extend(tokens[:keep])
            if q is not None:
                self.draft_q.extend(q[:keep])
        self.drafter_idle = idle
        return keep

    def draft_ready(self, k: int) -> bool:
        """True when waiting longer would not give the verifier a longer draft."""
        return not self.has_drafter or self.drafter_idle or len(self.draft) >= k

    def take_draft(self, k: int) -> TakenDraft:
        q = None if self.draft_q is None else self.draft_q[:k]
        return TakenDraft(self.epoch, self.end, self.draft[:k], q)

    def commit(self, epoch: int, n_accepted: int, token: int, done: bool = False) -> Fix | None:
        """Apply the verifier's verdict on a draft taken under ``epoch``."""
        if epoch != self.epoch:
            raise StaleChunkError(f"verdict for epoch {epoch}, session is at epoch {self.epoch}")
        if n_accepted > len(self.draft):
            raise ValueError(f"accepted {n_accepted} of a {len(self.draft)}-token draft")
        self.committed.extend(self.draft[:n_accepted])
        position = self.end
        self.committed.append(token)
        held = len(self.draft) > n_accepted and self.draft[n_accepted] == token
        fix = None
        if held:
            del self.draft[: n_accepted + 1]
            if self.draft_q is not None:
                del self.draft_q[: n_accepted + 1]
        else:
            self.draft.clear()
            self.draft_q = None
            self.epoch += 1
            self.drafter_idle = False
            fix = Fix(self._next_fix_id, self.epoch, position, token)
            self._next_fix_id += 1
            self.fixes.append(fix)
        self.done = self.done or done
        return fix

    def fixes_after(self, fix_id: int) -> list[Fix]:
        return [f for f in self.fixes if f.id > fix_id]


class LocalSessionStore:
    """Sessions of one process, guarded by one condition variable that wakes drafters on fixes
    and the verifier on new chunks.

    The verifier's side of the store (``create``, ``take_when_ready``, ``commit_many``,
    ``close``) is the interface the Redis-backed store of the distributed cache also offers.
    """

    wait_ms = 0.0  # no remote drafter to wait for: the engine's drafter suggests its own

    def __init__(self, fleet: FleetTable | None = None) -> None:
        self.cond = threading.Condition()
        self.sessions: dict[str, SessionState] = {}
        self.fleet = fleet  # taught each session's output when it closes, as the cache does


    def create(self, session_id: str, prompt: list[int], params: SamplingParams,
               drafter: str | None, max_new_tokens: int = 0,
               committed: Sequence[int] = (), verify: str = "exact") -> SessionState:
        with self.cond:
            if session_id in self.sessions:
                raise ValueError(f"session {session_id} exists")
            state = SessionState(session_id, list(prompt), list(committed),
                                 has_drafter=drafter is not None, params=params)
            self.sessions[session_id] = state
            self.cond.notify_all()
            return state

    def take_when_ready(self, wants: list[DraftWant], wait_s: float
                        ) -> list[TakenDraft | SessionVanished]:
        """Wait up to ``wait_s`` until every session's draft is ready, then take up to k tokens
        of each."""
        deadline = time.monotonic() + wait_s
        with self.cond:
            states = [self.sessions.get(w.session_id) for w in wants]
            while not all(st is None or st.draft_ready(w.wait_for)
                          for st, w in zip(states, wants)):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(timeout=left)
            return [SessionVanished(w.session_id) if st is None else st.take_draft(w.k)
                    for st, w in zip(states, wants)]

    def commit_many(self, verdicts: list[Verdict]) -> list[CommitOutcome]:
        out = []
        with self.cond:
            for v in verdicts:
                state = self.sessions.get(v.session_id)
                try:
                    if state is None:
                        raise StaleChunkError(f"unknown session {v.session_id}")
                    if state.end != v.start:
                        raise StaleChunkError(f"verdict at {v.start}, session ends at {state.end}")
                    out.append(CommitOutcome(state.commit(v.epoch, v.n_accepted, v.token,
                                                          v.done)))
                except (StaleChunkError, ValueError) as e:
                    out.append(CommitOutcome(error=str(e)))
            self.cond.notify_all()
        return out

    def close(self, session_id: str, finish_reason: str = "stop") -> None:
        with self.cond:
            state = self.sessions.pop(session_id, None)
            if state is not None:
                state.done = True
            self.cond.notify_all()
        if state is not None and self.fleet is not None:
            record_output(self.fleet, state.tokens, len(state.prompt))
