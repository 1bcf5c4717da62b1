"""The session protocol's rules (``edgespec.protocol.contract``) held against both stores: the
in-process ``LocalSessionStore`` and the ``RedisSessionStore`` (Lua in a real Redis, embedded and
external). Every case runs on each; a store is driven through its verifier side (the
``SessionStore`` calls) and its drafter side (a chunk push), the two sides the protocol has
(``tests/store_sides``). Chunks and verdicts here; branches: ``test_store_contract_branches``."""

from __future__ import annotations

import pytest
from store_sides import PROMPT, LocalSide, Refused, commit, new, side, take  # noqa: F401

from edgespec.config import SamplingParams
from edgespec.protocol.contract import (Branch, DraftWant, Fix,
                               SessionVanished, Verdict)
from edgespec.protocol.local_store import LocalSessionStore


# -- chunks ---------------------------------------------------------------------------------------
def test_a_pushed_chunk_is_taken_at_the_committed_end(side):
    new(side)
    assert side.push("s", 0, 3, [4, 5, 6]) == 3
    t = take(side, k=2)
    assert (t.epoch, t.start, t.tokens, t.branches) == (0, 3, [4, 5], [])
    assert take(side).tokens == [4, 5, 6]  # taking does not consume


def test_the_window_bounds_the_draft(side):
    new(side)
    assert side.push("s", 0, 3, [4, 5, 6], window=2) == 2
    assert side.push("s", 0, 5, [6], window=2) == 0
    assert take(side).tokens == [4, 5]


def test_a_step_takes_many_sessions_at_once_each_up_to_its_own_length(side):
    for sid in ("a", "b", "c"):
        new(side, sid)
    side.push("a", 0, 3, [4, 5, 6])
    side.push("b", 0, 3, [7, 8])
    got = side.store.take_when_ready([DraftWant("a", 2), DraftWant("b", 0), DraftWant("c", 4),
                                      DraftWant("gone", 4)], 0.0)
    assert [(t.start, t.tokens) for t in got[:3]] == [(3, [4, 5]), (3, []), (3, [])]
    assert isinstance(got[3], SessionVanished)


def test_a_session_is_waited_for_at_most_its_own_wait_and_the_others_their_whole(side):
    """``DraftWant.wait_s``: the step waits for a draft only as long as it is worth; a session
    without a bound is still waited for until its draft is in."""
    import threading

    for sid in ("a", "b"):
        new(side, sid)
    got: list = []
    take = threading.Thread(target=lambda: got.extend(side.store.take_when_ready(
        [DraftWant("a", 4, wait_s=0.0), DraftWant("b", 2)], 120.0)), daemon=True)
    take.start()
    try:
        take.join(0.3)  # "a" alone would end the wait at once: "b"'s draft is still awaited
        assert take.is_alive()
        side.push("b", 0, 3, [7, 8])
        take.join(60)
        assert not take.is_alive()  # ended by "b"'s draft, not by the 120 s deadline
    finally:
        if take.is_alive():
            side.push("b", 0, 3, [7, 8])
            take.join(60)
    assert [(t.tokens, t.ready) for t in got] == [([], False), ([7, 8], True)]
    bounded = threading.Thread(target=lambda: side.store.take_when_ready(
        [DraftWant("a", 4, wait_s=0.05), DraftWant("b", 4, wait=False)], 120.0), daemon=True)
    bounded.start()
    bounded.join(60)
    assert not bounded.is_alive()  # its own 50 ms, not the step's 120 s


@pytest.mark.parametrize("drafter", [None, ""])
def test_a_session_without_a_drafter_is_never_waited_for(side, drafter):
    """No drafter (None, or an empty id: both stores read it as none): no draft can come, so a
    take answers at once, not at its deadline, saying no drafter was there (the step then
    judges no drafter's lateness by it)."""
    import threading

    side.store.create("s", list(PROMPT), SamplingParams(), drafter, 64)
    got: list = []
    take = threading.Thread(target=lambda: got.extend(side.store.take_when_ready(
        [DraftWant("s", 4)], 120.0)), daemon=True)
    take.start()
    take.join(60)
    assert not take.is_alive() and [(t.tokens, t.ready, t.drafting) for t in got] == \
        [([], True, False)]


