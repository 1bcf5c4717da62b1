"""Boards' chunks stored several to a round trip: ``RedisSessionStore.push_many`` (each chunk
answered as ``push`` alone would answer it, in order, one refused or failing leaving the others
stored) and the cache's ``ChunkBatcher`` (the chunks that Attach streams hand it while a call is
in flight go together in the next; each pusher gets its own chunk's outcome)."""

from __future__ import annotations

import threading
import time

import pytest
import redis
from redis_store import attach, store  # noqa: F401

from cache_service import chunk_batcher
from cache_service.chunk_batcher import ChunkBatcher
from cache_service.store import StoreError
from cache_service.store_records import ChunkPush
from edgespec.config import SamplingParams
from edgespec.protocol.contract import Branch, DraftWant

PROMPT = [1, 2, 3]


def _chunk(store, sid, epoch, start, tokens, device="", branches=()):
    return ChunkPush.of(sid, epoch, start, tokens, False, 8, branches, device)


def _draft(store, sid):
    [t] = store.take_when_ready([DraftWant(sid, 8, branch_budget=8)], 0.0)
    return t.tokens, t.branches


def test_one_call_stores_each_chunk_as_a_push_would_and_in_order(store):
    dev = attach(store)
    for sid in ("a", "b", "c"):
        store.create(sid, PROMPT, SamplingParams(), dev)
    out = store.push_many([
        _chunk(store, "a", 0, 3, [4, 5], dev, branches=[Branch(1, (9,))]),
        _chunk(store, "a", 0, 5, [6], dev),  # follows the chunk before it in the same call
        _chunk(store, "b", 1, 3, [4]),  # a stale epoch
        _chunk(store, "b", 1 << 40, 3, [4]),  # an epoch of no session (out of 32 bits)
        _chunk(store, "c", 0, 4, [4]),  # misplaced
        _chunk(store, "c", 0, 3, [7], "another"),  # another device's session
        _chunk(store, "nobody", 0, 3, [4]),
        _chunk(store, "c", 0, 3, [7, 8]),
    ])
    kinds = [o.kind if isinstance(o, StoreError) else (o.kept, o.committed_end) for o in out]
    assert kinds == [(2, 3), (1, 3), "stale", "stale", "position", "device", "unknown", (2, 3)]
    assert "epoch 1" in str(out[2]) and "at epoch 0" in str(out[2])
    tokens, branches = _draft(store, "a")
    assert tokens == [4, 5, 6] and [(b.at, b.tokens) for b in branches] == [(1, (9,))]
    assert _draft(store, "b")[0] == [] and _draft(store, "c")[0] == [7, 8]


def test_a_chunk_the_script_fails_on_is_refused_alone(store):
    for sid in ("a", "b"):
        store.create(sid, PROMPT, SamplingParams(), None)
    draft = store.keys.session("b")[2]
    store.redis.delete(draft)
    store.redis.rpush(draft, "not a string")  # STRLEN in the push raises WRONGTYPE
    out = store.push_many([_chunk(store, "b", 0, 3, [4]), _chunk(store, "a", 0, 3, [4])])
    assert isinstance(out[0], StoreError) and out[0].kind == "error"
    assert "WRONGTYPE" in str(out[0])
    assert (out[1].kept, out[1].committed_end) == (1, 3) and _draft(store, "a")[0] == [4]


def test_chunks_pushed_while_a_call_is_in_flight_go_together_in_the_next(store, monkeypatch):
    n = 6
    for i in range(n):
        store.create(f"s{i}", PROMPT, SamplingParams(), None)
    batcher = ChunkBatcher(store)
    calls: list[list[str]] = []
    first_in_flight, release = threading.Event(), threading.Event()
    push_many = store.push_many

    def held_push_many(chunks):
        calls.append([c.session_id for c in chunks])
        if len(calls) == 1:
            first_in_flight.set()
            assert release.wait(30)
        return push_many(chunks)

    monkeypatch.setattr(store, "push_many", held_push_many)
    results: dict[str, object] = {}

    def pusher(sid, start, tokens):
        try:
            results[f"{sid}@{start}"] = batcher.push(_chunk(store, sid, 0, start, tokens))
        except StoreError as e:
            results[f"{sid}@{start}"] = e.kind

    first = threading.Thread(target=pusher, args=("s0", 3, [4]))
    first.start()
    assert first_in_flight.wait(30)
    others = [threading.Thread(target=pusher, args=(f"s{i}", 3, [4, 5])) for i in range(1, n)]
    others.append(threading.Thread(target=pusher, args=("s1", 9, [4])))  # misplaced
    for t in others:
        t.start()
    deadline = time.monotonic() + 30
    while batcher._queue.qsize() < len(others) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert batcher._queue.qsize() == len(others), "the pushers' chunks never all queued"
    release.set()
    for t in [first, *others]:
        t.join(30)
        assert not t.is_alive()
    assert calls[0] == ["s0"] and len(calls) == 2 and len(calls[1]) == len(others)
    assert (batcher.calls, batcher.chunks) == (2, n + 1)
    assert results.pop("s1@9") == "position"
    assert all((r.kept, r.committed_end) == ((1 if k == "s0@3" else 2), 3)
               for k, r in results.items())
    assert [_draft(store, f"s{i}")[0] for i in range(n)] == [[4]] + [[4, 5]] * (n - 1)


