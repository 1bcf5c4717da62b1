"""A cheap drafter run in the verifier's own thread, at the start of each step's take.

In process, a drafter that drafts in microseconds (``Drafter.cheap``: MaG, Cacheback) gains
nothing from a thread of its own: the two threads share one interpreter lock, a step waits for
the drafts of the commit before it anyway, and the drafting loop's bookkeeping (rounds, chunks,
pacing, the store's lock taken twice a turn, the fix log read back) cost more than the drafting
(bench-host, 64 sessions with MaG: about 45 us a session-step on the drafting thread, against
~10 us for MaG's own proposal). ``InlineDrafts`` drafts each session asked for tokens right
before the step takes them, into the local store through the same ``SessionState.push_draft``
that checks a drafting thread's chunks, so the step, the store and the verdicts are what they
are with the thread; only when the drafting happens changes.

Each session keeps its draft session (``Drafter.open`` on its prompt and committed tokens) in
step with the store as a drafting loop does: the store's fixes applied in order
(``draft_lead.apply_fix``: a fix that agrees with the draft keeps it and lets it learn the
confirmed tokens), the tokens committed without a fix confirmed to it (``confirm``: it learns
them as a fix's), then cut back, without learning, to the end of the draft the store holds.
It drafts chains past the step's ask, to the whole window (``draft``): a whole draft
accepted with the next token as the step's own commits without a fix, and leaves the rest for
the next step.
A drafter that fails on a session costs that session its drafts (the verifier decodes it
alone), as a drafting thread's would; the step goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from ..config import EngineConfig
from ..drafters import Drafter, DraftSession
from ..drafters.draft_lead import apply_fix, output_room
from ..protocol.contract import DraftWant
from ..protocol.local_store import LocalSessionStore, SessionState

log = logging.getLogger("edgespec.engine.inline_drafts")


@dataclass
class _Inline:
    """A session's draft session, the store's state it follows (a session id used again is
    another session), the last of the store's fixes it applied and the committed end its
    draft session was last told of."""

    draft: DraftSession
    state: SessionState
    fix_id: int
    confirmed: int


class InlineDrafts:
    """Drafts for the local store's sessions in the caller's thread (``draft``)."""

    def __init__(self, drafter: Drafter, store: LocalSessionStore, cfg: EngineConfig):
        self.drafter, self.store = drafter, store
        self.window, self.tree_width = cfg.window, cfg.tree_width
        self.sessions: dict[str, _Inline] = {}
        self._closed_seen = 0  # the store's count of closed sessions at the last sweep

    def draft(self, wants: Sequence[DraftWant]) -> None:
        """Each session asked for k > 0 tokens and holding fewer gets its store's draft
        drafted (marked idle: the step need not wait for more) to at least k + 1, up to the
        whole window: the step takes k, the one past them is the drafter's guess at the
        step's own token, so a step that accepts the whole draft and whose token the guess
        holds commits without a fix (the draft session goes on as it stands), and the rest
        serves the next steps without a call. A board keeps a shorter lead
        (``draft_lead.lead_cap``: 2k + 2), since what it drafts that no step uses costs its
        core and its link; here such a token costs a step of the drafter's chain, while a
        call costs its fixed part (the store's fixes applied, the suffix match) whatever its
        length: bench-host, 64 sessions with MaG, 36 calls a step -> 21 at the window, host
        work 23.9 -> 22.1 us a session-step; the drafts as good (Spec-Bench replayed with a
        fixed draft length: the same tokens a forward, docs/measured/fleet-host).
        Trees are drafted to k: a tree's k + 1 would spend its branches on the one position
        no step takes them from. Never past the last position a step can verify before the
        session's output ends. Sessions the store no longer holds are closed."""
        store = self.store
        chains, window = self.tree_width <= 1, self.window
        sessions = store.sessions
        with store.lock:
            for w in wants:
                if w.k <= 0:
                    continue
                state = sessions.get(w.session_id)
                if state is None or not state.has_drafter or len(state.draft) >= w.k:
                    continue
                # a chain to the window: a call costs about the same however long its draft,
                # and a step that accepts the ask and the guess leaves the rest for the next,
                # which then needs no call
                # (compared, not max() and min(): a call each of the step's sessions)
                k = w.k if not chains else w.k + 1 if w.k >= window else window
                room = output_room(state.output_end, state.end)
                if room < k:
                    k = room
                try:
                    self._draft_one(w.session_id, state, k)
                except Exception as exc:  # a broken drafter costs speed, never the session
                    log.warning("the drafter cannot draft for session %s (%r); the verifier "
                                "decodes it alone", w.session_id, exc)
                    state.has_drafter = False
                    self._close(w.session_id)
            if store.closed != self._closed_seen:  # sessions ended since the last look
                self._closed_seen = store.closed
                for sid in [s for s in self.sessions if s not in sessions]:
                    self._close(sid)

    def _draft_one(self, sid: str, state: SessionState, k: int) -> None:
        s = self._synced(sid, state)
        if len(state.draft) >= k:  # the output's end cuts the lead to what the store holds
            return
        start = state.end + len(state.draft)
        d = s.propose_tree(k - len(state.draft), self.tree_width)
        # (idle, window, branches, checked) positional: a call in three of a step's sessions
        kept = state.push_draft(state.epoch, start, d.tokens, True, self.window, d.branches,
                                self.drafter.context_ids)
        if kept < len(d.tokens):  # the window cut it: the session holds what the store does
            s.retract(start + kept)

    def _synced(self, sid: str, state: SessionState) -> DraftSession:
        """The session's draft session, holding the store's tokens and draft: opened anew for
        a new session, and for one whose fixes the store's bounded log no longer all holds
        (asked for no tokens for that many steps: its fixes are not applied meanwhile)."""
        entry = self.sessions.get(sid)
        if entry is not None and (entry.state is not state or (
                state.fixes and state.fixes[0].id > entry.fix_id + 1)):
            self._close(sid)
            entry = None
        if entry is None:
            entry = _Inline(self.drafter.open(state.tokens + state.draft, state.params), state,
                            state.fixes[-1].id if state.fixes else 0, state.end)
            self.sessions[sid] = entry
            return entry.draft
        s = entry.draft
        if state.fixes and state.fixes[-1].id > entry.fix_id:  # a fix it has not applied
            for fix in state.fixes_after(entry.fix_id):
                apply_fix(s, fix.position, fix.tokens)
                entry.fix_id = fix.id
        if state.end > entry.confirmed:  # commits the draft held (no fix) are verified too
            s.confirm(state.end)
            entry.confirmed = state.end
        end = state.end + len(state.draft)
        if len(s.tokens) > end:  # tokens a fix agreed with, beyond what the store holds
            s.retract(end)
        elif len(s.tokens) < end:  # cannot happen while the store is the only writer
            raise RuntimeError(f"the draft session holds {len(s.tokens)} tokens, the store "
                               f"{end}")
        return s

    def _close(self, sid: str) -> None:
        entry = self.sessions.pop(sid, None)
        if entry is not None:
            try:
                entry.draft.close()
            except Exception as exc:  # a failing close costs nothing but the log line
                log.warning("closing the draft of session %s failed: %r", sid, exc)

    def close(self) -> None:
        for sid in list(self.sessions):
            self._close(sid)