def test_a_step_commits_many_sessions_at_once_each_judged_alone(side):
    for sid in ("a", "b"):
        new(side, sid)
    side.push("a", 0, 3, [4, 5])
    side.push("b", 0, 3, [6])
    out = commit(side, Verdict("a", 0, 3, 2, 9), Verdict("b", 1, 3, 0, 9),
                  Verdict("gone", 0, 3, 0, 1), Verdict("b", 0, 3, 1, 7))
    assert [o.ok for o in out] == [True, False, False, True]
    assert side.tokens("a") == [*PROMPT, 4, 5, 9] and side.tokens("b") == [*PROMPT, 6, 7]


@pytest.mark.parametrize("epoch, start", [(1, 4), (0, 3), (0, 5)],
                         ids=["stale epoch", "overlap", "gap"])
def test_a_chunk_from_another_epoch_or_position_is_refused_and_changes_nothing(side, epoch,
                                                                              start):
    new(side)
    side.push("s", 0, 3, [4])  # the next chunk belongs at epoch 0, position 4
    with pytest.raises(Refused):
        side.push("s", epoch, start, [9])
    assert take(side).tokens == [4]


def test_after_a_fix_only_the_new_epoch_is_accepted(side):
    new(side)
    side.push("s", 0, 3, [4, 5])
    commit(side, Verdict("s", 0, 3, 0, 7))  # 4 rejected: 7; epoch 1
    with pytest.raises(Refused):
        side.push("s", 0, 4, [5])
    assert side.push("s", 1, 4, [8]) == 1
    assert take(side).tokens == [8]


def test_a_chunk_a_step_overtook_is_placed_only_trimmed_at_the_fix_under_its_epoch(side):
    """What a board does when a step decoded its chunk's first token without it: the chunk as
    drafted is stale, its tokens after the fix's are placed at the fix's end."""
    new(side)
    [out] = commit(side, Verdict("s", 0, 3, 0, 4))  # no draft: 4 decoded, a fix at 3
    assert out.fix is not None and (out.fix.epoch, out.fix.position) == (1, 3)
    with pytest.raises(Refused):
        side.push("s", 0, 3, [4, 5, 6])  # the chunk as drafted
    with pytest.raises(Refused):
        side.push("s", 1, 3, [4, 5, 6])  # under the new epoch, but over a committed token
    assert side.push("s", 1, 4, [5, 6]) == 2
    t = take(side)
    assert (t.epoch, t.start, t.tokens) == (1, 4, [5, 6])


def test_a_finished_session_refuses_chunks(side):
    new(side)
    [out] = commit(side, Verdict("s", 0, 3, 0, 4, finish_reason="stop"))
    assert out.ok
    with pytest.raises(Refused):
        side.push("s", 1, 4, [5])


def test_sessions_closed_together_each_refuse_chunks_and_the_others_go_on(side):
    for sid in ("a", "b", "c"):
        new(side, sid)
    side.store.close_many({"a": "stop", "b": "length"})
    for sid in ("a", "b"):
        with pytest.raises(Refused):
            side.push(sid, 0, 3, [4])
    assert side.push("c", 0, 3, [4, 5]) == 2
    assert take(side, "c").tokens == [4, 5]



def test_a_verdict_for_a_closed_session_is_refused_and_changes_nothing(side):
    new(side)
    side.push("s", 0, 3, [4, 5])
    side.store.close("s", "cancelled")
    [out] = commit(side, Verdict("s", 0, 3, 2, 6))
    assert not out.ok
    if not isinstance(side, LocalSide):  # the local store forgets a closed session at once
        assert side.tokens("s") == [1, 2, 3] and side.fixes("s") == []

# -- verdicts ------------------------------------------------------------------------------------
def test_a_full_accept_with_a_bonus_publishes_a_fix_at_the_draft_end(side):
    new(side)
    side.push("s", 0, 3, [4, 5])
    [out] = commit(side, Verdict("s", 0, 3, 2, 6))
    assert out.ok and out.fix == Fix(out.fix.id, 1, 5, (6,))
    assert side.tokens("s") == [1, 2, 3, 4, 5, 6] and take(side).tokens == []
    assert side.fixes("s") == [(1, 5, (6,))]


def test_a_token_the_draft_held_needs_no_fix_and_the_rest_stays(side):
    new(side)
    side.push("s", 0, 3, [4, 5, 6, 7])
    [out] = commit(side, Verdict("s", 0, 3, 2, 6))  # looked at [4, 5]; 6 is the draft's next
    assert out.ok and out.fix is None
    t = take(side)
    assert (t.epoch, t.start, t.tokens) == (0, 6, [7])
    assert side.push("s", 0, 7, [8]) == 1  # the drafter goes on at the same epoch
    assert side.fixes("s") == []


