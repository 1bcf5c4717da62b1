"""What the Redis-backed store refuses and survives, against real Redis servers: a commit
replayed after it landed (applied once), a refused commit (its session alone fails), a session
whose keys vanished (reported in its slot, gone whole), and a Redis out of memory (the commit
held as an outage, nothing of it landed, the retry lands it)."""

import pytest
from redis_store import attach, store  # noqa: F401

from edgespec.config import SamplingParams
from edgespec.protocol.contract import DraftWant, SessionVanished, Verdict


def test_commit_replayed_after_it_landed_is_not_applied_twice(store):
    dev = attach(store)
    store.create("s8", [1, 2], SamplingParams(), dev)
    store.push("s8", 0, 2, [3, 4], idle=False, window=8)
    v = Verdict("s8", 0, 2, 2, 7)
    [first] = store.commit_many([v])
    [again] = store.commit_many([v])  # e.g. the reply was lost and the verifier retried
    assert first.ok and again.ok
    assert store.snapshot("s8").tokens == [1, 2, 3, 4, 7]
    [wrong] = store.commit_many([Verdict("s8", 1, 3, 0, 9)])  # a position the cache is past
    assert not wrong.ok and "ends at" in wrong.error


def test_a_refused_commit_fails_only_its_own_session(store):
    dev = attach(store)
    store.create("s9", [1], SamplingParams(), dev)
    store.create("s10", [1], SamplingParams(), dev)
    outs = store.commit_many([Verdict("gone", 0, 1, 0, 5), Verdict("s9", 0, 1, 0, 5),
                              Verdict("s10", 0, 1, 0, 6)])
    assert [o.ok for o in outs] == [False, True, True]
    assert store.snapshot("s9").tokens == [1, 5] and store.snapshot("s10").tokens == [1, 6]


def test_a_vanished_session_is_reported_in_its_slot(store):
    dev = attach(store)
    store.create("s11", [1], SamplingParams(), dev)
    store.redis.delete(*store.keys.session("s11"))
    taken = store.take_when_ready([DraftWant("s11", 2)], 5)
    assert isinstance(taken[0], SessionVanished)


def test_a_session_whose_tokens_key_is_gone_is_gone(store):
    """A Redis that evicts keys (or an operator's DEL) can take a session's tokens and leave
    its hash: the session is gone, as when both went (the SDK re-creates it from what it holds),
    not a record with an empty prompt (its resume was refused as "the prompt is empty")."""
    dev = attach(store)
    store.create("s13", [1, 2], SamplingParams(), dev)
    store.commit_many([Verdict("s13", 0, 2, 0, 4)])
    assert store.load("s13").committed == [4]
    store.redis.delete(store.keys.session("s13")[1])
    assert store.redis.exists(store.keys.session("s13")[0])
    assert store.load("s13") is None and store.snapshot("s13") is None


def test_a_redis_out_of_memory_holds_the_commit_as_an_outage(store):
    """A Redis at its maxmemory that evicts nothing refuses writes: the step's commit raises
    StoreUnavailable (the verifier holds its sessions and retries, health says so) instead of
    refusing each session (each failed with '-OOM'). Nothing of the refused call landed; the
    retry, once Redis has room, lands the verdicts, and a verdict sent again is a replay."""
    from edgespec.protocol.contract import StoreUnavailable

    dev = attach(store)
    for sid in ("m1", "m2"):
        store.create(sid, [1], SamplingParams(), dev)
    r = store.redis
    old = r.config_get("maxmemory*")
    try:
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", 1)  # every write refused from now on
        with pytest.raises(StoreUnavailable, match="out of memory"):
            store.commit_many([Verdict("m1", 0, 1, 0, 5), Verdict("m2", 0, 1, 0, 6)])
    finally:
        r.config_set("maxmemory", old["maxmemory"])
        r.config_set("maxmemory-policy", old["maxmemory-policy"])
    assert store.load("m1").committed == [] and store.load("m2").committed == []
    assert store.commit_many([Verdict("m1", 0, 1, 0, 5)])[0].ok
    outs = store.commit_many([Verdict("m1", 0, 1, 0, 5), Verdict("m2", 0, 1, 0, 6)])
    assert [o.ok for o in outs] == [True, True]
    assert store.load("m1").committed == [5] and store.load("m2").committed == [6]
