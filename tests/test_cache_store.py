"""The Redis-backed session store against real Redis servers (embedded and external): sessions
created, drafted, taken, committed, fixed, resumed, expired and closed. What a board hears in
its inbox: ``test_cache_store_inbox``; its waits for drafts: ``test_cache_waits``; its refusals
and outages: ``test_cache_store_faults``; the connection to Redis itself:
``test_redis_connection``."""

import pytest
from redis_store import attach, store  # noqa: F401

from cache_service.codec import InboxEvent
from cache_service.store import RedisSessionStore, StoreError
from edgespec.config import SamplingParams
from edgespec.protocol.contract import Branch, DraftWant, SessionVanished, Verdict


def test_a_snapshot_says_where_an_exact_sessions_output_ends(store):
    """What a board is told at assignment: prompt + max_new_tokens, for an exactly verified
    session; nothing for one whose length was not said, or a loose one (its drafts past the
    end may confirm a mismatch before it)."""
    store.create("said", [1, 2, 3], SamplingParams(), None, max_new_tokens=5)
    store.create("unsaid", [1, 2, 3], SamplingParams(), None)
    store.create("loose", [1, 2, 3], SamplingParams(), None, max_new_tokens=5, verify="loose")
    assert [store.snapshot(s).output_end for s in ("said", "unsaid", "loose")] == [8, None, None]


def test_a_session_asked_for_nothing_is_taken_as_redis_holds_it(store):
    """A session created here and asked for no draft is taken from what this process's commits
    left, with no read of Redis: the same epoch and position that Redis holds (read by another
    replica), with a board pushing chunks to it or without one (a chunk moves neither). Once
    Redis lost it, its commit is refused, and the session is read from Redis again (vanished);
    another replica's resume, or a close, is likewise never answered from what this process
    knew."""
    store.create("solo", [1, 2, 3], SamplingParams(), None)
    store.create("boarded", [1, 2, 3], SamplingParams(), "dev-a")
    other = RedisSessionStore(store.redis, prefix="t:", ttl_s=30)
    reads = []
    script = store._take_many
    store._take_many = lambda **kw: reads.append(kw) or script(**kw)
    want = [DraftWant("solo", 0, wait=False), DraftWant("boarded", 0, wait=False)]
    try:
        for token in (7, 8, 9):
            mine, theirs = store.take_when_ready(want, 0.0), other.take_when_ready(want, 0.0)
            for m, t in zip(mine, theirs):
                assert (m.epoch, m.start, m.tokens, m.ready) == \
                    (t.epoch, t.start, t.tokens, t.ready)
            # the board drafts on meanwhile: its chunk is taken only by a step that asks
            assert other.push("boarded", mine[1].epoch, mine[1].start, [5, 6], False, 8).kept
            outs = store.commit_many([Verdict(sid, m.epoch, m.start, 0, token)
                                      for sid, m in zip(("solo", "boarded"), mine)])
            assert all(out.error is None for out in outs)
        assert reads == [] and store.snapshot("solo").tokens == [1, 2, 3, 7, 8, 9]
        assert store.snapshot("boarded").tokens == [1, 2, 3, 7, 8, 9]
        # a chunk pending, then a commit its draft held (the board's 5: the epoch stays, its 6
        # still drafted): asked nothing, the same answer as Redis's each time
        [_, at] = store.take_when_ready(want, 0.0)
        assert other.push("boarded", at.epoch, at.start, [5, 6], False, 8).kept == 2
        for token in (None, 5):
            if token is not None:
                [out] = store.commit_many([Verdict("boarded", at.epoch, at.start, 0, token)])
                assert out.error is None and out.fix is None  # held: no fix
            mine, theirs = store.take_when_ready(want, 0.0), other.take_when_ready(want, 0.0)
            assert [(m.epoch, m.start, m.tokens, m.ready) for m in mine] == \
                [(t.epoch, t.start, t.tokens, t.ready) for t in theirs]
            at = mine[1]
        [held] = other.take_when_ready([DraftWant("boarded", 2, wait=False)], 0.0)
        assert (held.epoch, held.start, held.tokens) == (at.epoch, at.start, [6])
        assert reads == []
        store.take_when_ready([DraftWant("solo", 2)], 0.0)  # asked for a draft: read
        assert len(reads) == 1
        # Redis lost it (a restart without persistence): the take, answered from memory, is
        # taken; its commit is refused; the next take reads, and finds it gone
        store.redis.delete(*store.keys.session("solo"))
        [mine] = store.take_when_ready(want[:1], 0.0)
        [out] = store.commit_many([Verdict("solo", mine.epoch, mine.start, 0, 6)])
        assert out.error is not None
        [gone] = store.take_when_ready(want[:1], 0.0)
        assert isinstance(gone, SessionVanished) and len(reads) == 2
        # another replica resumes a session this process created: its commit is refused, then
        # the session is read where Redis holds it
        store.create("duo", [1, 2], SamplingParams(), None)
        other.create("duo", [1, 2], SamplingParams(), None, committed=[5, 6])
        [mine] = store.take_when_ready([DraftWant("duo", 0, wait=False)], 0.0)
        [out] = store.commit_many([Verdict("duo", mine.epoch, mine.start, 0, 6)])
        assert out.error is not None
        [mine] = store.take_when_ready([DraftWant("duo", 0, wait=False)], 0.0)
        [theirs] = other.take_when_ready([DraftWant("duo", 0, wait=False)], 0.0)
        assert (mine.epoch, mine.start) == (theirs.epoch, theirs.start) == (1, 4)
        store.close("duo")  # closed: read again (it answers what Redis holds)
        reads.clear()
        store.take_when_ready([DraftWant("duo", 0, wait=False)], 0.0)
        assert len(reads) == 1
    finally:
        other.shutdown()


