"""One drafting loop for every drafter: the in-process engine's drafter thread and an edge
board's agent run this same loop, each over its transport (a ``DraftChannel``): the local
session store, or the draft cache's Attach stream.

The loop keeps a ``DraftTarget`` per session it drafts for, in a ``DraftBook`` guarded by the
channel's lock. The transport records what happens to the sessions (a new one, the verifier's
commits and fixes, a close) in the book, under that lock. The loop plans a round under the lock: it
applies the fixes received, sends held tokens again, and lists its jobs: the sessions to open, then
every session with room in its window (W tokens beyond the committed position, or fewer: about twice
what the verifier's last step asked of it, ``lead_cap``; none while it asks 0; never past the
last token a step could verify before the session's output ends, ``lead_room``), furthest behind
first, a chunk each (beyond what the verifier's next step asks, chunks of the channel's
``ahead_chunk``: a board's is AHEAD_CHUNK, so that a fix that comes while one is drafted waits for
no more than that; from the committed end, after a fix or at the opening, the channel's
``first_chunk``: a board's is one token, so that the next step, which waits for it, gets its first
token a token's drafting sooner; in process, where the verifier and the drafter share the host, the
whole chunk, since each chunk costs the host its own round of work). It does the jobs in turns, each
job checked under the lock first (a job whose session was fixed, closed or moved since is left to
the next round), and plans a new round when the round is done or news came (a session, a commit, a
fix): one pass over the sessions a round, not one a chunk. A turn is one job, or several where the
channel asks for it (``jobs_at_once``): a drafter that drafts in microseconds in process (each turn
costs the verifier's host a lock round trip), and a drafter that drafts several sessions a forward
(``Drafter.batch_jobs``, llama.cpp's sequences), whose turn is a round's chunks in one
``propose_many``: a turn's chunks are handed on when its longest is done, and a fix that arrives
meanwhile waits for the turn. It does a turn's jobs outside the lock (``drafting_turn``), so
receiving a fix or a commit never waits behind a model drafter's forward, then hands the chunks to
the transport under the lock, unless a fix arrived meanwhile: a chunk then waits in the draft
session for that fix to judge it.

A fix (roll back to a position, append the verifier's tokens) is applied against everything the
draft session holds, sent or not (``apply_fix``): where the session's tokens already hold the
fix's tokens at its position (the verifier's bonus token was the drafter's next one, or a step
decoded a token while the chunk that held it was in flight) nothing is rolled back, and the
tokens beyond are *held*: the cache dropped them with the epoch, so they go out again, first,
as a chunk at the fix's end under its epoch, with no drafting. Only a fix that disagrees throws
drafted tokens away, from the first token that differs. Without this, a board whose chunk takes
longer than one verifier step never got a draft in (each chunk dropped by the fix of a step that
decoded without it, which sends the next fix).

Chunks are sized (``ChunkPace``) so that each lands before the verifier's next step: from the
step interval the loop sees in the commits and its own seconds per drafted token, shared by the
sessions it drafts for; at most the channel's chunk, at least 1 token.

A draft session is only ever touched by the loop's thread: a session closed by the transport
is marked closed and its draft session handed to the loop, which closes it (a model drafter's
KV slot is freed by the thread that runs its forwards). Of the sessions with room, the one
furthest behind is drafted first, so that every session gets its chunk in turn. A session whose
drafter fails (open, propose or a fix) is refused through the transport: it costs the session
its drafts, never its output; the verifier decodes it alone. A transport call that fails is
logged and costs its session its drafts, never the loop.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Protocol

from . import Draft, Drafter
# the book's classes, also reachable from here (agents and tests import them with the loop)
from .draft_book import DraftBook, DraftTarget, close_drafts
from .drafting_turn import ALONE_TURNS, Job, do_turn
# what a draft session holds ahead, also reachable from here (as the book's classes)
from .draft_lead import LEAD_SLACK, apply_fix, fix_draft, lead_cap, lead_room, output_room

__all__ = ["AHEAD_CHUNK", "LEAD_SLACK", "DraftBook", "DraftChannel", "DraftTarget",
           "apply_fix", "close_drafts", "lead_cap", "lead_room", "output_room",
           "run_drafting"]

log = logging.getLogger("edgespec.drafting")

# a chunk drafted beyond the verifier's next ask (for the step after, should this one accept
# it all) is this short, so that a fix arriving meanwhile waits for little of it
AHEAD_CHUNK = 2


class DraftChannel(Protocol):
    """A transport's side of the loop: its lock, its settings, and where chunks go."""

    cond: threading.Condition  # guards the book; notified when there is news for the loop
    window: int  # tokens drafted beyond the committed position
    chunk: int  # tokens per chunk
    ahead_chunk: int  # tokens per chunk beyond what the verifier's next step asks
    first_chunk: int  # tokens in the chunk that starts at the committed end (after a fix)
    tree_width: int  # 1: chains; more: chains with up to tree_width - 1 branches
    # jobs done in one turn outside the lock, their chunks handed on in one turn under it:
    # 1 for a drafter whose job takes a forward (a fix waits for no more than one), more for
    # one that drafts in microseconds (in process, each turn costs the verifier's host a
    # lock round trip and a wake-up) or drafts several sessions a forward (a fix waits for
    # the turn: its forwards for them all)
    jobs_at_once: int

    def refresh(self, book: DraftBook) -> None:
        """Under the lock: record in the book what happened to the sessions since the last
        round (a transport that records as messages come does nothing)."""

    def can_draft(self, sid: str, start: int) -> bool:
        """Under the lock: whether a chunk at ``start`` would be placed (a transport that
        cannot tell says True)."""

    def deliver(self, sid: str, target: DraftTarget, start: int, draft: Draft) -> None:
        """Under the lock: hand on a chunk drafted at ``start`` under ``target.epoch``."""

    def refuse(self, sid: str, target: DraftTarget, start: int, why: str) -> None:
        """Under the lock: the drafter failed on this session; tell the verifier that no
        drafts are coming (``start``: where the session's draft ends)."""


