"""The one drafting loop (``edgespec.drafters.drafting_loop``) with a drafter that blocks in the
middle of a proposal: the lock is free meanwhile (a fix is recorded while the drafter works); a
chunk a fix overtook is judged by it: thrown away where the fix disagrees, kept and sent again at
the fix's end where it agrees (the step decoded the chunk's first token, or the verifier's bonus
token was the board's next one); a session closed while busy is closed once, by the loop's own
thread; a drafter that fails costs its session its drafts and nothing else; chunks are sized
(``ChunkPace``) to land within the verifier's step."""

from __future__ import annotations

import threading

import pytest

from edgespec.config import SamplingParams
from edgespec.drafters import Draft, Drafter, DraftSession
from edgespec.drafters.chunk_pace import ChunkPace
from edgespec.drafters.drafting_loop import DraftBook, apply_fix, run_drafting

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


def _running_loop(pace: bool):
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
    yield from _running_loop(pace=False)


@pytest.fixture()
def paced_loop():
    yield from _running_loop(pace=True)


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
    assert book.counts.dropped["disagreed"] == 1 and book.counts.tokens_discarded == 4
    assert book.counts.tokens_kept == 0


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


class Permits:
    """A gate that lets one proposal through per ``release``."""

    def __init__(self):
        self.sem = threading.Semaphore(0)

    def wait(self, timeout) -> bool:
        return self.sem.acquire(timeout=timeout)

    def release(self) -> None:
        self.sem.release()

    def set(self) -> None:  # the fixture's teardown: let everything through
        self.sem.release(1000)


@pytest.fixture()
def stepped(loop):
    """The loop, its drafter let through one proposal at a time (``entered`` counts entries)."""
    drafter = loop[0]
    drafter.gate, drafter.entered = Permits(), Permits()
    return loop


def _open(channel, book, wanted: int | None = None) -> None:
    """Session "s" at [1, 2, 3], epoch 0; ``wanted``: the verifier's ask, said in a commit."""
    with channel.cond:
        book.assign("s", [1, 2, 3], SamplingParams(), 0)
        if wanted is not None:
            book.commit("s", 0, 3, wanted=wanted)
        channel.cond.notify_all()


def _fix(channel, book, sid, epoch, position, tokens) -> None:
    with channel.cond:
        book.fix(sid, epoch, position, tokens)
        channel.cond.notify_all()


def test_a_fix_that_agrees_with_the_chunk_in_flight_keeps_the_rest_and_sends_it_again(stepped):
    drafter, channel, book, _ = stepped
    _open(channel, book)
    assert drafter.entered.wait(WAIT_S)  # drafting [4, 5, 6, 7] at 3
    _fix(channel, book, "s", 1, 3, (4,))  # a step decoded 4 without a draft
    drafter.gate.release()
    _eventually(lambda: channel.delivered, "the kept tokens sent again", channel)
    assert channel.delivered[0] == ("s", 1, 4, [5, 6, 7])  # at the fix's end, its epoch
    assert drafter.entered.wait(WAIT_S)  # then drafting on after 7: nothing rolled back
    assert drafter.sessions[0].tokens == [1, 2, 3, 4, 5, 6, 7]
    with channel.cond:
        assert (book.counts.tokens_kept, book.counts.chunks_resent) == (3, 1)
        assert not book.counts.dropped


def test_a_bonus_token_the_board_drafted_keeps_the_rest_of_its_draft(stepped):
    drafter, channel, book, _ = stepped
    _open(channel, book)
    drafter.gate.release()
    _eventually(lambda: channel.delivered, "the first chunk", channel)
    assert channel.delivered[0] == ("s", 0, 3, [4, 5, 6, 7])
    assert drafter.entered.wait(WAIT_S) and drafter.entered.wait(WAIT_S)  # drafting at 7
    _fix(channel, book, "s", 1, 7, (8,))  # all four accepted, and the verifier's bonus 8
    drafter.gate.release()
    _eventually(lambda: len(channel.delivered) == 2, "the rest after the bonus", channel)
    assert channel.delivered[1] == ("s", 1, 8, [9, 10, 11])


