"""The in-process drafter thread: drafts ahead into every session of a ``LocalSessionStore``.

For each session with room (the window W beyond the committed position) it proposes a chunk of
at most c tokens (a chain, or with ``tree_width`` > 1 a chain with branches) and pushes it; it
applies the verifier's fixes by rollback before drafting again, and never waits for the
verifier. A drafter that fails on a session costs that session its drafts, never its output.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from .config import EngineConfig
from .drafters import Drafter, DraftSession
from .protocol import StaleChunkError
from .session import LocalSessionStore, SessionState

log = logging.getLogger("edgespec.engine")


@dataclass
class _DraftWork:
    """A session the drafter thread drafts for this round."""

    sid: str
    state: SessionState
    session: DraftSession
    epoch: int
    start: int
    room: int


class DraftWorker(threading.Thread):
    """Drafts for every session of a store, never waiting for the verifier."""

    def __init__(self, drafter: Drafter, store: LocalSessionStore, cfg: EngineConfig):
        super().__init__(daemon=True, name=f"drafter-{drafter.name}")
        self.drafter, self.store, self.cfg = drafter, store, cfg
        self.sessions: dict[str, tuple[DraftSession, list[int]]] = {}  # sid -> (session, [fix id])
        self.stopping = False

    def stop(self) -> None:
        with self.store.cond:
            self.stopping = True
            self.store.cond.notify_all()
        self.join(timeout=5)

    def run(self) -> None:
        while True:
            with self.store.cond:
                if self.stopping:
                    break
                work = self._plan()
                if not work:
                    self.store.cond.wait(timeout=0.5)
                    continue
            for w in work:
                try:
                    # a width of 1 is propose's chain
                    draft = w.session.propose_tree(min(self.cfg.chunk, w.room),
                                                   self.cfg.tree_width)
                except Exception as exc:  # a broken drafter costs speed, never the session
                    self._give_up(w.sid, w.state, exc)
                    continue
                idle = len(draft) == 0
                with self.store.cond:
                    try:
                        w.state.push_draft(w.epoch, w.start, draft.tokens, idle=idle,
                                           window=self.cfg.window, branches=draft.branches)
                    except StaleChunkError:
                        pass  # a fix arrived meanwhile; it is applied on the next round
                    self.store.cond.notify_all()
        for sid in list(self.sessions):
            self._close(sid)

    def _close(self, sid: str) -> None:
        """Forget a draft session and release what it holds (a KV slot); a failing close is
        logged, never fatal to the thread."""
        entry = self.sessions.pop(sid, None)
        if entry is None:
            return
        try:
            entry[0].close()
        except Exception as exc:
            log.warning("drafter %s failed to close session %s: %r", self.drafter.name, sid, exc)

    def _drop(self, sid: str, state: SessionState) -> None:
        """Under the lock: this session drafts no more (the verifier decodes it alone, and is
        woken so that it does not wait out the draft deadline); its draft session is closed."""
        state.has_drafter = False
        self._close(sid)
        self.store.cond.notify_all()

    def _give_up(self, sid: str, state: SessionState, exc: Exception) -> None:
        log.warning("drafter %s failed on session %s: %r; the verifier decodes it alone",
                    self.drafter.name, sid, exc)
        with self.store.cond:
            self._drop(sid, state)

    def _plan(self) -> list[_DraftWork]:
        """Under the lock: open new sessions, apply fixes, close finished ones, and list the
        sessions that have room to draft into."""
        work = []
        for sid, state in self.store.sessions.items():
            if not state.has_drafter or state.done:
                continue
            if sid not in self.sessions:
                try:
                    self.sessions[sid] = (self.drafter.open(state.tokens, state.params), [0])
                except Exception as exc:  # e.g. no free KV slot: this session drafts nothing
                    log.warning("drafter %s refused session %s: %r", self.drafter.name, sid, exc)
                    self._drop(sid, state)
                    continue
            session, last_fix = self.sessions[sid]
            try:
                for fix in state.fixes_after(last_fix[0]):
                    session.rollback(fix.position)
                    session.append(fix.tokens)
                    last_fix[0] = fix.id
            except Exception as exc:  # as a failed propose: the verifier decodes it alone
                log.warning("drafter %s failed to apply a fix to session %s: %r",
                            self.drafter.name, sid, exc)
                self._drop(sid, state)
                continue
            start = len(session.tokens)
            room = self.cfg.window - (start - state.end)
            if state.drafter_idle or room <= 0 or start != state.end + len(state.draft):
                continue
            work.append(_DraftWork(sid, state, session, state.epoch, start, room))
        for sid in [s for s in self.sessions if s not in self.store.sessions
                    or self.store.sessions[s].done]:
            self._close(sid)
        return work
