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

Token trees: a chunk may carry branches, alternatives to some of its tokens (``DraftBranch``,
at an absolute position). The draft stays a chain, the drafter's belief; branches ride along
and are taken with it, up to a node budget. A verdict that accepted a branch (``Verdict.branch``)
left the chain, so it is always a fix, and the fix carries the branch's tokens (``Fix.more``).
A commit that the draft held keeps the branches that still lie ahead.
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


MAX_BRANCHES = 8  # branches a session's draft keeps (more are dropped)
MAX_BRANCH_TOKENS = 8  # tokens a branch keeps


class StaleChunkError(Exception):
    """A draft chunk from an old epoch or at the wrong position."""


@dataclass(frozen=True)
class DraftBranch:
    """An alternative continuation stored with a draft: its first token is an alternative to
    the draft's token at absolute position ``pos`` (it hangs from the token at pos - 1)."""

    pos: int
    tokens: tuple[int, ...]


def chunk_branches(start: int, tokens: Sequence[int], branches, keep: int
                   ) -> list[DraftBranch]:
    """A chunk's branches (objects with ``at`` and ``tokens``, ``at`` relative to the chunk)
    as stored ones: those that are alternatives to one of the ``keep`` tokens kept, differ from
    the chain there and are not repeated, each cut to MAX_BRANCH_TOKENS, at most MAX_BRANCHES."""
    out: list[DraftBranch] = []
    seen = set()
    for b in branches:
        toks = tuple(int(t) for t in b.tokens[:MAX_BRANCH_TOKENS])
        if not 0 <= b.at < keep or not toks or toks[0] == tokens[b.at] or \
                (b.at, toks[0]) in seen:
            continue
        seen.add((b.at, toks[0]))
        out.append(DraftBranch(start + b.at, toks))
    return out[:MAX_BRANCHES]


def take_branches(branches: Sequence[DraftBranch], start: int, n_spine: int, budget: int
                  ) -> list[DraftBranch]:
    """The branches that hang from a taken draft of ``n_spine`` tokens at ``start`` (each an
    alternative to one of them), cut so that they hold at most ``budget`` tokens in all."""
    out = []
    for b in branches:
        if budget <= 0:
            break
        if start <= b.pos < start + n_spine:
            toks = b.tokens[:budget]
            budget -= len(toks)
            out.append(DraftBranch(b.pos, toks))
    return out


@dataclass(frozen=True)
class Fix:
    id: int
    epoch: int
    position: int  # the verifier's token goes here; the drafter rolls back to this length
    token: int
    more: tuple[int, ...] = ()  # tokens after ``token`` (the verifier accepted a branch)

    @property
    def tokens(self) -> list[int]:
        """What the drafter appends after rolling back to ``position``."""
        return [self.token, *self.more]


@dataclass(frozen=True)
class Verdict:
    """The verifier's decision on one session's draft taken under ``epoch``."""

    session_id: str
    epoch: int
    start: int  # position of the first draft token (the committed end before this verdict)
    n_accepted: int
    token: int
    finish_reason: str = ""  # set on the session's last verdict: "stop" or "length"
    # tokens accepted from a branch at start + n_accepted, before ``token`` (trees only)
    branch: tuple[int, ...] = ()

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)


@dataclass
class TakenDraft:
    epoch: int
    start: int  # position of the first draft token
    tokens: list[int]
    q: list[SparseQ] | None
    branches: list[DraftBranch] = field(default_factory=list)  # alternatives hanging from it

    @property
    def branch_tokens(self) -> int:
        return sum(len(b.tokens) for b in self.branches)


@dataclass
class SessionState:
    session_id: str
    prompt: list[int]
    committed: list[int] = field(default_factory=list)
    draft: list[int] = field(default_factory=list)
    draft_q: list[SparseQ] | None = None
    branches: list[DraftBranch] = field(default_factory=list)
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
                   q: list[SparseQ] | None = None, idle: bool = False, window: int = 1 << 30,
                   branches=()) -> int:
        """Append a drafted chunk; returns how many tokens were kept (the window bounds it).
        ``branches``: alternatives to the chunk's tokens (``at`` relative to the chunk)."""
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
            room = MAX_BRANCHES - len(self.branches)
            if branches and room > 0:
                self.branches.extend(chunk_branches(start, tokens, branches, keep)[:room])
        self.drafter_idle = idle
        return keep

    def draft_ready(self, k: int) -> bool:
        """True when waiting longer would not give the verifier a longer draft."""
        return not self.has_drafter or self.drafter_idle or len(self.draft) >= k

    def take_draft(self, k: int, side: int = 0) -> TakenDraft:
        """Up to k draft tokens, and branches hanging from them of at most ``side`` tokens."""
        q = None if self.draft_q is None else self.draft_q[:k]
        spine = self.draft[:k]
        return TakenDraft(self.epoch, self.end, spine, q,
                          take_branches(self.branches, self.end, len(spine), side))

    def commit(self, epoch: int, n_accepted: int, token: int, done: bool = False,
               branch: Sequence[int] = ()) -> Fix | None:
        """Apply the verifier's verdict on a draft taken under ``epoch``."""
        if epoch != self.epoch:
            raise StaleChunkError(f"verdict for epoch {epoch}, session is at epoch {self.epoch}")
        if n_accepted > len(self.draft):
            raise ValueError(f"accepted {n_accepted} of a {len(self.draft)}-token draft")
        branch = tuple(branch)
        if branch and not any(b.pos == self.end + n_accepted and b.tokens[:len(branch)] == branch
                              for b in self.branches):
            raise ValueError("the verdict accepted a branch the draft does not hold")
        self.committed.extend(self.draft[:n_accepted])
        position = self.end
        self.committed.extend(branch)
        self.committed.append(token)
        held = not branch and len(self.draft) > n_accepted and self.draft[n_accepted] == token
        fix = None
        if held:
            del self.draft[: n_accepted + 1]
            if self.draft_q is not None:
                del self.draft_q[: n_accepted + 1]
            self.branches = [b for b in self.branches if b.pos >= self.end]
        else:
            self.draft.clear()
            self.draft_q = None
            self.branches = []
            self.epoch += 1
            self.drafter_idle = False
            more = (*branch[1:], token) if branch else ()
            fix = Fix(self._next_fix_id, self.epoch, position, branch[0] if branch else token,
                      more)
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
            return [SessionVanished(w.session_id) if st is None else st.take_draft(w.k, w.side)
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
                                                          v.done, v.branch)))
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
