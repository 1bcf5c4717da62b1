"""What a session's board hears through its inbox, the Redis-backed session store's event
stream, against real Redis servers: a commit and its fix, from any verifier replica; the step's
ask (``wanted``) carried to the board; a rested board told nothing until asked again, then every
token it missed in one fix (or a plain commit where its draft held them); the one codec the
commit script and ``InboxEvent`` share. The store's sessions otherwise: ``test_cache_store``."""

from redis_store import attach, store  # noqa: F401

from cache_service.codec import COMMIT_FIELDS, InboxEvent
from cache_service.store import RedisSessionStore
from edgespec.config import SamplingParams
from edgespec.protocol.contract import DraftWant, Verdict


def test_push_take_commit_with_fix_reaches_the_inbox(store):
    dev = attach(store)
    store.create("s1", [1, 2, 3], SamplingParams(), dev)
    assert store.snapshot("s1").tokens == [1, 2, 3]
    events = store.read_events(dev, "0-0", 10)
    assert events[0][1] == InboxEvent("assign", "s1")
    res = store.push("s1", 0, 3, [4, 5, 6], idle=False, window=8)
    assert (res.kept, res.committed_end) == (3, 3)
    [taken] = store.take_when_ready([DraftWant("s1", 2)], 0.0)
    assert (taken.epoch, taken.start, taken.tokens) == (0, 3, [4, 5])
    # 4 accepted, 5 rejected -> 9; the step had asked 2 draft tokens of it
    [out] = store.commit_many([Verdict("s1", 0, 3, 1, 9, wanted=2)])
    fix = out.fix
    assert (fix.epoch, fix.position, fix.tokens) == (1, 4, (9,))
    snap = store.snapshot("s1")
    assert snap.tokens == [1, 2, 3, 4, 9] and snap.epoch == 1
    ev = store.read_events(dev, events[0][0], 10)
    assert ev[-1][1] == InboxEvent("commit", "s1", epoch=1, end=5, fix=True, token=9,
                                   position=4, wanted=2)


def test_a_verifier_that_did_not_create_the_session_reaches_its_board(store):
    """The take and commit scripts find a session's board from the session itself, not from the
    verifier process that created it: another replica's take sees the board drafting (a step
    waits for it) and its fix reaches the board's inbox."""
    dev = attach(store)
    store.create("s2", [1, 2, 3], SamplingParams(), dev)
    other = RedisSessionStore(store.redis, prefix="t:", ttl_s=30)
    store.push("s2", 0, 3, [4], idle=False, window=8)
    [taken] = other.take_when_ready([DraftWant("s2", 2)], 0.05)
    assert taken.tokens == [4] and not taken.ready  # a live board still drafting: not ready
    [out] = other.commit_many([Verdict("s2", 0, 3, 0, 9)])
    assert (out.fix.epoch, out.fix.position, out.fix.tokens) == (1, 3, (9,))
    [(_, ev)] = store.read_events(dev, "0-0", 10)[-1:]
    assert ev == InboxEvent("commit", "s2", epoch=1, end=4, fix=True, token=9, position=3,
                            wanted=None)
    store.devices.mark_gone(dev)
    [taken] = other.take_when_ready([DraftWant("s2", 2)], 0.0)
    assert taken.ready  # no board drafting for it: nothing to wait for
    other.shutdown()


def test_one_codec_for_inbox_events():
    """The commit script writes exactly the fields ``InboxEvent`` reads, in its order, and every
    event survives its own fields; an unknown kind reads as None (skipped)."""
    import re

    from cache_service.store_lua import COMMIT_LUA

    xadd = COMMIT_LUA[COMMIT_LUA.index("'XADD'"):]
    xadd = xadd[:xadd.index("\n", xadd.index("'more'"))]
    names = re.findall(r"'(\w+)'", xadd.split("'*',", 1)[1])
    assert tuple(n for n in names if n != "commit") == COMMIT_FIELDS
    for ev in (InboxEvent("assign", "s1"), InboxEvent("close", "s2"),
               InboxEvent("commit", "s3", epoch=2, end=9),
               InboxEvent("commit", "s4", epoch=3, end=12, fix=True, token=7, position=9,
                          more=(8, 1)),
               InboxEvent("commit", "s7", epoch=1, end=4, wanted=0),
               InboxEvent("commit", "s8", epoch=2, end=6, fix=True, token=3, position=5,
                          wanted=5)):
        assert InboxEvent.parse(ev.fields()) == ev
    assert InboxEvent.parse({"t": "future-kind", "sid": "s5"}) is None


