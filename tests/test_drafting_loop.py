"""The one drafting loop (``edgespec.drafters.drafting_loop``) with a drafter that blocks in the
middle of a proposal: the lock is free meanwhile (a fix is recorded while the drafter works); a
chunk a fix overtook is judged by it: thrown away where the fix disagrees, kept and sent again at
the fix's end where it agrees (the step decoded the chunk's first token, or the verifier's bonus
token was the board's next one); a session closed while busy is closed once, by the loop's own
thread; a drafter that fails costs its session its drafts and nothing else; chunks are sized
(``ChunkPace``) to land within the verifier's step. Its turns (several jobs a turn, sessions
drafted together): ``test_drafting_turns``."""

from __future__ import annotations

import threading

import pytest

from edgespec.config import SamplingParams
from edgespec.drafters import Draft, DraftSession
from edgespec.drafters.chunk_pace import ChunkPace
from edgespec.drafters.drafting_loop import apply_fix

# the loop on its thread: its fixtures (used by name) and helpers
from drafting_harness import (  # noqa: F401
    WAIT_S, GatedDrafter, RecordingChannel, eventually, loop, paced_loop)


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
    eventually(lambda: channel.delivered, "a chunk after the fix", channel)
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
    eventually(lambda: drafter.closed_by, "the draft session closed", channel)
    assert drafter.closed_by == [thread.ident] and channel.delivered == []


def test_a_failing_drafter_costs_its_session_its_drafts_only(loop):
    drafter, channel, book, _ = loop
    drafter.fail = True
    drafter.gate.set()
    with channel.cond:
        book.assign("bad", [1, 2, 3], SamplingParams(), 0)
        channel.cond.notify_all()
    eventually(lambda: channel.refused, "the session refused", channel)
    assert channel.refused == [("bad", 3)]
    drafter.fail = False
    with channel.cond:
        book.assign("good", [5, 6], SamplingParams(), 0)
        channel.cond.notify_all()
    eventually(lambda: channel.delivered, "drafts for the next session", channel)
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
    eventually(lambda: channel.delivered, "the kept tokens sent again", channel)
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
    eventually(lambda: channel.delivered, "the first chunk", channel)
    assert channel.delivered[0] == ("s", 0, 3, [4, 5, 6, 7])
    assert drafter.entered.wait(WAIT_S) and drafter.entered.wait(WAIT_S)  # drafting at 7
    _fix(channel, book, "s", 1, 7, (8,))  # all four accepted, and the verifier's bonus 8
    drafter.gate.release()
    eventually(lambda: len(channel.delivered) == 2, "the rest after the bonus", channel)
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
    eventually(lambda: channel.delivered, "a chunk after both fixes", channel)
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
    eventually(lambda: channel.delivered, "a chunk", channel)
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
    eventually(lambda: channel.delivered, "an ask of 1's lead", channel)
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
    eventually(lambda: len(channel.delivered) == 3, "drafted up to the window", channel)
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
    eventually(lambda: len(channel.delivered) == 2, "the lead of the next ask", channel)
    assert channel.delivered[1] == ("s", 0, 7, [8, 9, 10, 11])