def run_drafting(drafter: Drafter, channel: DraftChannel, book: DraftBook,
                 keep_going: Callable[[], bool]) -> None:
    """Draft for the book's sessions until ``keep_going()`` (asked under the lock) is False;
    one loop per book. On the way out, the book's sessions are closed."""
    cond = channel.cond
    queue: list[Job] = []  # the round planned: its jobs, furthest behind first
    alone_turns = 0  # turns left that draft sessions one by one (a call of several broke)
    try:
        while True:
            with cond:
                retired = book.take_retired()
                going = keep_going()
                jobs: list[Job] = []
                if going:
                    try:
                        channel.refresh(book)
                    except Exception:  # the transport's trouble, not a session's
                        log.exception("the drafting loop could not read its sessions")
                    if book.news or not queue:
                        book.news = False
                        try:
                            queue = _plan_round(channel, book, max(1, drafter.batch_jobs))
                        except Exception:  # a bug's round, not the loop: the next plans again
                            log.exception("the drafting loop could not plan its round")
                            queue = []
                    jobs = _pop_jobs(queue, channel, book, channel.jobs_at_once)
            close_drafts(retired)
            if not going:
                return
            if not jobs:
                with cond:
                    try:  # news that came since the round was planned: no wait
                        channel.refresh(book)
                    except Exception:
                        log.exception("the drafting loop could not read its sessions")
                    if not book.retired and not book.news:
                        cond.wait(timeout=0.5)
                continue
            done, paced, broke = do_turn(jobs, channel.tree_width, drafter,
                                          together=alone_turns == 0)
            alone_turns = ALONE_TURNS if broke else max(0, alone_turns - 1)
            with cond:
                for seconds, tokens in paced:
                    book.pace.drafted(seconds, tokens)
                for job, outcome, error in done:
                    _finish_or_refuse(job, outcome, error, channel, book)
                cond.notify_all()
    finally:
        with cond:
            book.close_all()
            retired = book.take_retired()
        close_drafts(retired)