def test_a_rejection_drops_the_draft_and_moves_the_epoch(side):
    new(side)
    side.push("s", 0, 3, [4, 5, 6])
    [out] = commit(side, Verdict("s", 0, 3, 1, 9))
    assert out.fix is not None and (out.fix.epoch, out.fix.position, out.fix.tokens) == \
        (1, 4, (9,))
    assert side.tokens("s") == [1, 2, 3, 4, 9]
    t = take(side)
    assert (t.epoch, t.start, t.tokens) == (1, 5, [])


@pytest.mark.parametrize("verdict", [Verdict("s", 1, 3, 0, 9), Verdict("s", 0, 4, 0, 9),
                                     Verdict("s", 0, 3, 3, 9)],
                         ids=["stale epoch", "wrong position", "more than drafted"])
def test_a_verdict_that_does_not_fit_is_refused_and_changes_nothing(side, verdict):
    new(side)
    side.push("s", 0, 3, [4, 5])
    [out] = commit(side, verdict)
    assert not out.ok and out.fix is None and out.error
    assert side.tokens("s") == PROMPT and take(side).tokens == [4, 5]
    assert side.fixes("s") == []


@pytest.mark.parametrize("verdict", [Verdict("s", 0, 3, 1, 5), Verdict("s", 0, 3, 1, 8),
                                     Verdict("s", 0, 3, 0, 4, finish_reason="length")],
                         ids=["held", "fix", "last"])
def test_a_replayed_commit_is_answered_as_applied_and_changes_nothing(side, verdict):
    new(side)
    side.push("s", 0, 3, [4, 5, 6])
    [first] = commit(side, verdict)
    assert first.ok
    after = side.tokens("s"), take(side), side.fixes("s")
    [again] = commit(side, verdict)  # its reply was lost: the verifier sends it again
    assert again.ok and again.fix is None
    assert (side.tokens("s"), take(side), side.fixes("s")) == after


def test_verdicts_of_one_call_are_answered_in_their_own_slots(side):
    new(side, "a")
    new(side, "b")
    side.push("a", 0, 3, [4])
    outs = commit(side, Verdict("a", 0, 3, 1, 5), Verdict("b", 7, 3, 0, 5),
                   Verdict("gone", 0, 3, 0, 5))
    assert [o.ok for o in outs] == [True, False, False]
    assert side.tokens("a") == [1, 2, 3, 4, 5] and side.tokens("b") == PROMPT


def test_a_vanished_session_is_reported_in_its_slot(side):
    new(side, "a")
    new(side, "b")
    side.forget("b")
    taken = side.store.take_when_ready([DraftWant("a", 4), DraftWant("b", 4)], 0.0)
    assert taken[0].tokens == [] and isinstance(taken[1], SessionVanished)


@pytest.mark.parametrize("bad", [None, -1, 2.0, True, "3", 99, 10 ** 30])
def test_the_local_store_refuses_draft_ids_outside_the_vocabulary(bad):
    """Draft ids are checked where drafts enter (the cache service checks a board's chunks,
    tests/test_hostile_drafter.py), so the verifier trusts what it takes: nothing of a bad chunk
    is kept, in its chain or its branches."""
    store = LocalSessionStore(vocab_size=50)
    store.create("s", list(PROMPT), SamplingParams(), "dev", 64)
    state = store.sessions["s"]
    with pytest.raises(ValueError, match=r"\[0, 50\)"):
        state.push_draft(0, len(PROMPT), [4, bad])
    with pytest.raises(ValueError, match=r"\[0, 50\)"):
        state.push_draft(0, len(PROMPT), [4, 5], branches=[Branch(1, (bad,))])
    assert state.draft == [] and state.branches == []
    assert state.push_draft(0, len(PROMPT), [4, 49], branches=[Branch(1, (7,))]) == 2


def test_a_redis_commit_that_raises_fails_its_slot_and_the_others_land(side):
    if isinstance(side, LocalSide):
        pytest.skip("a key of the wrong type is Redis's")
    for sid in ("a", "b"):
        new(side, sid)
    side.push("a", 0, 3, [4])
    draft = side.store.keys.session("b")[2]
    side.store.redis.delete(draft)
    side.store.redis.rpush(draft, "not a string")  # GET in the commit raises WRONGTYPE
    out = commit(side, Verdict("b", 0, 3, 0, 9), Verdict("a", 0, 3, 1, 8))
    assert not out[0].ok and "WRONGTYPE" in out[0].error
    assert out[1].ok and side.tokens("a") == [*PROMPT, 4, 8]
