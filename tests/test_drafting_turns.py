"""The drafting loop's turns: a channel asking several jobs a turn gets them drafted, then handed
on together; in process, a cheap drafter gets several jobs a turn and chunks of its room; a
drafter that drafts sessions together (llama.cpp's sequences) gets a round's chunks in one call,
and where that call fails, each session is drafted alone (the failing one alone losing its
drafts) and the call is not tried again every turn; a job whose bookkeeping fails costs its
session its drafts and no other."""

from __future__ import annotations

import threading

import pytest

from edgespec.config import SamplingParams
from edgespec.drafters import Draft, Drafter, DraftSession
from edgespec.drafters.drafting_loop import DraftBook, run_drafting

# the loop on its thread: its fixtures (used by name) and helpers
from drafting_harness import (  # noqa: F401
    WAIT_S, GatedDrafter, RecordingChannel, eventually, loop)


class CountingSession(DraftSession):
    """Proposes k tokens counting up from its last one, noting each proposal in ``events``."""

    broken = False  # its proposals raise

    def __init__(self, name: str, tokens, params, events: list):
        super().__init__(tokens, params)
        self.name, self.events = name, events

    def propose(self, k: int) -> Draft:
        if self.broken:
            raise RuntimeError(f"session {self.name} cannot be drafted")
        self.events.append(("propose", self.name))
        out = [self.tokens[-1] + 1 + i for i in range(k)]
        self.tokens.extend(out)
        return Draft(out)


class CountingDrafter(Drafter):
    name = "counting"
    cheap = True

    def __init__(self):
        self.events: list[tuple[str, str]] = []

    def open(self, tokens, params) -> CountingSession:
        return CountingSession(f"s{tokens[0]}", tokens, params, self.events)


@pytest.mark.parametrize("at_once", [1, 3])
def test_a_channel_asking_several_jobs_a_turn_gets_them_drafted_then_handed_on_together(
        at_once):
    drafter, channel, book = CountingDrafter(), RecordingChannel(), DraftBook(pace=False)
    channel.jobs_at_once = at_once
    real_deliver = channel.deliver

    def deliver(sid, target, start, draft):
        drafter.events.append(("deliver", sid))
        real_deliver(sid, target, start, draft)

    channel.deliver = deliver
    for first in (1, 2, 3):
        book.assign(f"s{first}", [first, 10], SamplingParams(), 0)
    # a window of 8 in chunks of 4: two rounds of a chunk a session
    _run_until(drafter, channel, book, lambda: len(channel.delivered) == 6,
               "every session's window")
    kinds = [kind for kind, _ in drafter.events]
    if at_once == 1:
        assert kinds == ["propose", "deliver"] * 6
    else:  # a turn's three chunks drafted, then handed on, furthest behind first
        assert kinds == ["propose"] * 3 + ["deliver"] * 3 + ["propose"] * 3 + ["deliver"] * 3
    assert sorted(d[:3] for d in channel.delivered) == sorted(
        (f"s{f}", 0, start) for f in (1, 2, 3) for start in (2, 6))


def test_in_process_a_cheap_drafter_gets_several_jobs_a_turn_and_chunks_of_its_room():
    from edgespec.config import EngineConfig
    from edgespec.engine.draft_worker import JOBS_AT_ONCE, LocalChannel
    from edgespec.protocol.local_store import LocalSessionStore

    cfg = EngineConfig(window=12, chunk=3)
    cheap = LocalChannel(LocalSessionStore(), cfg, cheap=True)
    model = LocalChannel(LocalSessionStore(), cfg, cheap=False)
    assert (cheap.jobs_at_once, cheap.chunk, cheap.ahead_chunk) == (JOBS_AT_ONCE, 12, 12)
    assert (model.jobs_at_once, model.chunk, model.ahead_chunk) == (1, 3, 3)
    assert JOBS_AT_ONCE > 1
    from edgespec.drafters import build_drafter
    assert build_drafter("mag").cheap and build_drafter("mag+cacheback").cheap
    assert not GatedDrafter().cheap  # a drafter says so itself; the default is a forward a job


class BatchingDrafter(CountingDrafter):
    """Drafts its sessions' chunks together (``batch_jobs``), noting each call's sessions;
    ``broken``: the sessions whose drafting raises, alone or in a call with others (such a
    call first appends a token to every session, as a forward failing midway through a
    proposal leaves them)."""

    cheap = False
    batch_jobs = 3

    def __init__(self, broken=(), calls_fail: bool = False):
        """``calls_fail``: every call of several sessions raises (each session alone drafts)."""
        super().__init__()
        self.broken, self.calls_fail = set(broken), calls_fail
        self.calls: list[list[str]] = []

    def open(self, tokens, params) -> CountingSession:
        session = super().open(tokens, params)
        session.broken = session.name in self.broken
        return session

    def propose_many(self, jobs, width):
        self.calls.append(sorted(s.name for s, _ in jobs))
        if self.calls_fail or any(s.broken for s, _ in jobs):
            for s, _ in jobs:
                s.tokens.append(999)
            raise RuntimeError("the batch broke")
        return super().propose_many(jobs, width)


def _run_until(drafter, channel, book, cond, what):
    stop = threading.Event()
    thread = threading.Thread(target=run_drafting,
                              args=(drafter, channel, book, lambda: not stop.is_set()))
    thread.start()
    try:
        eventually(cond, what, channel)
    finally:
        stop.set()
        with channel.cond:
            channel.cond.notify_all()
        thread.join(WAIT_S)
    assert not thread.is_alive()


