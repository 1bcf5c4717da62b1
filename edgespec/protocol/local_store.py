"""The session protocol (``edgespec.protocol.contract``), in process.

One ``SessionState`` per generation holds what the shared draft cache holds in the distributed
system: the prompt, the committed tokens, the current draft beyond them, its branches, and the
epoch. The drafter pushes chunks (``push_draft``), the verifier takes a draft (``take_draft``)
and commits its verdict (``commit``), which may publish a ``Fix``. ``LocalSessionStore`` is the
verifier's side over many sessions, the ``SessionStore`` the Redis store also implements, with
the same rules (tests/test_store_contract.py):

- a chunk carries the epoch it was drafted under and the position it starts at; a stale epoch,
  a gap or an overlap, or a finished session is refused (``StaleChunkError``); the window
  bounds the draft; branches are kept by ``protocol.chunk_branches``, at most MAX_BRANCHES;
- a commit appends accepted + branch + the verifier's own token; when the draft did not hold
  that token at that position (a rejection, a bonus token past the draft, no draft, or a
  branch), the epoch is bumped, the draft and its branches dropped, and a fix published; a held
  commit keeps the branches still ahead;
- a verdict is refused when its epoch or position is stale, when it accepts more tokens than
  were drafted, or a branch the draft does not hold; one replayed after it landed (same end,
  same last token) is answered as applied, without a fix, and changes nothing;
- fixes are kept in an ordered, bounded log with increasing ids, so a drafter reads what it
  missed (the Redis stream of the distributed cache).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..config import SamplingParams
from .lineage import Lineage
from .fleet_table import FleetTable, record_output
from .contract import (APPLIED, MAX_BRANCHES, Branch, CommitOutcome, DraftWant, Fix,
                       SessionVanished, StaleChunkError, TakenDraft, Verdict, check_draft_ids,
                       chunk_branches, take_branches)


@dataclass
class SessionState:
    session_id: str
    prompt: list[int]
    committed: list[int] = field(default_factory=list)
    draft: list[int] = field(default_factory=list)
    branches: list[Branch] = field(default_factory=list)  # at: within self.draft
    epoch: int = 0
    drafter_idle: bool = False  # the drafter has nothing more for the current draft end
    has_drafter: bool = False
    params: SamplingParams = field(default_factory=SamplingParams)
    vocab_size: int | None = None  # draft token ids must be below it (None: not checked)
    done: bool = False
    wanted: int | None = None  # the draft tokens the verifier's last step asked of it
    # its output's length at most (0: not said; a loosely verified session's is not: its drafts
    # past the end may confirm a mismatch before it)
    max_new_tokens: int = 0
    fixes: deque = field(default_factory=lambda: deque(maxlen=256))
    _next_fix_id: int = 1
    # position after the last committed token, kept as tokens are committed (``commit``):
    # read several times a session and step, by the verifier and the drafting thread
    end: int = field(init=False)

    def __post_init__(self) -> None:
        self.end = len(self.prompt) + len(self.committed)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.committed

    @property
    def output_end(self) -> int | None:
        """The position past its last output token (None: not said)."""
        return len(self.prompt) + self.max_new_tokens if self.max_new_tokens > 0 else None

    def push_draft(self, epoch: int, start: int, tokens: list[int], idle: bool = False,
                   window: int = 1 << 30, branches=(), checked: bool = False) -> int:
        """Append a drafted chunk; returns how many tokens were kept (the window bounds it).
        ``branches``: alternatives to the chunk's tokens (``at`` relative to the chunk). Token
        ids are checked here, where drafts enter, and trusted by the verifier afterwards: an id
        outside the vocabulary raises ValueError (the drafting loop then stops drafting for
        the session, which the verifier decodes alone). ``checked``: ids known to be checked
        already (an in-process drafter of ``Drafter.context_ids``, drafting inline)."""
        if self.vocab_size is not None and not checked:
            check_draft_ids(tokens, self.vocab_size)
            if branches:
                check_draft_ids([t for b in branches for t in b.tokens], self.vocab_size)
        if self.done:
            raise StaleChunkError(f"session {self.session_id} is finished")
        if epoch != self.epoch:
            raise StaleChunkError(f"chunk from epoch {epoch}, session is at epoch {self.epoch}")
        expected = self.end + len(self.draft)
        if start != expected:
            raise StaleChunkError(f"chunk starts at {start}, the draft ends at {expected}")
        keep = window - len(self.draft)  # (compared, not min() and max(): a hot call)
        if keep > len(tokens):
            keep = len(tokens)
        elif keep < 0:
            keep = 0
        if keep:
            self.draft.extend(tokens[:keep])
            room = MAX_BRANCHES - len(self.branches)
            if branches and room > 0:
                offset = len(self.draft) - keep  # the chunk's first token in the draft
                # as the Redis store: the chunk's branches first (at most MAX_BRANCHES), then
                # those of kept tokens, up to the room left
                kept = [b for b in chunk_branches(tokens, branches, len(tokens)) if b.at < keep]
                self.branches.extend(Branch(offset + b.at, b.tokens) for b in kept[:room])
        self.drafter_idle = idle
        return keep

    def draft_ready(self, k: int) -> bool:
        """True when waiting longer would not give the verifier a longer draft."""
        return not self.has_drafter or self.drafter_idle or len(self.draft) >= k

    def take_draft(self, k: int, branch_budget: int = 0) -> TakenDraft:
        """Up to k draft tokens, and branches hanging from them of at most ``branch_budget``
        tokens in all."""
        if k <= 0:  # nothing asked: no branch can hang from an empty spine, and it is ready
            return TakenDraft(self.epoch, self.end, [], [], True)  # ready
        spine = self.draft[:k]  # ready: ``draft_ready``, inline (a call a session and step)
        # positional (ready, drafting): a keyword costs this call a third more, and it is
        # made for every session of every step
        return TakenDraft(self.epoch, self.end, spine,
                          take_branches(self.branches, len(spine), branch_budget)
                          if self.branches else [],
                          not self.has_drafter or self.drafter_idle or len(spine) >= k,
                          self.has_drafter)

    def is_replay(self, v: Verdict) -> bool:
        """Whether ``v`` already landed (its commit's reply was lost): the session ends where
        it would leave it, with its token (so it starts before that end: the common verdict,
        starting at the session's end, is told apart without computing where it ends)."""
        return v.start != self.end and self.end == v.end and \
            (self.committed[-1] if self.committed else self.prompt[-1]) == v.token

    def commit(self, v: Verdict) -> Fix | None:
        """Apply the verifier's verdict on a draft it took (module docstring: the rules)."""
        if v.start != self.end:
            raise StaleChunkError(f"verdict at {v.start}, the session ends at {self.end}")
        if v.epoch != self.epoch:
            raise StaleChunkError(f"verdict for epoch {v.epoch}, session is at epoch "
                                  f"{self.epoch}")
        n, draft = v.n_accepted, self.draft
        if n > len(draft):
            raise StaleChunkError(f"accepted {n} of a {len(draft)}-token draft")
        branch = tuple(v.branch) if v.branch else ()
        if branch and not v.own_branch and not any(
                b.at == n and b.tokens[:len(branch)] == branch for b in self.branches):
            raise StaleChunkError("the verdict accepted a branch the draft does not hold")
        committed = self.committed
        if n:
            committed.extend(draft[:n])
        if branch:
            committed.extend(branch)
        committed.append(v.token)
        self.end += n + len(branch) + 1  # ``v.end``: its start was this end (checked above)
        held = not branch and len(draft) > n and draft[n] == v.token
        fix = None
        if held:
            del draft[: n + 1]
            if self.branches:
                self.branches = [Branch(b.at - n - 1, b.tokens) for b in self.branches
                                 if b.at > n]
        else:
            draft.clear()
            self.branches = []
            self.epoch += 1
            self.drafter_idle = False
            fix = Fix.of_verdict(v, self.epoch, self._next_fix_id)
            self._next_fix_id += 1
            self.fixes.append(fix)
        self.done = self.done or bool(v.finish_reason)  # ``v.done``
        self.wanted = v.wanted
        return fix

    def fixes_after(self, fix_id: int) -> list[Fix]:
        out = []
        for f in reversed(self.fixes):  # the newest first: usually one or none is new
            if f.id <= fix_id:
                break
            out.append(f)
        return out[::-1]


class LocalSessionStore:
    """Sessions of one process under one lock, with two conditions on it: ``cond`` wakes the
    drafter on news (a new session, a commit, a close: the sessions concerned are kept in
    ``changed`` once a drafter reads them, so that it reads only those), ``drafts_in`` wakes
    the verifier once every draft it waits for is ready (checked as each chunk lands, for its
    session only: waiting costs nothing per chunk of the other sessions).

    The verifier's side of the store (``create``, ``take_when_ready``, ``commit_many``,
    ``close``) is the interface the Redis-backed store of the distributed cache also offers.
    """

    wait_ms = 0.0  # no remote drafter to wait for: the engine's drafter suggests its own

    def __init__(self, fleet: FleetTable | None = None, vocab_size: int | None = None) -> None:
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.drafts_in = threading.Condition(self.lock)
        self.sessions: dict[str, SessionState] = {}
        self.fleet = fleet  # taught each session's output when it closes, as the cache does
        self.vocab_size = vocab_size  # the target's: draft ids are checked against it
        self.changed: set[str] | None = None  # kept once a drafter reads it (``read_changes``)
        self._awaited: dict[str, int] = {}  # session -> the draft length the verifier waits for
        self.closed = 0  # sessions closed so far (a reader of ``sessions`` knows when to look)

    def read_changes(self) -> set[str]:
        """Under the lock: the sessions created, committed or closed since the last call (the
        first call starts the record)."""
        out, self.changed = self.changed or set(), set()
        return out

    def _record(self, session_id: str) -> None:
        """Under the lock: ``session_id`` changed, for the drafter to read."""
        if self.changed is not None:
            self.changed.add(session_id)

    def create(self, session_id: str, prompt: list[int], params: SamplingParams,
               drafter: str | None, max_new_tokens: int = 0,
               committed: Sequence[int] = (), verify: str = "exact",
               lineage: Lineage = Lineage()) -> None:
        """A session (in process: nothing resumes it, so its ``lineage`` is not kept)."""
        with self.lock:
            if session_id in self.sessions:
                raise ValueError(f"session {session_id} exists")
            self.sessions[session_id] = SessionState(session_id, list(prompt), list(committed),
                                                     has_drafter=bool(drafter),
                                                     params=params, vocab_size=self.vocab_size,
                                                     max_new_tokens=max_new_tokens
                                                     if verify != "loose" else 0)
            self._record(session_id)
            self.cond.notify_all()

    def push_draft(self, session_id: str, epoch: int, start: int, tokens: list[int],
                   idle: bool = False, window: int = 1 << 30, branches=()) -> int:
        """The drafter's chunk (``SessionState.push_draft``), waking the verifier if it was
        the last draft it waited for. Raises StaleChunkError for an unknown session."""
        with self.lock:
            state = self.sessions.get(session_id)
            if state is None:
                raise StaleChunkError(f"unknown session {session_id}")
            try:
                return state.push_draft(epoch, start, tokens, idle=idle, window=window,
                                        branches=branches)
            finally:
                self._draft_moved(session_id)

    def drafter_gone(self, session_id: str) -> None:
        """The drafter gives up on a session: the verifier decodes it alone, without waiting."""
        with self.lock:
            state = self.sessions.get(session_id)
            if state is not None:
                state.has_drafter = False
            self._draft_moved(session_id)

    def _draft_moved(self, session_id: str) -> None:
        k = self._awaited.get(session_id)
        if k is None:
            return
        state = self.sessions.get(session_id)
        if state is None or state.draft_ready(k):
            del self._awaited[session_id]
            if not self._awaited:
                self.drafts_in.notify_all()

    def take_when_ready(self, wants: list[DraftWant], wait_s: float
                        ) -> list[TakenDraft | SessionVanished]:
        """Wait up to ``wait_s`` (each session at most its own ``wait_s``) until every
        session's draft is ready (those not to wait for aside), then take up to k tokens of
        each."""
        now = time.monotonic()
        deadline = now + wait_s
        with self.lock:
            states = [self.sessions.get(w.session_id) for w in wants]
            until = {w.session_id: w.waits_until(deadline, now) for st, w in zip(states, wants)
                     if st is not None and w.wait and not st.draft_ready(w.k)}
            self._awaited = {}
            if until:  # a draft to wait for (never when drafted inline)
                self._awaited = {w.session_id: w.k for w in wants if w.session_id in until}
            while self._awaited:
                now = time.monotonic()
                for sid in [s for s in self._awaited if until[s] <= now]:
                    del self._awaited[sid]  # waited for as long as its draft is worth
                if not self._awaited:
                    break
                self.drafts_in.wait(timeout=min(until[s] for s in self._awaited) - now)
            self._awaited = {}
            return [SessionVanished(w.session_id) if st is None
                    else st.take_draft(w.k, w.branch_budget) for st, w in zip(states, wants)]

    def commit_many(self, verdicts: list[Verdict]) -> list[CommitOutcome]:
        out = []
        with self.lock:
            get, changed = self.sessions.get, self.changed
            for v in verdicts:
                state = get(v.session_id)
                try:
                    if state is None:
                        raise StaleChunkError(f"unknown session {v.session_id}")
                    # (a verdict at the session's end, the common one, is no replay: not asked)
                    if v.start != state.end and state.is_replay(v):
                        out.append(APPLIED)
                        continue
                    fix = state.commit(v)
                    out.append(APPLIED if fix is None else CommitOutcome(fix))
                except StaleChunkError as e:
                    out.append(CommitOutcome(error=str(e)))
                if changed is not None:  # ``_record``, inline: once a session and step
                    changed.add(v.session_id)
            self.cond.notify_all()
        return out

    def close(self, session_id: str, finish_reason: str = "stop") -> None:
        self.close_many({session_id: finish_reason})

    def close_many(self, finished: Mapping[str, str]) -> None:
        """Sessions that ended (id -> finish reason), under one hold of the lock."""
        with self.lock:
            closed = []
            for session_id in finished:
                state = self.sessions.pop(session_id, None)
                if state is not None:
                    state.done = True
                    closed.append(state)
                    self.closed += 1
                self._record(session_id)
                self._draft_moved(session_id)
            self.cond.notify_all()
        if self.fleet is not None:
            for state in closed:
                record_output(self.fleet, state.tokens, len(state.prompt))