def test_a_sessions_keys_keep_an_expiry_moved_on_every_16_tokens(store):
    """Every key of a session always expires (a draft reset or a branch list made anew keeps
    one); commits within 16 tokens leave the expiry where it was, the commit that crosses a
    multiple of 16 moves every key's to the full TTL."""
    dev = attach(store)
    store.create("s9", [1, 2, 3], SamplingParams(), dev)
    keys = store.keys.session("s9")

    def ttls():  # each existing key's seconds left (-1: no expiry; -2: no key)
        return [store.redis.ttl(k) for k in keys if store.redis.exists(k)]

    store.push("s9", 0, 3, [4, 5, 6], idle=False, window=8,
               branches=[Branch(3, (7,)), Branch(4, (8, 9))])
    for k in keys:
        store.redis.expire(k, 5)  # as if the session had been quiet for 25 s
    store.take_when_ready([DraftWant("s9", 3, branch_budget=4)], 0.0)
    [out] = store.commit_many([Verdict("s9", 0, 3, 1, 5)])  # held: draft and branches kept
    assert out.ok and out.fix is None and all(0 < t <= 5 for t in ttls())
    [out] = store.commit_many([Verdict("s9", 0, 5, 0, 11)])  # a fix: the draft reset
    assert out.fix is not None and all(0 < t <= 5 for t in ttls())
    end = len(store.snapshot("s9").tokens)
    epoch = out.fix.epoch
    while end < 16:  # tokens committed one at a time, each a fix, up to the 16th
        [out] = store.commit_many([Verdict("s9", epoch, end, 0, 12)])
        epoch, end = out.fix.epoch, end + 1
        assert all(0 < t <= (5 if end < 16 else 30) for t in ttls()), (end, ttls())
    assert all(t > 5 for t in ttls())  # crossing 16: the full TTL again


def test_held_token_commits_without_fix(store):
    dev = attach(store)
    store.create("s2", [1], SamplingParams(), dev)
    store.push("s2", 0, 1, [7, 8, 9], idle=False, window=8)
    store.take_when_ready([DraftWant("s2", 1)], 0.0)
    [out] = store.commit_many([Verdict("s2", 0, 1, 1, 8)])
    assert out.ok and out.fix is None
    [(_, ev)] = store.read_events(dev, "0-0", 10)[-1:]
    assert ev == InboxEvent("commit", "s2", epoch=0, end=3)  # the step's ask unsaid: None
    [taken] = store.take_when_ready([DraftWant("s2", 8)], 0.0)
    assert taken.tokens == [9] and taken.start == 3 and taken.epoch == 0