def test_a_disagreeing_fix_after_an_agreeing_one_drops_what_was_held(stepped):
    drafter, channel, book, _ = stepped
    _open(channel, book)
    assert drafter.entered.wait(WAIT_S)  # drafting [4, 5, 6, 7] at 3
    _fix(channel, book, "s", 1, 3, (4,))  # agrees: 5, 6, 7 kept ...
    _fix(channel, book, "s", 2, 4, (50,))  # ... until the next step's token is not 5
    drafter.gate.release()
    assert drafter.entered.wait(WAIT_S)  # drafting on from the fixes
    drafter.gate.release()
    _eventually(lambda: channel.delivered, "a chunk after both fixes", channel)
    assert channel.delivered[0] == ("s", 2, 5, [51, 52, 53, 54])
    assert drafter.sessions[0].tokens[:6] == [1, 2, 3, 4, 50, 51]
    with channel.cond:
        assert book.counts.tokens_discarded == 3 and book.counts.dropped["disagreed"] == 1


class ListSession(DraftSession):
    """A draft session that only records its rollbacks."""

    def __init__(self, tokens):
        super().__init__(tokens, SamplingParams())
        self.rollbacks: list[int] = []
        self.confirms: list[int] = []

    def confirm(self, length: int) -> None:
        self.confirms.append(length)

    def propose(self, k: int) -> Draft:
        return Draft()

    def rollback(self, length: int) -> None:
        self.rollbacks.append(length)
        super().rollback(length)


@pytest.mark.parametrize("position, tokens, kept, after, rollbacks", [
    (4, (5, 6), 1, [1, 2, 3, 4, 5, 6, 7], []),  # a branch + token the draft held
    (4, (5, 9), 0, [1, 2, 3, 4, 5, 9], [5]),  # rolled back from the first that differs
    (3, (9,), 0, [1, 2, 3, 9], [3]),
    (7, (8,), 0, [1, 2, 3, 4, 5, 6, 7, 8], [7]),  # at the end: nothing to keep
    (6, (7,), 0, [1, 2, 3, 4, 5, 6, 7], []),  # agrees up to the end: nothing beyond it
])
def test_apply_fix_rolls_back_only_from_the_first_token_that_differs(position, tokens, kept,
                                                                     after, rollbacks):
    s = ListSession([1, 2, 3, 4, 5, 6, 7])
    assert apply_fix(s, position, tokens) == kept
    assert (s.tokens, s.rollbacks) == (after, rollbacks)
    # a fix the session held is verified as it holds it: a drafter that learns, learns it
    assert s.confirms == ([] if rollbacks else [position + len(tokens)])


def test_mag_learns_the_tokens_an_agreeing_fix_confirms():
    from edgespec.drafters.mag import MaGDrafter

    drafter = MaGDrafter()
    s = drafter.open([1, 2, 3], SamplingParams())
    s.append([7, 8, 9])  # as if drafted
    assert drafter.bigrams.best(7)[0] is None
    apply_fix(s, 3, (7, 8))  # the verifier committed 7, 8: the session held them
    assert drafter.bigrams.best(7)[0] == 8 and s.tokens == [1, 2, 3, 7, 8, 9]


def test_apply_fix_beyond_the_draft_raises():
    with pytest.raises(ValueError):
        apply_fix(ListSession([1, 2, 3]), 5, (9,))


def test_a_paced_loop_drafts_chunks_that_fit_the_verifiers_step(paced_loop):
    drafter, channel, book, _ = paced_loop
    with channel.cond:
        for _ in range(8):  # 20 ms a token, a step every 30 ms: one token a chunk lands
            book.pace.drafted(0.04, 2)
            book.pace.drafted(0.08, 4)
        book.pace.step_seen(0.03)
        book.assign("s", [1, 2, 3], SamplingParams(), 0)
        channel.cond.notify_all()
    drafter.gate.set()
    _eventually(lambda: channel.delivered, "a chunk", channel)
    assert channel.delivered[0] == ("s", 0, 3, [4])