@pytest.mark.parametrize("broken", [(), ("s2",), ("s1", "s2", "s3")])
def test_a_drafter_that_drafts_sessions_together_gets_a_rounds_chunks_in_one_call(broken):
    """A round's chunks go to the drafter in one call. A call that fails has each of its
    sessions drafted alone, from where it stood before the call (what the call appended taken
    back): only a session that fails alone loses its drafts, and the loop nothing."""
    drafter, channel, book = BatchingDrafter(broken), RecordingChannel(), DraftBook(pace=False)
    channel.jobs_at_once = drafter.batch_jobs
    for first in (1, 2, 3):
        book.assign(f"s{first}", [first, 10], SamplingParams(), 0)
    working = [f for f in (1, 2, 3) if f"s{f}" not in broken]
    _run_until(drafter, channel, book,
               lambda: len(channel.refused) == len(broken) and
               len(channel.delivered) == 2 * len(working), "refusals and windows")
    assert sorted(channel.refused) == [(sid, 2) for sid in sorted(broken)]
    expected = [f"s{f}" for f in working]
    if not broken:
        assert drafter.calls == [expected] * 2  # a window of 8 in two chunks of 4
    elif working:  # the failed call's chunks drafted alone, the next round's together
        assert drafter.calls == [["s1", "s2", "s3"], expected]
    else:
        assert drafter.calls == [["s1", "s2", "s3"]]
    assert sorted(d[:3] + (tuple(d[3]),) for d in channel.delivered) == sorted(
        (f"s{f}", 0, start, tuple(range(11 + start - 2, 11 + start + 2)))
        for f in working for start in (2, 6))


def test_a_call_that_fails_where_each_session_alone_drafts_is_not_tried_every_turn():
    """Calls of several sessions that always fail while each session alone drafts: after the
    first, the loop drafts one by one (for ``ALONE_TURNS`` turns), every window delivered and
    no session refused."""
    from edgespec.drafters.drafting_turn import ALONE_TURNS

    drafter = BatchingDrafter(calls_fail=True)
    channel, book = RecordingChannel(), DraftBook(pace=False)
    channel.jobs_at_once = drafter.batch_jobs
    for first in (1, 2, 3):
        book.assign(f"s{first}", [first, 10], SamplingParams(), 0)
    _run_until(drafter, channel, book, lambda: len(channel.delivered) == 6,
               "every session's window")
    assert ALONE_TURNS > 1 and drafter.calls == [["s1", "s2", "s3"]] and not channel.refused
    assert sorted(d[:3] + (tuple(d[3]),) for d in channel.delivered) == sorted(
        (f"s{f}", 0, start, tuple(range(11 + start - 2, 11 + start + 2)))
        for f in (1, 2, 3) for start in (2, 6))


@pytest.mark.parametrize("handed_on", [False, True])
def test_a_job_whose_bookkeeping_fails_costs_its_session_its_drafts_and_no_other(monkeypatch,
                                                                                handed_on):
    """``_finish`` raising for one job of a turn, before or after its chunk was handed on: that
    session is refused where the cache's draft ends (not left busy for good), the turn's other
    jobs are finished, and the loop goes on drafting for them."""
    from edgespec.drafters import drafting_loop

    real = drafting_loop._finish

    def finish(job, outcome, error, channel, book):
        if job.sid == "s2" and not job.opening:
            if handed_on:
                real(job, outcome, error, channel, book)
            raise RuntimeError("bookkeeping broke")
        real(job, outcome, error, channel, book)

    monkeypatch.setattr(drafting_loop, "_finish", finish)
    drafter, channel, book = CountingDrafter(), RecordingChannel(), DraftBook(pace=False)
    channel.jobs_at_once = 3
    for first in (1, 2, 3):
        book.assign(f"s{first}", [first, 10], SamplingParams(), 0)
    _run_until(drafter, channel, book,
               lambda: len(channel.refused) == 1 and len(channel.delivered) == 4 + handed_on,
               "a refusal and two windows")
    assert channel.refused == [("s2", 6 if handed_on else 2)]  # its chunk [2, 6) went out
    assert sorted(d[:3] for d in channel.delivered) == sorted(
        [(f"s{f}", 0, start) for f in (1, 3) for start in (2, 6)] +
        ([("s2", 0, 2)] if handed_on else []))
    with channel.cond:
        assert not any(t.busy for t in book.targets.values())


def test_in_process_the_drafting_thread_is_told_where_a_sessions_output_ends():
    """The in-process drafting thread's book gets each session's output end from the store
    (prompt + max_new_tokens), as a board gets it from the cache's assignment; none where the
    length was not said."""
    from edgespec.config import EngineConfig, SamplingParams
    from edgespec.drafters.draft_book import DraftBook
    from edgespec.engine.draft_worker import LocalChannel
    from edgespec.protocol.local_store import LocalSessionStore

    store = LocalSessionStore()
    channel, book = LocalChannel(store, EngineConfig()), DraftBook(pace=False)
    store.create("said", [1, 2, 3], SamplingParams(), drafter="mag", max_new_tokens=5)
    store.create("unsaid", [1, 2, 3], SamplingParams(), drafter="mag")
    with store.lock:
        channel.refresh(book)
    assert {sid: t.output_end for sid, t in book.targets.items()} == {"said": 8, "unsaid": None}