def test_branches_are_stored_taken_kept_ahead_and_dropped_by_a_fix(store):
    dev = attach(store)
    store.create("s9", [1, 2], SamplingParams(), dev)
    res = store.push("s9", 0, 2, [10, 11, 12, 13], idle=False, window=3, branches=[
        Branch(0, (20, 21)), Branch(2, (22,)), Branch(3, (23,)),  # at 3: beyond the window
        Branch(1, (11,))])  # the chain's own token: not a branch
    assert res.kept == 3
    [taken] = store.take_when_ready([DraftWant("s9", 3, 2)], 0.0)
    assert taken.tokens == [10, 11, 12]
    assert taken.branches == [Branch(0, (20, 21))]  # the branch budget: two tokens
    [taken] = store.take_when_ready([DraftWant("s9", 3)], 0.0)
    assert taken.branches == []  # no branch budget: a chain
    [out] = store.commit_many([Verdict("s9", 0, 2, 1, 11)])  # 10 accepted, 11 held
    assert out.ok and out.fix is None
    [taken] = store.take_when_ready([DraftWant("s9", 3, 8)], 0.0)
    assert (taken.start, taken.tokens, taken.branches) == (4, [12], [Branch(0, (22,))])
    store.push("s9", 0, 5, [14], idle=False, window=8, branches=[Branch(0, (24, 25))])
    ev0 = store.read_events(dev, "0-0", 100)[-1][0]
    [out] = store.commit_many([Verdict("s9", 0, 4, 1, 7, branch=(24,))])  # 12, then branch 24
    fix = out.fix
    assert (fix.epoch, fix.position, fix.tokens) == (1, 5, (24, 7))
    assert store.snapshot("s9").tokens == [1, 2, 10, 11, 12, 24, 7]
    assert store.redis.llen(store.keys.session("s9")[3]) == 0  # a fix drops the branches
    ev = store.read_events(dev, ev0, 10)
    assert ev[-1][1] == InboxEvent("commit", "s9", epoch=1, end=7, fix=True, token=24,
                                   position=5, more=(7,))
    # a replayed branch commit is recognised, not applied twice
    [again] = store.commit_many([Verdict("s9", 0, 4, 1, 7, branch=(24,))])
    assert again.ok and store.snapshot("s9").tokens == [1, 2, 10, 11, 12, 24, 7]


def test_stale_and_misplaced_chunks_are_refused_and_change_nothing(store):
    dev = attach(store)
    store.create("s3", [1, 2], SamplingParams(), dev)
    store.push("s3", 0, 2, [3], idle=False, window=8)
    store.commit_many([Verdict("s3", 0, 2, 0, 5)])  # rejection: epoch 1
    with pytest.raises(StoreError) as e:
        store.push("s3", 0, 3, [6], idle=False, window=8)
    assert e.value.kind == "stale"
    with pytest.raises(StoreError) as e:
        store.push("s3", 1, 7, [6], idle=False, window=8)
    assert e.value.kind == "position"
    with pytest.raises(StoreError) as e:
        store.push("nope", 0, 0, [6], idle=False, window=8)
    assert e.value.kind == "unknown"
    with pytest.raises(StoreError) as e:  # another device's session: refused in the script
        store.push("s3", 1, 3, [6], idle=False, window=8, device="not-" + dev)
    assert e.value.kind == "device"
    with pytest.raises(StoreError) as e:  # its device, once, first: an unknown session
        store.push("nope", 0, 0, [6], idle=False, window=8, device=dev)
    assert e.value.kind == "unknown"
    [taken] = store.take_when_ready([DraftWant("s3", 8)], 0.0)
    assert taken.tokens == [] and store.snapshot("s3").tokens == [1, 2, 5]
    # the session's own device pushes, with its branches placed as without a device
    res = store.push("s3", 1, 3, [6, 7], idle=False, window=8, device=dev,
                     branches=[Branch(at=1, tokens=(8,))])
    assert (res.kept, res.committed_end) == (2, 3)
    [taken] = store.take_when_ready([DraftWant("s3", 8, 1)], 0.0)
    assert taken.tokens == [6, 7] and taken.branches == [Branch(1, (8,))]