def _paced(cost, step_s, most=4, sessions=1, jobs=300) -> list[int]:
    pace = ChunkPace()
    pace.step_seen(step_s)
    sizes = []
    for _ in range(jobs):
        n = pace.chunk(most, sessions)
        sizes.append(n)
        pace.drafted(cost(n), n)
    return sizes


def test_chunk_pace_fits_a_per_token_drafter_into_the_step():
    # after a few jobs to learn the drafter, the same size for good
    assert set(_paced(lambda n: 0.03 * n, 0.1)[5:]) == {2}  # 0.07 s of the step: 2 tokens
    assert set(_paced(lambda n: 0.02 + 0.02 * n, 0.1)[5:]) == {2}  # fixed + per token
    assert set(_paced(lambda n: 0.01 * n, 0.1, sessions=2)[5:]) == {3}  # two share a step


def test_chunk_pace_keeps_full_chunks_when_none_would_land_or_all_do():
    assert set(_paced(lambda n: 1e-5 * n, 0.01)) == {4}  # a fast drafter (MaG)
    assert set(_paced(lambda n: 0.2 * n, 0.1)) == {4}  # slower per token than the verifier
    # fixed per chunk: size buys nothing; once two sizes showed it, full chunks for good
    assert set(_paced(lambda n: 0.1, 0.1)[5:]) == {4}
    assert set(_paced(lambda n: 0.1, 0.1, most=8)[5:]) == {8}
    assert ChunkPace().chunk(4, 1) == 4  # nothing seen yet


def _drafted_for_an_ask_of_1(loop):
    """Session "s" opened at [1, 2, 3] with the verifier's ask of 1: drafted 4 ahead (one chunk
    handed on, [4, 5, 6, 7]). Returns the loop's channel and book."""
    drafter, channel, book, _ = loop
    drafter.gate.set()
    _open(channel, book, wanted=1)
    _eventually(lambda: channel.delivered, "an ask of 1's lead", channel)
    with channel.cond:
        assert channel.delivered == [("s", 0, 3, [4, 5, 6, 7])]
    return channel, book


def test_a_board_drafts_ahead_about_twice_what_the_verifier_asks(loop):
    """A session the verifier asked 1 token of (none, in a batch that drafts: it is told 1) is
    drafted 4 ahead; asked 4, up to the window; told 0 (rested), none: no token drafted that
    no step would use."""
    from edgespec.drafters.drafting_loop import LEAD_SLACK, lead_cap

    assert [lead_cap(w, 8) for w in (None, 0, 1, 2, 3, 9)] == [8, 0, 4, 6, 8, 8]
    assert LEAD_SLACK == 2
    channel, book = _drafted_for_an_ask_of_1(loop)
    with channel.cond:
        book.commit("s", 0, 3, wanted=4)
        channel.cond.notify_all()
    _eventually(lambda: len(channel.delivered) == 3, "drafted up to the window", channel)
    assert channel.delivered[1:] == [("s", 0, 7, [8, 9]), ("s", 0, 9, [10, 11])]


def test_a_session_the_verifier_rests_is_drafted_again_when_it_asks(loop):
    """Told 0 (the batch drafts nothing and no probe is due), a session whose lead the commit
    used up gets no chunk planned; told 1 again (before a probe), it is drafted from
    its committed end."""
    from edgespec.drafters.drafting_loop import _plan_round

    channel, book = _drafted_for_an_ask_of_1(loop)
    with channel.cond:
        book.commit("s", 0, 7, wanted=0)  # the lead verified; the verifier rests the session
        assert [job for job in _plan_round(channel, book) if not job.opening] == []
        book.commit("s", 0, 7, wanted=1)
        channel.cond.notify_all()
    _eventually(lambda: len(channel.delivered) == 2, "the lead of the next ask", channel)
    assert channel.delivered[1] == ("s", 0, 7, [8, 9, 10, 11])