def test_a_commit_to_the_next_usable_draft_is_timed_stage_by_stage(stepped):
    """A commit the tokens sent reach past is drafted ahead (usable at once); a fix that
    disagrees waits for a chunk from its end: timed from the fix's arrival, queued until the
    chunk's job began and drafting while it ran. Tokens an agreeing fix kept are sent again
    undrafted: all their time is queued."""
    drafter, channel, book, _ = stepped
    _open(channel, book)
    drafter.gate.release()
    eventually(lambda: channel.delivered, "the first chunk", channel)  # [4, 5, 6, 7] at 3
    assert drafter.entered.wait(WAIT_S) and drafter.entered.wait(WAIT_S)  # drafting at 7
    with channel.cond:
        book.commit("s", 0, 5)  # 4 and 5 verified, the cache still holds 6 and 7
        assert (book.counts.commits_seen, book.counts.commits_ahead) == (1, 1)
    _fix(channel, book, "s", 1, 7, (50,))  # the bonus was not the board's 8: drafted anew
    drafter.gate.release()
    assert drafter.entered.wait(WAIT_S)  # drafting at 8, after the fix
    drafter.gate.release()
    eventually(lambda: len(channel.delivered) == 2, "the chunk after the fix", channel)
    assert channel.delivered[1] == ("s", 1, 8, [51, 52, 53, 54])
    with channel.cond:
        c = book.counts
        assert (c.commits_seen, c.commits_ahead, c.commits_served) == (2, 1, 1)
        assert c.drafting_s > 0 and c.served_s >= c.queued_s + c.drafting_s
        drafting = c.drafting_s
    assert drafter.entered.wait(WAIT_S)  # drafting at 12
    _fix(channel, book, "s", 2, 8, (51,))  # agrees: 52..54 kept, sent again from 9
    drafter.gate.release()
    eventually(lambda: len(channel.delivered) == 3, "the kept tokens sent again", channel)
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
    eventually(lambda: len(channel.delivered) == 3, "a lead of 8", channel)
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
    eventually(lambda: len(channel.delivered) == 4, "a lead of 8", channel)
    assert [(start, tokens) for _, _, start, tokens in channel.delivered] == [
        (3, [4]), (4, [5, 6, 7, 8]), (8, [9, 10]), (10, [11])]


def test_a_board_drafts_nothing_past_the_last_token_a_step_can_verify(loop):
    """A session whose output ends at 7 (prompt + max_new_tokens, said at its assignment):
    a step verifies drafts up to position 5 at most, its own token the last, so asked 4 (a
    lead of up to the window, 8) the board drafts 3 tokens; after a commit to 5, with a token
    of its lead left, no chunk is planned. Without the end said, the lead is ``lead_cap``'s."""
    from edgespec.drafters.drafting_loop import DraftTarget, _plan_round, lead_cap, lead_room

    drafter, channel, book, _ = loop
    drafter.gate.set()
    with channel.cond:
        book.assign("s", [1, 2, 3], SamplingParams(), 0, output_end=7)
        book.commit("s", 0, 3, wanted=4)
        channel.cond.notify_all()
    eventually(lambda: channel.delivered, "the lead up to the output's end", channel)
    with channel.cond:
        assert channel.delivered == [("s", 0, 3, [4, 5, 6])]
        assert [job for job in _plan_round(channel, book) if not job.opening] == []
        book.commit("s", 0, 5, wanted=4)
        assert [job for job in _plan_round(channel, book) if not job.opening] == []
    unsaid = DraftTarget(SamplingParams(), 0, 3)
    assert lead_room(unsaid, 8) == lead_cap(None, 8) == 8
    unsaid.wanted = 1
    assert lead_room(unsaid, 8) == lead_cap(1, 8) == 4


def test_the_step_a_board_sees_is_not_measured_across_a_rest():
    """The step interval sizing a board's chunks is read off its commits, but not across a rest:
    a rested board hears of no commit until a step asks again (the cache holds them back), and
    that gap is no step."""
    from edgespec.drafters.draft_book import DraftBook

    book = DraftBook()
    book.assign("s", [1, 2, 3], SamplingParams(), 0)
    book.commit("s", 0, 4, wanted=1)
    book.targets["s"].last_commit_s -= 0.05  # the next commit comes a 50 ms step later
    book.commit("s", 0, 5, wanted=0)  # the step's interval, then rested
    step_s = book.pace.step_s
    assert step_s is not None and step_s >= 0.05
    book.targets["s"].last_commit_s -= 30.0  # asked again half a minute later
    book.commit("s", 0, 9, wanted=2)
    assert book.pace.step_s == step_s
    book.commit("s", 0, 10, wanted=2)
    assert book.pace.step_s != step_s  # measured again once drafting