def test_window_bounds_the_draft_and_params_round_trip(store):
    dev = attach(store)
    store.create("s4", [1], SamplingParams(temperature=1.0, seed=4), dev)
    assert store.push("s4", 0, 1, [3, 5, 6], idle=False, window=2).kept == 2
    [taken] = store.take_when_ready([DraftWant("s4", 8)], 0.0)
    assert taken.tokens == [3, 5]
    assert store.snapshot("s4").params == SamplingParams(temperature=1.0, seed=4)


def test_resume_record_and_epoch_moves_on(store):
    dev = attach(store)
    params = SamplingParams(temperature=0.7, seed=3)
    store.create("s12", [1, 2], params, dev, max_new_tokens=9)
    store.push("s12", 0, 2, [3], idle=False, window=8)
    store.commit_many([Verdict("s12", 0, 2, 1, 4)])
    rec = store.load("s12")
    assert (rec.prompt, rec.committed, rec.params, rec.max_new_tokens) == \
        ([1, 2], [3, 4], params, 9)
    assert rec.finish_reason is None
    before = store.snapshot("s12").epoch
    store.create("s12", rec.prompt, rec.params, dev, rec.max_new_tokens, committed=rec.committed)
    snap = store.snapshot("s12")
    assert snap.tokens == [1, 2, 3, 4] and snap.epoch > before
    with pytest.raises(StoreError):  # a chunk drafted before the resume
        store.push("s12", before, 4, [5], idle=False, window=8)
    store.close("s12", "length")
    assert store.load("s12").finish_reason == "length"


def test_sessions_expire_and_close_notifies_the_drafter(store):
    dev = attach(store)
    store.create("s6", [1], SamplingParams(), dev)
    ttl = store.redis.ttl("t:s:s6")
    assert 0 < ttl <= 30
    store.close("s6", "stop", keep_s=5)
    assert store.devices.sessions_of(dev) == []
    assert store.read_events(dev, "0-0", 10)[-1][1] == InboxEvent("close", "s6")
    assert 0 < store.redis.ttl("t:s:s6") <= 5
    assert store.snapshot("s6") is None


def test_sessions_that_end_together_are_closed_in_one_round_trip(store, monkeypatch):
    """A step's sessions that end together: each marked done with its own finish reason, its
    board told, its keys left to expire, in one transaction; a session not named goes on."""
    dev = attach(store)
    for sid in ("c1", "c2", "c3"):
        store.create(sid, [1, 2], SamplingParams(), dev)
    rounds = []
    real = store.redis.pipeline
    monkeypatch.setattr(store.redis, "pipeline", lambda *a, **k: rounds.append(1) or real(*a, **k))
    store.close_many({"c1": "stop", "c2": "length"}, keep_s=5)
    assert len(rounds) == 1
    assert [store.load(s).finish_reason for s in ("c1", "c2")] == ["stop", "length"]
    assert store.load("c3").finish_reason is None and not store.load("c3").done
    assert store.devices.sessions_of(dev) == ["c3"]
    closes = [ev for _, ev in store.read_events(dev, "0-0", 10) if ev.kind == "close"]
    assert closes == [InboxEvent("close", "c1"), InboxEvent("close", "c2")]
    assert all(0 < store.redis.ttl(f"t:s:{s}") <= 5 for s in ("c1", "c2"))


def test_least_loaded_live_device_is_picked(store):
    attach(store, "a")
    attach(store, "b")
    store.create("x1", [1], SamplingParams(), "a")
    assert store.devices.pick() == "b"
    store.devices.mark_gone("b")
    assert store.devices.pick() == "a"


def test_a_session_keeps_its_verification_mode_for_a_resume(store):
    store.create("sv", [1, 2], SamplingParams(), None, verify="loose")
    assert store.load("sv").verify == "loose"
    store.create("se", [1, 2], SamplingParams(), None)
    assert store.load("se").verify == "exact"