def test_a_commit_to_the_next_usable_draft_is_timed_stage_by_stage(stepped):
    """A commit the tokens sent reach past is drafted ahead (usable at once); a fix that
    disagrees waits for a chunk from its end: timed from the fix's arrival, queued until the
    chunk's job began and drafting while it ran. Tokens an agreeing fix kept are sent again
    undrafted: all their time is queued."""
    drafter, channel, book, _ = stepped
    _open(channel, book)
    drafter.gate.release()
    _eventually(lambda: channel.delivered, "the first chunk", channel)  # [4, 5, 6, 7] at 3
    assert drafter.entered.wait(WAIT_S) and drafter.entered.wait(WAIT_S)  # drafting at 7
    with channel.cond:
        book.commit("s", 0, 5)  # 4 and 5 verified, the cache still holds 6 and 7
        assert (book.counts.commits_seen, book.counts.commits_ahead) == (1, 1)
    _fix(channel, book, "s", 1, 7, (50,))  # the bonus was not the board's 8: drafted anew
    drafter.gate.release()
    assert drafter.entered.wait(WAIT_S)  # drafting at 8, after the fix
    drafter.gate.release()
    _eventually(lambda: len(channel.delivered) == 2, "the chunk after the fix", channel)
    assert channel.delivered[1] == ("s", 1, 8, [51, 52, 53, 54])
    with channel.cond:
        c = book.counts
        assert (c.commits_seen, c.commits_ahead, c.commits_served) == (2, 1, 1)
        assert c.drafting_s > 0 and c.served_s >= c.queued_s + c.drafting_s
        drafting = c.drafting_s
    assert drafter.entered.wait(WAIT_S)  # drafting at 12
    _fix(channel, book, "s", 2, 8, (51,))  # agrees: 52..54 kept, sent again from 9
    drafter.gate.release()
    _eventually(lambda: len(channel.delivered) == 3, "the kept tokens sent again", channel)
    assert channel.delivered[2][:3] == ("s", 2, 9)
    with channel.cond:
        c = book.counts
        assert (c.commits_seen, c.commits_served, c.drafting_s) == (3, 2, drafting)


def test_chunks_beyond_the_next_ask_are_short(loop):
    """Asked 3, a board drafts its first chunk in full (the next step needs it), then the rest
    of its lead (for the step after, should this one accept everything) AHEAD_CHUNK at a time:
    a fix arriving meanwhile waits for no more than that."""
    from edgespec.drafters.drafting_loop import AHEAD_CHUNK

    assert AHEAD_CHUNK == 2
    drafter, channel, book, _ = loop
    drafter.gate.set()
    _open(channel, book, wanted=3)
    _eventually(lambda: len(channel.delivered) == 3, "a lead of 8", channel)
    assert [(start, tokens) for _, _, start, tokens in channel.delivered] == [
        (3, [4, 5, 6, 7]), (7, [8, 9]), (9, [10, 11])]


def test_a_boards_first_chunk_at_the_committed_end_is_one_token(loop):
    """A board's chunk that starts at the committed end (a session's opening, or after a fix)
    holds one token, so the next step's first token reaches the cache a token's drafting
    sooner; the chunks after it are the usual ones."""
    drafter, channel, book, _ = loop
    channel.first_chunk = 1
    drafter.gate.set()
    _open(channel, book, wanted=3)
    _eventually(lambda: len(channel.delivered) == 4, "a lead of 8", channel)
    assert [(start, tokens) for _, _, start, tokens in channel.delivered] == [
        (3, [4]), (4, [5, 6, 7, 8]), (8, [9, 10]), (10, [11])]


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
        _eventually(cond, what, channel)
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
