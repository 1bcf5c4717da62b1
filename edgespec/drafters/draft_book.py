"""What a drafting loop knows of the sessions it drafts for (``drafting_loop``): a
``DraftTarget`` per session in a ``DraftBook``, which the loop's transport fills (a new session,
the verifier's commits and fixes, a close) under the channel's lock, and which times each move
of a session's committed end until its next usable draft (``LoopCounts``)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ..config import SamplingParams
from .base import DraftSession
from .chunk_pace import ChunkPace, LoopCounts

log = logging.getLogger("edgespec.drafting")


@dataclass
class DraftTarget:
    """A session the loop drafts for."""

    params: SamplingParams
    epoch: int  # the session's epoch as the loop knows it: chunks carry it
    committed_end: int
    opening: list[int] | None = None  # the tokens to open the draft session on, until opened
    draft: DraftSession | None = None
    idle: bool = False  # its last chunk was empty: nothing more until a fix
    refused: bool = False  # the drafter failed on it: no more drafts
    closed: bool = False
    busy: bool = False  # the loop is opening or drafting it outside the lock
    fixes: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # (position, tokens)
    # where the draft session's tokens that the cache does not hold begin (a fix that agreed
    # with them kept them): sent again before anything new is drafted
    held_from: int | None = None
    # the last fix agreed with the tokens it held (a step decoded them before their chunk came:
    # the board is behind the steps), where a one-token chunk would be overtaken again
    overtaken: bool = False
    last_commit_s: float | None = None  # when the committed end last moved (monotonic)
    wanted: int | None = None  # draft tokens the verifier's last step asked of it (None: unsaid)
    sent_end: int | None = None  # where the chunks handed on under this epoch end
    moved_s: float | None = None  # when the committed end last moved past the tokens sent
    # the position past the session's last output token (prompt + max_new_tokens; None: not
    # said): a chain token drafted at output_end - 1 or beyond is of no use to any step
    output_end: int | None = None


class DraftBook:
    """The sessions a loop drafts for. Every method is called under the channel's lock."""

    def __init__(self, pace: bool = True) -> None:
        """``pace`` False: chunks of the channel's ``chunk`` tokens always."""
        self.targets: dict[str, DraftTarget] = {}
        # draft sessions of closed targets, for the loop's thread to close
        self.retired: list[tuple[str, DraftSession]] = []
        self.pace = ChunkPace(enabled=pace)
        self.counts = LoopCounts()  # what the loop drafted, sent, kept and threw away
        self.news = False  # a session came, moved or was fixed since the round was planned

    def assign(self, sid: str, tokens: list[int], params: SamplingParams, epoch: int,
               output_end: int | None = None) -> None:
        """A session to draft for, from ``tokens`` (prompt + committed) under ``epoch``;
        ``output_end``: the position past its last output token, if said."""
        self.close(sid)
        self.targets[sid] = DraftTarget(params, epoch, len(tokens), opening=list(tokens),
                                        output_end=output_end)
        self.news = True

    def commit(self, sid: str, epoch: int, committed_end: int, wanted: int | None = None
               ) -> DraftTarget | None:
        """The verifier committed up to ``committed_end`` (and asked ``wanted`` draft tokens
        of the session in that step, if it said); the session's target, if known."""
        t = self.targets.get(sid)
        if t is not None and epoch >= t.epoch:
            self._moved(t, committed_end)
            if wanted is not None and wanted != t.wanted:
                t.wanted, self.news = wanted, True
        return t

    def _moved(self, t: DraftTarget, committed_end: int) -> None:
        """The committed end is ``committed_end`` (or further): a verifier step when it moved.
        Unless the tokens sent reach past it (the cache holds the next draft already), the
        session waits for a chunk from there: timed until one is handed on (``served``)."""
        if committed_end > t.committed_end:
            now = time.monotonic()
            if t.last_commit_s is not None and t.wanted != 0:  # resting, it hears of no step
                self.pace.step_seen(now - t.last_commit_s)
            t.last_commit_s = now
            t.committed_end = committed_end
            self.news = True
            if t.draft is None or t.refused:  # not drafted for (yet): nothing to time
                t.moved_s = None
                return
            self.counts.commits_seen += 1
            if t.sent_end is not None and t.sent_end > committed_end:
                self.counts.commits_ahead += 1
                t.moved_s = None
            else:
                t.moved_s = now

    def served(self, t: DraftTarget, start: int, n: int, job_s: tuple[float, float] | None
               ) -> None:
        """A chunk of ``n`` tokens at ``start`` was handed on (``job_s``: when the job that
        drafted it began and ended; None: tokens held across a fix, sent again undrafted)."""
        t.sent_end = start + n
        if t.moved_s is None or not n or not start <= t.committed_end < start + n:
            return
        now, moved = time.monotonic(), t.moved_s
        c = self.counts
        c.commits_served += 1
        c.served_s += now - moved
        if job_s is None:
            c.queued_s += now - moved
        else:
            began, ended = job_s
            c.queued_s += max(0.0, began - moved)
            c.drafting_s += max(0.0, ended - max(began, moved))
        t.moved_s = None

    def fix(self, sid: str, epoch: int, position: int, tokens: tuple[int, ...]) -> None:
        """The verifier's fix: roll back to ``position``, append ``tokens``, go on under
        ``epoch`` (applied by the loop before it drafts again)."""
        t = self.targets.get(sid)
        if t is None or epoch <= t.epoch:
            return
        t.epoch, t.idle = epoch, False
        t.sent_end = None  # the cache drops the session's draft with its epoch
        self.news = True
        self._moved(t, position + len(tokens))
        if not t.refused:
            t.fixes.append((position, tuple(tokens)))

    def close(self, sid: str) -> None:
        t = self.targets.pop(sid, None)
        if t is not None:
            self.retire(sid, t)

    def close_all(self) -> None:
        for sid in list(self.targets):
            self.close(sid)

    def retire(self, sid: str, t: DraftTarget) -> None:
        """Mark a target closed and hand its draft session to the loop to close (a busy one
        is handed over when its job returns)."""
        t.closed = True
        if not t.busy:
            self.release_draft(sid, t)

    def release_draft(self, sid: str, t: DraftTarget) -> None:
        """Hand a target's draft session (if any) to the loop to close."""
        if t.draft is not None:
            self.retired.append((sid, t.draft))
            t.draft = None

    def take_retired(self) -> list[tuple[str, DraftSession]]:
        out, self.retired = self.retired, []
        return out


def close_drafts(drafts: list[tuple[str, DraftSession]]) -> None:
    """Outside the lock, on the loop's thread: release retired draft sessions."""
    for sid, draft in drafts:
        try:
            draft.close()
        except Exception as exc:  # a failing close costs nothing but the log line
            log.warning("closing the draft of session %s failed: %r", sid, exc)
