"""The one drafting loop (``edgespec.drafters.drafting_loop``) with a drafter that blocks in the
middle of a proposal: the lock is free meanwhile (a fix is recorded while the drafter works), the
chunk drafted before the fix is dropped as stale and the fix applied before the next chunk, a
session closed while busy is closed once, by the loop's own thread, and a drafter that fails costs
its session its drafts and nothing else."""

from __future__ import annotations

import threading

import pytest

from edgespec.config import SamplingParams
from edgespec.drafters import Draft, Drafter, DraftSession
from edgespec.drafters.drafting_loop import DraftBook, run_drafting

WAIT_S = 60


class GatedSession(DraftSession):
    """Proposes 4 tokens counting up from its last one, each proposal waiting for ``gate``."""

    def __init__(self, drafter: "GatedDrafter", tokens, params):
        super().__init__(tokens, params)
        self.drafter = drafter

    def propose(self, k: int) -> Draft:
        self.drafter.entered.set()
        assert self.drafter.gate.wait(WAIT_S)
        if self.drafter.fail:
            raise RuntimeError("the drafter broke")
        out = [self.tokens[-1] + 1 + i for i in range(k)]
        self.tokens.extend(out)
        return Draft(out)

    def close(self) -> None:
        self.drafter.closed_by.append(threading.get_ident())


class GatedDrafter(Drafter):
    name = "gated"

    def __init__(self):
        self.gate, self.entered = threading.Event(), threading.Event()
        self.fail = False
        self.closed_by: list[int] = []
        self.sessions: list[GatedSession] = []

    def open(self, tokens, params) -> GatedSession:
        s = GatedSession(self, tokens, params)
        self.sessions.append(s)
        return s


class RecordingChannel:
    """A transport that records what the loop hands it."""

    def __init__(self):
        self.cond = threading.Condition()
        self.window, self.chunk, self.tree_width = 8, 4, 1
        self.delivered: list[tuple[str, int, int, list[int]]] = []
        self.refused: list[tuple[str, int]] = []

    def refresh(self, book) -> None:
        pass

    def can_draft(self, sid, start) -> bool:
        return True

    def deliver(self, sid, target, start, draft) -> None:
        self.delivered.append((sid, target.epoch, start, list(draft.tokens)))

    def refuse(self, sid, target, start, why) -> None:
        self.refused.append((sid, start))


@pytest.fixture()
def loop():
    drafter, channel, book = GatedDrafter(), RecordingChannel(), DraftBook()
    stop = threading.Event()
    thread = threading.Thread(target=run_drafting,
                              args=(drafter, channel, book, lambda: not stop.is_set()))
    thread.start()
    yield drafter, channel, book, thread
    stop.set()
    drafter.gate.set()
    with channel.cond:
        channel.cond.notify_all()
    thread.join(WAIT_S)
    assert not thread.is_alive()


def _eventually(cond, what: str, channel) -> None:
    with channel.cond:
        assert channel.cond.wait_for(cond, WAIT_S), what


def test_a_fix_arrives_while_the_drafter_works_and_its_stale_chunk_is_dropped(loop):
    drafter, channel, book, _ = loop
    with channel.cond:
        book.assign("s", [1, 2, 3], SamplingParams(), 0)
        channel.cond.notify_all()
    assert drafter.entered.wait(WAIT_S)  # the loop is inside propose, outside the lock
    assert channel.cond.acquire(timeout=WAIT_S)  # the receiver is not kept waiting
    try:
        book.fix("s", 1, 3, (9,))  # the verifier rejected everything: roll back to 3, then 9
    finally:
        channel.cond.release()
    drafter.gate.set()
    _eventually(lambda: channel.delivered, "a chunk after the fix", channel)
    assert channel.delivered[0] == ("s", 1, 4, [10, 11, 12, 13])  # none at epoch 0
    assert drafter.sessions[0].tokens[:5] == [1, 2, 3, 9, 10]


def test_a_session_closed_while_busy_is_closed_once_by_the_loop(loop):
    drafter, channel, book, thread = loop
    with channel.cond:
        book.assign("s", [1, 2, 3], SamplingParams(), 0)
        channel.cond.notify_all()
    assert drafter.entered.wait(WAIT_S)
    with channel.cond:
        book.close("s")
        assert drafter.closed_by == []  # busy: the loop closes it when its job returns
    drafter.gate.set()
    _eventually(lambda: drafter.closed_by, "the draft session closed", channel)
    assert drafter.closed_by == [thread.ident] and channel.delivered == []


def test_a_failing_drafter_costs_its_session_its_drafts_only(loop):
    drafter, channel, book, _ = loop
    drafter.fail = True
    drafter.gate.set()
    with channel.cond:
        book.assign("bad", [1, 2, 3], SamplingParams(), 0)
        channel.cond.notify_all()
    _eventually(lambda: channel.refused, "the session refused", channel)
    assert channel.refused == [("bad", 3)]
    drafter.fail = False
    with channel.cond:
        book.assign("good", [5, 6], SamplingParams(), 0)
        channel.cond.notify_all()
    _eventually(lambda: channel.delivered, "drafts for the next session", channel)
    assert channel.delivered[0] == ("good", 0, 2, [7, 8, 9, 10])
    assert book.targets["bad"].refused and len(drafter.closed_by) == 1
