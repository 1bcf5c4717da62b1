"""The in-process store's two wake-ups and the drafting loop's rounds: the drafter reads only the
sessions that changed (created, committed, closed), the verifier waiting for drafts is woken by
the chunk (or the drafter's giving up, or the close) that completes what it waits for; the loop
plans a round of chunks, furthest behind first, and drops a planned job whose session a fix
moved; MaG's suffix match is the longest, then the most recent."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from edgespec.config import SamplingParams
from edgespec.drafters import Draft, Drafter, DraftSession
from edgespec.drafters.drafting_loop import DraftBook, _plan_round, _pop_job
from edgespec.drafters import mag, suffix_match
from edgespec.protocol.contract import DraftWant, Verdict
from edgespec.protocol.local_store import LocalSessionStore

WAIT_S = 600  # a take's wait: only a missing wake-up would run it out
JOIN_S = 60  # the woken take returns long before


def _store(*sids: str) -> LocalSessionStore:
    store = LocalSessionStore()
    for sid in sids:
        store.create(sid, [1, 2, 3], SamplingParams(), "mag")
    return store


def test_the_drafter_reads_only_what_changed_since_it_last_read():
    store = _store("a")
    with store.lock:
        assert store.read_changes() == set()  # the first read starts the record
    store.create("b", [1, 2], SamplingParams(), "mag")
    store.push_draft("a", 0, 3, [4, 5])  # a chunk is the drafter's own news: not recorded
    with store.lock:
        assert store.read_changes() == {"b"}
        assert store.read_changes() == set()
    store.commit_many([Verdict("a", 0, 3, 1, 9)])
    store.close("b")
    with store.lock:
        assert store.read_changes() == {"a", "b"}


def _waiting_take(store: LocalSessionStore, wants: list[DraftWant]):
    got: list = []
    t = threading.Thread(target=lambda: got.extend(store.take_when_ready(wants, WAIT_S)),
                         daemon=True)
    t.start()
    return t, got


def _awaited(store: LocalSessionStore, sids: set[str]) -> None:
    """Until the verifier waits for exactly ``sids``."""
    for _ in range(JOIN_S * 100):
        with store.lock:
            if set(store._awaited) == sids:
                return
        threading.Event().wait(0.01)
    raise AssertionError(f"the verifier never waited for {sids}")


def test_the_verifier_is_woken_by_the_chunk_that_completes_what_it_waits_for():
    store = _store("a", "b")
    t, got = _waiting_take(store, [DraftWant("a", 2), DraftWant("b", 2)])
    _awaited(store, {"a", "b"})
    store.push_draft("a", 0, 3, [4, 5])
    _awaited(store, {"b"})  # a is ready: only b is waited for now
    store.push_draft("b", 0, 3, [6])  # one of two tokens: still waited for
    _awaited(store, {"b"})
    store.push_draft("b", 0, 4, [7])
    t.join(JOIN_S)
    assert not t.is_alive()
    assert [g.tokens for g in got] == [[4, 5], [6, 7]] and all(g.ready for g in got)


@pytest.mark.parametrize("how", ["drafter_gone", "close"])
def test_a_session_that_gets_no_draft_stops_the_wait(how):
    store = _store("a")
    t, got = _waiting_take(store, [DraftWant("a", 4)])
    _awaited(store, {"a"})
    getattr(store, how)("a")
    t.join(JOIN_S)
    assert not t.is_alive()
    assert len(got) == 1


class CountingSession(DraftSession):
    def propose(self, k: int) -> Draft:
        out = [self.tokens[-1] + 1 + i for i in range(k)]
        self.tokens.extend(out)
        return Draft(out)


class CountingDrafter(Drafter):
    name = "counting"

    def open(self, tokens, params) -> CountingSession:
        return CountingSession(tokens, params)


class OpenChannel:
    def __init__(self):
        self.cond = threading.Condition()
        self.window, self.chunk, self.tree_width = 8, 4, 1
        self.ahead_chunk = 2
        self.first_chunk = 4
        self.jobs_at_once = 1

    def can_draft(self, sid, start) -> bool:
        return True

    def deliver(self, sid, target, start, draft) -> None:
        pass

    def refuse(self, sid, target, start, why) -> None:
        pass


def _book(leads: dict[str, int]) -> DraftBook:
    """Open sessions at committed end 3, each ``lead`` tokens drafted ahead."""
    book, drafter = DraftBook(pace=False), CountingDrafter()
    for sid, lead in leads.items():
        book.assign(sid, [1, 2, 3], SamplingParams(), 0)
        t = book.targets[sid]
        t.opening, t.draft = None, drafter.open([1, 2, 3], SamplingParams())
        t.draft.propose(lead)
    return book


def test_a_round_drafts_the_sessions_furthest_behind_first_within_their_window():
    book, channel = _book({"a": 5, "b": 0, "c": 8, "d": 2}), OpenChannel()
    queue = _plan_round(channel, book)
    jobs = []
    while (job := _pop_job(queue, channel, book)) is not None:
        jobs.append((job.sid, job.start, job.n))
    # c has no room (8 ahead in a window of 8); each chunk at most 4 and within the window
    assert jobs == [("b", 3, 4), ("d", 5, 4), ("a", 8, 3)]


def test_a_chunk_from_the_committed_end_is_short_unless_drafted_beside_longer_ones():
    """A session with nothing drafted past its committed end (after a fix, or at the opening)
    gets a chunk of ``first_chunk`` tokens; a drafter that drafts a round's sessions together
    (a turn's chunks are handed on together) cuts it only when every chunk of the round starts
    there, as it would come no sooner, only shorter."""
    channel = OpenChannel()
    channel.first_chunk = 1

    def chunks(leads: dict[str, int], together: int) -> list[tuple[str, int]]:
        queue = _plan_round(channel, _book(leads), together)
        return sorted((j.sid, j.n) for j in queue)

    assert chunks({"a": 0, "b": 2}, together=1) == [("a", 1), ("b", 4)]
    assert chunks({"a": 0, "b": 2}, together=2) == [("a", 4), ("b", 4)]
    assert chunks({"a": 0, "b": 0}, together=2) == [("a", 1), ("b", 1)]
    book = _book({"a": 0})  # a fix agreed with what it held: the board is behind the steps,
    book.fix("a", 0, 3, (4,))  # and gets whole chunks, whose rest a step cannot overtake
    book.targets["a"].draft.tokens.append(4)
    assert [(j.sid, j.n) for j in _plan_round(channel, book)] == [("a", 4)]
    book = _book({"a": 0})
    book.fix("a", 0, 3, (4,))  # a fix that rolled nothing back but held nothing either
    assert [(j.sid, j.n) for j in _plan_round(channel, book)] == [("a", 1)]


def test_a_planned_job_whose_session_was_fixed_is_left_to_the_next_round():
    book, channel = _book({"a": 0, "b": 0}), OpenChannel()
    queue = _plan_round(channel, book)
    book.fix("a", 1, 3, (9,))
    assert book.news
    assert [j.sid for j in [_pop_job(queue, channel, book)]] == ["b"]
    assert _pop_job(queue, channel, book) is None
    again = _plan_round(channel, book)  # the fix applied: a drafts from its end
    job = _pop_job(again, channel, book)
    assert (job.sid, job.epoch, job.start) == ("a", 1, 4)


def _longest_suffix_match_by_definition(arr, max_ngram, min_ngram):
    length = len(arr)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        for p in range(length - 1 - n, -1, -1):  # most recent first, a token after it
            if list(arr[p:p + n]) == list(arr[length - n:]):
                return n, p
    return 0, -1


@pytest.mark.parametrize("one_by_one", [0, 4, 1000], ids=["together", "mixed", "one-by-one"])
def test_mag_suffix_match_is_the_longest_then_the_most_recent_occurrence(one_by_one,
                                                                         monkeypatch):
    """Both ways of matching (candidates one by one, and narrowed together) give the
    definition's answer, whichever the number of candidates."""
    monkeypatch.setattr(suffix_match, "SCAN_CANDIDATES", one_by_one)
    rng = np.random.default_rng(7)
    for _ in range(3000):
        arr = rng.integers(0, int(rng.integers(1, 5)), int(rng.integers(1, 60)))
        top = int(rng.integers(1, 10))
        low = int(rng.integers(1, top + 1))
        assert mag.longest_suffix_match(arr, top, low) == \
            _longest_suffix_match_by_definition(arr, top, low), (arr, top, low)
