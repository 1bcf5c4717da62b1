"""The in-process drafter thread: the drafting loop (``edgespec.drafters.drafting_loop``) over the
local session store, the same loop an edge board's agent runs over the cache's Attach stream.

``LocalChannel`` is the loop's transport here: each round it records in the book the store's new
sessions, their fixes (from the store's fix log) and commits, and the sessions that ended; a
chunk is pushed into the session's state; a session the drafter fails on is handed to the
verifier alone (``has_drafter`` off, the verifier woken so that it does not wait out the draft
deadline).
"""

from __future__ import annotations

import threading

from ..config import EngineConfig
from ..drafters import Draft, Drafter
from ..drafters.draft_book import DraftBook, DraftTarget
from ..drafters.drafting_loop import run_drafting
from ..protocol.contract import StaleChunkError
from ..protocol.local_store import LocalSessionStore

# a cheap drafter's jobs a turn: each turn takes the store's lock twice, which the verifier
# waits on (bench-host, 64 sessions, MaG: see docs/measured/fleet-host)
JOBS_AT_ONCE = 16


class LocalChannel:
    """The drafting loop's transport over a ``LocalSessionStore``."""

    def __init__(self, store: LocalSessionStore, cfg: EngineConfig, cheap: bool = False,
                 batch_jobs: int = 1):
        """``cheap``: the drafter drafts in microseconds (``Drafter.cheap``); ``batch_jobs``:
        the sessions it drafts together (``Drafter.batch_jobs``)."""
        self.store, self.cond = store, store.cond
        self.window, self.chunk, self.tree_width = cfg.window, cfg.chunk, cfg.tree_width
        self.jobs_at_once = JOBS_AT_ONCE if cheap else batch_jobs
        # chunks beyond the next step's ask as long as any: the drafting thread's work is the
        # verifier's host's, a round of it a chunk (bench-host: half the thread's time at 64
        # sessions with MaG against chunks of AHEAD_CHUNK); a cheap drafter's chunk is all
        # the room its session has (MaG at 64 sessions: 1.5 -> 1.1 chunks a session-step)
        self.chunk = cfg.window if cheap else cfg.chunk
        self.ahead_chunk = self.first_chunk = self.chunk
        self._last_fix: dict[str, int] = {}  # sid -> the last fix id the book has
        with store.lock:
            store.read_changes()  # from now on the store keeps what changed
            self._unread = set(store.sessions)  # sessions created before: read once

    def refresh(self, book: DraftBook) -> None:
        """Only the sessions the store says changed (created, committed, closed)."""
        changed = self.store.read_changes()
        if self._unread:
            changed |= self._unread
            self._unread = set()
        for sid in changed:
            state = self.store.sessions.get(sid)
            if state is None or state.done:
                if sid in book.targets:
                    book.close(sid)
                self._last_fix.pop(sid, None)
                continue
            if not state.has_drafter:
                continue
            if sid not in book.targets:
                book.assign(sid, state.tokens, state.params, state.epoch, state.output_end)
                self._last_fix[sid] = state.fixes[-1].id if state.fixes else 0
                continue
            for fix in state.fixes_after(self._last_fix[sid]):
                book.fix(sid, fix.epoch, fix.position, fix.tokens)
                self._last_fix[sid] = fix.id
            book.commit(sid, state.epoch, state.end, state.wanted)

    def can_draft(self, sid: str, start: int) -> bool:
        state = self.store.sessions.get(sid)
        return state is not None and not state.drafter_idle and \
            start == state.end + len(state.draft)

    def deliver(self, sid: str, target: DraftTarget, start: int, draft: Draft) -> None:
        try:
            self.store.push_draft(sid, target.epoch, start, draft.tokens, idle=len(draft) == 0,
                                  window=self.window, branches=draft.branches)
        except StaleChunkError:
            pass  # a fix the book has not seen yet (applied next round), or a closed session

    def refuse(self, sid: str, target: DraftTarget, start: int, why: str) -> None:
        self.store.drafter_gone(sid)  # the verifier stops waiting for its drafts


class DraftWorker(threading.Thread):
    """Drafts for every session of a store, never waiting for the verifier."""

    def __init__(self, drafter: Drafter, store: LocalSessionStore, cfg: EngineConfig):
        super().__init__(daemon=True, name=f"drafter-{drafter.name}")
        self.drafter = drafter
        self.channel = LocalChannel(store, cfg, cheap=drafter.cheap,
                                    batch_jobs=max(1, drafter.batch_jobs))
        self.book = DraftBook()
        self.stopping = False

    def stop(self) -> None:
        with self.channel.cond:
            self.stopping = True
            self.channel.cond.notify_all()
        self.join(timeout=5)

    def run(self) -> None:
        run_drafting(self.drafter, self.channel, self.book, lambda: not self.stopping)