def test_a_failed_call_fails_every_chunk_in_it_and_the_next_call_goes_on(store, monkeypatch):
    store.create("s", PROMPT, SamplingParams(), None)
    batcher = ChunkBatcher(store)
    push_many = store.push_many
    failing = [True]

    def outage(chunks):
        if failing[0]:
            raise redis.ConnectionError("Redis went away")
        return push_many(chunks)

    monkeypatch.setattr(store, "push_many", outage)
    with pytest.raises(redis.ConnectionError):
        batcher.push(_chunk(store, "s", 0, 3, [4]))
    failing[0] = False
    assert batcher.push(_chunk(store, "s", 0, 3, [4])).kept == 1


def test_the_batching_thread_ends_when_idle_and_starts_again(store, monkeypatch):
    monkeypatch.setattr(chunk_batcher, "IDLE_S", 0.05)
    store.create("s", PROMPT, SamplingParams(), None)
    batcher = ChunkBatcher(store)
    assert batcher.push(_chunk(store, "s", 0, 3, [4])).kept == 1
    deadline = time.monotonic() + 30
    while batcher._running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not batcher._running
    assert batcher.push(_chunk(store, "s", 0, 4, [5])).kept == 1
    assert _draft(store, "s")[0] == [4, 5]


def test_a_chunk_whose_numbers_do_not_fit_the_script_is_refused_alone(store):
    """A branch position past 2^31 - 1 (``chunk_checks`` refuses such a chunk first) cannot be
    packed for the script: that chunk is refused, as kind "error", the others in the call are
    stored."""
    for sid in ("a", "b"):
        store.create(sid, PROMPT, SamplingParams(), None)
    past = (1 << 31) - 1
    bad = ChunkPush.of("b", 0, past, [4, 5], False, 8, [Branch(1, (9,))])
    out = store.push_many([_chunk(store, "a", 0, 3, [4]), bad, _chunk(store, "a", 0, 4, [5])])
    assert isinstance(out[1], StoreError) and out[1].kind == "error"
    assert [(o.kept, o.committed_end) for o in (out[0], out[2])] == [(1, 3), (1, 3)]
    assert _draft(store, "a")[0] == [4, 5] and _draft(store, "b")[0] == []


def test_a_call_that_fails_for_one_chunk_fails_that_chunk_alone(store, monkeypatch):
    """A call broken by something other than Redis (here a chunk that makes ``push_many``
    raise) is made again chunk by chunk: the chunk that breaks it is refused, the others are
    stored, and no pusher sees an exception."""
    for sid in ("a", "b", "c"):
        store.create(sid, PROMPT, SamplingParams(), None)
    batcher = ChunkBatcher(store)
    push_many = store.push_many

    def breaks_on_b(chunks):
        if any(c.session_id == "b" for c in chunks):
            raise ValueError("a chunk the call cannot take")
        return push_many(chunks)

    monkeypatch.setattr(store, "push_many", breaks_on_b)
    out = batcher.push_all([_chunk(store, "a", 0, 3, [4]), _chunk(store, "b", 0, 3, [4]),
                            _chunk(store, "c", 0, 3, [4, 5])])
    assert isinstance(out[1], StoreError) and out[1].kind == "error"
    assert "a chunk the call cannot take" in str(out[1])
    assert [(o.kept, o.committed_end) for o in (out[0], out[2])] == [(1, 3), (2, 3)]
    assert [_draft(store, s)[0] for s in ("a", "b", "c")] == [[4], [], [4, 5]]
    with pytest.raises(StoreError):  # one chunk alone: refused, not raised as the call's error
        batcher.push(_chunk(store, "b", 0, 3, [4]))