def _apply_fixes(sid: str, t: DraftTarget, channel: DraftChannel, book: DraftBook) -> None:
    """Under the lock: the fixes received, in order (``apply_fix``); what a fix kept is held
    for sending again, what it threw away of the unsent tokens is counted."""
    assert t.draft is not None
    try:
        for position, tokens in t.fixes:
            before = len(t.draft.tokens)
            kept, cut = fix_draft(t.draft, position, tokens)
            t.overtaken = cut == position + len(tokens)  # it held the fix's tokens
            if kept:
                book.counts.tokens_kept += kept
                t.held_from = position + len(tokens)
                continue
            if t.held_from is not None and before > max(t.held_from, cut):
                book.counts.tokens_discarded += before - max(t.held_from, cut)
                book.counts.dropped["disagreed"] += 1
            t.held_from = None
    except Exception as exc:
        _refuse(sid, t, t.committed_end, f"applying a fix failed: {exc!r}", channel, book)
    t.fixes.clear()


def _send_held(sid: str, t: DraftTarget, channel: DraftChannel, book: DraftBook) -> None:
    """Under the lock: the draft session's held tokens (kept across a fix, not in the cache)
    sent again as a chunk at their position, as far as the window allows; no drafting."""
    assert t.draft is not None and t.held_from is not None
    start, have = t.held_from, len(t.draft.tokens)
    if have <= start:
        t.held_from = None
        return
    n = min(have - start, channel.window - (start - t.committed_end))
    if n <= 0 or not channel.can_draft(sid, start):
        return
    chunk = Draft(list(t.draft.tokens[start:start + n]))
    if _deliver(sid, t, start, chunk, channel, book, None):
        book.counts.chunks_resent += 1
        t.held_from = start + n if start + n < have else None


def _deliver(sid: str, t: DraftTarget, start: int, chunk: Draft, channel: DraftChannel,
             book: DraftBook, ran_s: tuple[float, float] | None) -> bool:
    """Under the lock: hand a chunk on (``ran_s``: when the job that drafted it ran); a failure
    costs the session its drafts."""
    try:
        channel.deliver(sid, t, start, chunk)
    except Exception as exc:  # e.g. a metrics call: the session loses its drafts, not more
        book.counts.dropped["failed"] += 1
        _refuse(sid, t, start, f"handing on its chunk failed: {exc!r}", channel, book)
        return False
    book.counts.chunks_sent += 1
    book.counts.tokens_sent += len(chunk)
    book.served(t, start, len(chunk), ran_s)
    return True


