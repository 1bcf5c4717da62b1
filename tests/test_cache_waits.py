"""The Redis-backed store's wait for drafts (``take_when_ready``), against real Redis servers: a
live drafter's sessions are waited for, a gone one's not; a pushed chunk ends the wait; a
wake-up names its session and reads again only that one; the chunk waker says which sessions
woke since when, or that it cannot."""

from redis_store import attach, store  # noqa: F401

from edgespec.config import SamplingParams
from edgespec.protocol.contract import DraftWant


class _NoWait:
    seq = 0

    def wait(self, seen, timeout):
        raise AssertionError("waited for a drafter that is gone")


def test_take_waits_for_a_live_drafter_but_not_for_a_dead_one(store):
    import time

    dev = attach(store)
    store.create("s5", [1], SamplingParams(), dev)
    t0 = time.monotonic()
    [taken] = store.take_when_ready([DraftWant("s5", 4)], 0.2)
    assert time.monotonic() - t0 >= 0.15  # a live drafter with no draft yet: waited
    assert taken.tokens == []
    store.devices.mark_gone(dev)
    real, store._chunk_waker = store._chunk_waker, _NoWait()  # nobody drafting: no wait
    try:
        [taken] = store.take_when_ready([DraftWant("s5", 4)], 30)
    finally:
        store._chunk_waker = real  # stopped with the store
    assert taken.tokens == []


def test_a_pushed_chunk_ends_the_wait(store):
    import threading

    dev = attach(store)
    store.create("s7", [1], SamplingParams(), dev)
    store.take_when_ready([DraftWant("s7", 4)], 0.0)  # subscribes the waker
    timer = threading.Timer(0.3, store.push, ("s7", 0, 1, [2, 3, 4, 5], False, 8))
    timer.start()
    [taken] = store.take_when_ready([DraftWant("s7", 4)], 120)  # woken by the push
    timer.join()
    assert taken.tokens == [2, 3, 4, 5]


def _live_waker(store):
    """The store's chunk waker once its subscription is live (a message it sent came back)."""
    waker = store._waker
    for _ in range(600):
        seen = waker.seq
        store.redis.publish(store.keys.wake, "1")
        waker.wait(seen, 0.1)
        if waker.seq > seen:
            return waker
    raise AssertionError("the chunk waker never subscribed")


def test_a_wake_up_reads_again_only_the_sessions_it_names_still_waited_for(store):
    """A step waiting for many boards is woken by each pushed chunk, whose message names its
    session: it reads again only that session, if its draft is still awaited (a ready draft's
    earlier read stands: it only grows, by a push, until this verifier commits), and takes
    every session's draft at the end. A chunk of a session the step does not wait for reads
    nothing."""
    dev = attach(store)
    for sid in ("r1", "r2", "late", "other"):
        store.create(sid, [1], SamplingParams(), dev)
    store.push("r1", 0, 1, [2, 3], idle=False, window=8)
    store.push("r2", 0, 1, [4], idle=True, window=8)  # idle: nothing more is coming
    _live_waker(store)
    reads: list[list[str]] = []
    read = store._read

    def reading(wants):
        got = read(wants)
        if wants:
            reads.append([w.session_id for w in wants])
        if len(reads) == 1 and wants:  # the chunks come once the step has read: it waits
            store.push("other", 0, 1, [9], idle=False, window=8)
            store.push("late", 0, 1, [5, 6], idle=False, window=8)
        return got

    store._read = reading
    got = store.take_when_ready([DraftWant("r1", 2), DraftWant("r2", 2),
                                 DraftWant("late", 2)], 120)  # woken by the pushes
    assert [t.tokens for t in got] == [[2, 3], [4], [5, 6]]
    assert reads == [["r1", "r2", "late"], ["late"]]


def test_the_waker_says_which_sessions_woke_and_when_it_cannot(store):
    """Over a real subscription: the keys the messages named since a sequence number; None
    where that is not known (a message naming none, as an older cache's '1', or further back
    than the waker remembers)."""
    from cache_service.chunk_waker import KEPT

    waker = _live_waker(store)
    seen = waker.seq

    def publish(*keys):
        target = waker.seq + len(keys)
        for key in keys:
            store.redis.publish(store.keys.wake, key)
        with waker._cond:
            assert waker._cond.wait_for(lambda: waker.seq >= target, 60)

    publish("t:s:a", "t:s:b")
    assert waker.woken_since(seen) == ({"t:s:a", "t:s:b"}, seen + 2)
    assert waker.woken_since(waker.seq) == (set(), waker.seq)
    publish("1")
    assert waker.woken_since(seen) == (None, waker.seq)
    later = waker.seq
    for _ in range(KEPT + 1):
        waker._bump("t:s:c")  # more than remembered (the bookkeeping alone)
    assert waker.woken_since(later) == (None, waker.seq)
