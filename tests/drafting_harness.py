"""The drafting loop (``edgespec.drafters.drafting_loop``) on a thread of its own over a
transport that records what it is handed (``RecordingChannel``), with a drafter that blocks in
the middle of a proposal until a test lets it go (``GatedDrafter``): what ``test_drafting_loop``
and ``test_drafting_turns`` run the loop with. Its fixtures are imported into those modules."""

from __future__ import annotations

import threading

import pytest

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
        self.ahead_chunk = 2
        self.first_chunk = 4  # the whole chunk (a test sets a board's 1)
        self.jobs_at_once = 1
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


def running_loop(pace: bool):
    drafter, channel, book = GatedDrafter(), RecordingChannel(), DraftBook(pace=pace)
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


@pytest.fixture()
def loop():
    """The loop with chunks of the channel's size (no pacing: what is drafted does not depend
    on how long the test's steps take)."""
    yield from running_loop(pace=False)


@pytest.fixture()
def paced_loop():
    yield from running_loop(pace=True)


def eventually(cond, what: str, channel) -> None:
    with channel.cond:
        assert channel.cond.wait_for(cond, WAIT_S), what