def _plan_round(channel: DraftChannel, book: DraftBook, together: int = 1) -> list[Job]:
    """Under the lock: apply the fixes received and send what they kept, then plan a round:
    every session to open, then every session with room for a chunk, furthest behind first
    (one pass over the sessions a round, not one a chunk). Returned in reverse, to pop."""
    for sid, t in list(book.targets.items()):
        if t.fixes and t.draft is not None:
            _apply_fixes(sid, t, channel, book)
        if t.held_from is not None and t.draft is not None and not t.refused:
            _send_held(sid, t, channel, book)
    opening: list[Job] = []
    chunks: list[tuple[int, Job]] = []  # (lead, job)
    drafting = 0  # the sessions a chunk is drafted for in turn: the pace shares the step
    for sid, t in book.targets.items():
        if t.refused or t.busy:
            continue
        if t.opening is not None:
            opening.append(Job(sid, t, True, t.epoch))
            continue
        if t.idle or t.draft is None or t.held_from is not None:
            continue
        drafting += 1
        start = len(t.draft.tokens)
        lead = start - t.committed_end
        room = lead_room(t, channel.window) - lead
        if room > 0 and channel.can_draft(sid, start):
            if t.wanted is not None and lead >= t.wanted:  # beyond the next step's ask
                room = min(room, channel.ahead_chunk)
            chunks.append((lead, Job(sid, t, False, t.epoch, start, room)))
    # the sessions drafted in turn: a drafter that drafts ``together`` sessions a forward drafts
    # a round's chunks in one turn of its forwards
    n = book.pace.chunk(channel.chunk, -(-drafting // together))
    chunks.sort(key=lambda lj: lj[0])
    # a chunk from the committed end (after a fix, or at the opening) is ``first_chunk``: the
    # next step's first token first; not where a turn drafts it beside longer chunks (a turn's
    # chunks are handed on together: it would come no sooner, only shorter), nor after a fix
    # that overtook the board's chunk (a board behind the steps gets its drafts verified by the
    # rest of an overtaken chunk, kept and sent again: a one-token chunk has no rest)
    first = together == 1 or all(lead == 0 for lead, _ in chunks)
    for lead, job in chunks:
        job.n = min(job.n, n)
        if first and lead == 0 and not job.target.overtaken:
            job.n = min(job.n, channel.first_chunk)
    return [job for _, job in reversed(chunks)] + opening[::-1]


def _pop_job(queue: list[Job], channel: DraftChannel, book: DraftBook) -> Job | None:
    """Under the lock: the round's next job still to do as planned (a job whose session was
    fixed, closed or moved since is dropped: the next round plans it again)."""
    while queue:
        job = queue.pop()
        t = job.target
        if t.busy or t.refused or t.closed or t.epoch != job.epoch:
            continue
        if job.opening:
            if t.opening is not None:
                return job
            continue
        if t.fixes or t.idle or t.held_from is not None or t.draft is None or \
                len(t.draft.tokens) != job.start or not channel.can_draft(job.sid, job.start):
            continue
        return job
    return None


def _pop_jobs(queue: list[Job], channel: DraftChannel, book: DraftBook, most: int
              ) -> list[Job]:
    """Under the lock: up to ``most`` of the round's next jobs (``_pop_job``), marked busy."""
    jobs: list[Job] = []
    while len(jobs) < most:
        job = _pop_job(queue, channel, book)
        if job is None:
            break
        job.target.busy = True
        jobs.append(job)
    return jobs


def _finish(job: Job, outcome, error: Exception | None, channel: DraftChannel,
            book: DraftBook) -> None:
    """Under the lock: hand on what the job made; a chunk a fix overtook waits in the draft
    session for the fix to judge it (``_apply_fixes``)."""
    t, sid = job.target, job.sid
    t.busy = False
    drafted = not job.opening and error is None and len(outcome) > 0
    if job.opening:
        t.opening = None
        t.draft = outcome
    elif drafted:
        book.counts.chunks_drafted += 1
        book.counts.tokens_drafted += len(outcome)
    if t.closed:
        if drafted:
            book.counts.dropped["closed"] += 1
        book.retire(sid, t)
        return
    if error is not None:
        what = "opening" if job.opening else "drafting"
        start = t.committed_end if job.opening or t.epoch != job.epoch else job.start
        if not job.opening:
            book.counts.dropped["failed"] += 1
        _refuse(sid, t, start, f"{what} failed: {type(error).__name__}: {error}", channel, book)
        return
    if job.opening:
        return
    if t.epoch != job.epoch:  # a fix came while drafting: held until it is applied
        if len(outcome) and t.held_from is None:
            t.held_from = job.start
        return
    t.idle = len(outcome) == 0
    _deliver(sid, t, job.start, outcome, channel, book, job.ran_s)


def _finish_or_refuse(job: Job, outcome, error: Exception | None, channel: DraftChannel,
                      book: DraftBook) -> None:
    """Under the lock: ``_finish``; if its bookkeeping raises, the job's session gets no more
    drafts, and the turn's other jobs are finished all the same (none is left busy)."""
    try:
        _finish(job, outcome, error, channel, book)
    except Exception as exc:
        log.exception("finishing a drafting job of session %s failed", job.sid)
        t = job.target
        t.busy = False
        # where the cache's draft ends: past the job's chunk if it was handed on before the fault
        start = t.committed_end if job.opening or t.epoch != job.epoch else \
            max(job.start, t.sent_end or 0)
        try:
            _refuse(job.sid, t, start, f"its drafting job's bookkeeping failed: {exc!r}",
                    channel, book)
        except Exception:
            log.exception("refusing session %s failed", job.sid)


def _refuse(sid: str, t: DraftTarget, start: int, why: str, channel: DraftChannel,
            book: DraftBook) -> None:
    log.warning("the drafter cannot draft for session %s (%s); the verifier decodes it alone",
                sid, why)
    t.refused, t.idle = True, True
    t.fixes.clear()
    t.held_from = None
    book.release_draft(sid, t)
    try:
        channel.refuse(sid, t, start, why)
    except Exception:
        log.exception("telling the verifier that session %s gets no drafts failed", sid)