def test_a_commit_reaches_the_board_with_what_the_step_asked(store):
    """The cache hands the board the step's ask (``Commit.wanted``, proto3 optional: unset where
    the verifier did not say, so an older verifier's boards keep their whole window)."""
    from cache_service.service import DraftCacheService

    service = DraftCacheService(store, window=8, chunk=4, poll_ms=100)
    said = service._event_message(InboxEvent("commit", "s", epoch=1, end=4, wanted=0)).commit
    assert said.HasField("wanted") and said.wanted == 0
    fix = service._event_message(InboxEvent("commit", "s", epoch=2, end=6, fix=True, token=3,
                                            position=5, wanted=3)).commit
    assert fix.is_fix and fix.wanted == 3
    unsaid = service._event_message(InboxEvent("commit", "s", epoch=1, end=4)).commit
    assert not unsaid.HasField("wanted")


def _board_view(events, tokens: list[int], drafted: list[int]) -> tuple[list[int], int]:
    """What a board holds after reading ``events`` of one session: its tokens (``tokens``, the
    committed ones it knew, then its own ``drafted`` ones; a fix rolls back to its position and
    appends its tokens) and the committed end it knows."""
    have, end = tokens + drafted, len(tokens)
    for _, ev in events:
        if ev.kind != "commit":
            continue
        if ev.fix:
            have = have[:ev.position] + [ev.token, *ev.more]
        assert len(have) >= ev.end  # a commit without a fix: the board's draft held it
        end = ev.end
    return have[:end], end


def test_a_rested_board_hears_what_it_missed_in_one_fix_when_asked_again(store):
    """Once a board was told that a step asked none of its session (wanted 0), the commits
    that ask none after it write no event (a rested board costs the server's core nothing a
    step); the first commit that asks again carries every token committed meanwhile, as one fix
    from the end the board knows, and the board ends where the session does."""
    dev = attach(store)
    store.create("r", [1, 2, 3], SamplingParams(), dev)
    after = store.read_events(dev, "0-0", 10)[-1][0]
    store.commit_many([Verdict("r", 0, 3, 0, 7, wanted=0)])  # told: rest
    store.commit_many([Verdict("r", 1, 4, 0, 8, wanted=0)])
    store.commit_many([Verdict("r", 2, 5, 0, 9, wanted=0)])
    told = store.read_events(dev, after, 10)
    assert [ev for _, ev in told] == [InboxEvent("commit", "r", epoch=1, end=4, fix=True,
                                                 token=7, position=3, wanted=0)]
    store.commit_many([Verdict("r", 3, 6, 0, 5, wanted=2)])  # asked again
    [(_, ev)] = store.read_events(dev, told[-1][0], 10)
    assert ev == InboxEvent("commit", "r", epoch=4, end=7, fix=True, token=8, position=4,
                            more=(9, 5), wanted=2)
    assert _board_view(told + [(None, ev)], [1, 2, 3], []) == (store.snapshot("r").tokens, 7)
    # asked again, then rested again: told at once, once
    store.commit_many([Verdict("r", 4, 7, 0, 6, wanted=0)])
    store.commit_many([Verdict("r", 5, 8, 0, 4, wanted=0)])
    assert [e.wanted for _, e in store.read_events(dev, told[-1][0], 10)] == [2, 0]
    # a board attaching again is sent the session whole and hears every commit until told
    again = store.read_events(dev, "0-0", 100)[-1][0]
    store.told_afresh("r")
    store.commit_many([Verdict("r", 6, 9, 0, 3, wanted=0)])
    store.commit_many([Verdict("r", 7, 10, 0, 2, wanted=0)])
    assert [(e.end, e.wanted) for _, e in store.read_events(dev, again, 10)] == [(10, 0)]


def test_a_rested_boards_draft_that_held_every_commit_is_told_the_new_end(store):
    """A board rested while the cache held its draft: commits its draft held (no fix) and no
    fix meanwhile, so the commit that asks again is a plain commit to the new end (no epoch
    moved: a fix under the board's own epoch would be ignored by it)."""
    dev = attach(store)
    store.create("h", [1, 2, 3], SamplingParams(), dev)
    store.push("h", 0, 3, [4, 5, 6, 7, 8, 9], idle=False, window=8)
    after = store.read_events(dev, "0-0", 10)[-1][0]
    store.commit_many([Verdict("h", 0, 3, 0, 4, wanted=0)])  # the draft's 4: held, told rest
    store.commit_many([Verdict("h", 0, 4, 1, 6, wanted=0)])  # 5, 6: held
    store.commit_many([Verdict("h", 0, 6, 0, 7, wanted=1)])  # 7: held; asked again
    events = store.read_events(dev, after, 10)
    assert [ev for _, ev in events] == [InboxEvent("commit", "h", epoch=0, end=4, wanted=0),
                                        InboxEvent("commit", "h", epoch=0, end=7, wanted=1)]
    assert _board_view(events, [1, 2, 3], [4, 5, 6, 7, 8, 9]) == \
        (store.snapshot("h").tokens, 7)
