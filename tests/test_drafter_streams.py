"""A drafter's registration, Attach stream and inbox against the real DraftCache service
(in-process gRPC on loopback, the embedded Redis): drafter-side state stays bounded (live
sessions counted, registrations capped and forgotten, a stream's outbox and a reader that never
reads detached), the inbox's events reach the drafter, and a slow or gone drafter delays no
other. Malformed chunks and ids: ``test_hostile_drafter``."""

from __future__ import annotations

import logging
import queue
import time
from types import SimpleNamespace

import grpc
import pytest

from cache_service.redis_conn import RedisHandle
from cache_service.store import RedisSessionStore
from edgespec.config import SamplingParams
from edgespec.protocol.contract import Verdict
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc

# the in-process cache: its fixtures (used by name) and helpers
from cache_harness import (  # noqa: F401
    SAMPLED, VOCAB, Cache, Stream, cache, code_of, draft_len, eventually, redis_handle, store)


# -- 1. bounded drafter-side state ----------------------------------------------------------------
def test_pick_counts_only_live_sessions_and_drops_the_rest(store):
    store.devices.register("d1", {"max_sessions": 1})
    store.create("gone", [1], SamplingParams(), "d1")
    # a crashed verifier never closed it; its keys expired
    store.redis.delete(*store.keys.session("gone"))
    store.create("done", [1], SamplingParams(), "d1")
    store.redis.hset(store.keys.session("done")[0], "done", 1)
    assert store.devices.pick() == "d1"
    store.devices.release("d1")
    assert store.redis.smembers(store.keys.sessions("d1")) == set()
    store.create("live", [1], SamplingParams(), "d1")
    assert store.devices.pick() is None  # full: one live session, limit 1
    assert store.devices.sessions_of("d1") == ["live"]
    store.devices.mark_alive("d1")
    assert 0 < store.redis.ttl(store.keys.sessions("d1")) <= store.ttl_s


def test_registrations_beyond_the_cap_forget_the_longest_detached_first(store, monkeypatch):
    """Drafters attaching under ever new ids cannot grow the registrations every admission
    reads: past ``MAX_REGISTRATIONS`` the detached drafters unseen longest are forgotten (with
    their session sets and inboxes); attached ones never are."""
    from cache_service import devices

    monkeypatch.setattr(devices, "MAX_REGISTRATIONS", 3)
    regs = lambda: {d.decode() for d in store.redis.hkeys(store.keys.devices)}  # noqa: E731
    for dev in ("a", "b", "c"):
        store.devices.register(dev, {"max_sessions": 4})
    store.create("s-b", [1], SamplingParams(), "b")
    for dev in ("b", "c"):
        store.devices.mark_gone(dev)
    now = time.time()  # a: attached, seen longest ago; none unseen for max_idle_s
    store.redis.zadd(store.keys.seen, {"a": now - 30, "b": now - 20, "c": now - 10})
    store.devices.register("d", {"max_sessions": 4})
    assert regs() == {"a", "c", "d"}
    assert not store.redis.exists(store.keys.sessions("b"), store.keys.inbox("b"))
    store.devices.register("e", {"max_sessions": 4})
    assert regs() == {"a", "d", "e"}
    store.devices.register("f", {"max_sessions": 4})  # all four attached: none forgotten
    assert regs() == {"a", "d", "e", "f"}


def _cancelled_by_the_cache(call, out: queue.Queue, channel) -> None:
    """A silent drafter's stream ends CANCELLED (the cache detached it); its sender and
    channel are closed."""
    with pytest.raises(grpc.RpcError) as e:
        for _ in call:
            pass
    assert e.value.code() == grpc.StatusCode.CANCELLED
    out.put(None)
    channel.close()


def test_a_full_outbox_cancels_the_stream_before_it_ends_the_handler(monkeypatch):
    """The stream is cancelled before ``stop`` is set: ``stop`` ends the handler, and a handler
    that returned before the cancel would end the stream OK (a CI failure's cause)."""
    import threading

    from cache_service import drafter_outbox

    monkeypatch.setattr(drafter_outbox, "MAX_PENDING", 4)
    stop = threading.Event()
    stopped_at_cancel: list[bool] = []
    out = drafter_outbox.DrafterOutbox("dev", stop, lambda: stopped_at_cancel.append(stop.is_set()))
    out.stuck_s = 0.0
    for i in range(4):
        assert out.offer(i)
    assert not out.offer("more")  # full
    assert out.put("more") is False
    assert stopped_at_cancel == [False] and stop.is_set()


def test_a_drafter_that_never_reads_its_stream_is_detached(cache, store, monkeypatch, caplog):
    """A drafter that sends chunks and reads none of the acknowledgements fills its bounded
    outbox (``drafter_outbox``), the cache stops reading its chunks, and once the outbox has
    been full for ``STUCK_S`` the stream is cancelled; another drafter is served throughout."""
    from cache_service import drafter_outbox

    monkeypatch.setattr(drafter_outbox, "MAX_PENDING", 4)
    monkeypatch.setattr(drafter_outbox, "STUCK_S", 0.5)
    store.create("s1", [1, 2, 3], SamplingParams(), "dev2")
    out: queue.Queue = queue.Queue()
    out.put(pb.DrafterMessage(register=pb.Register(device_id="dev1", draft_model="test")))
    sid = "x" * 64  # unknown: each chunk's refusal quotes it, so acks fill gRPC's window soon
    for _ in range(20_000):
        out.put(pb.DrafterMessage(chunk=pb.DraftChunk(session_id=sid, epoch=0, start=3,
                                                      tokens=[5])))
    channel = grpc.insecure_channel(cache.address, options=[("grpc.http2.bdp_probe", 0)])
    call = pb_grpc.DraftCacheStub(channel).Attach(iter(out.get, None))  # never read until below
    with caplog.at_level(logging.WARNING, logger="edgespec.cache"):
        eventually(lambda: "read nothing of its stream" in caplog.text, "the drafter detached")
    other = Stream(cache.channel, "dev2")
    other.next("registered")
    other.send(pb.DraftChunk(session_id="s1", epoch=0, start=3, tokens=[5, 6]))
    assert other.next("ack").kept == 2
    other.close()
    _cancelled_by_the_cache(call, out, channel)


def test_registrations_not_seen_for_long_are_forgotten(store):
    for dev in ("old", "fresh", "alive-old"):
        store.devices.register(dev, {"max_sessions": 4})
    store.create("s-old", [1], SamplingParams(), "old")
    store.devices.mark_gone("old")
    store.redis.zadd(store.keys.seen, {"old": 0, "alive-old": 0})  # last seen in 1970
    assert store.devices.pick() in ("fresh", "alive-old")
    regs = {d.decode() for d in store.redis.hkeys(store.keys.devices)}
    assert regs == {"fresh", "alive-old"}  # an alive device stays, whatever its mark says
    assert not store.redis.exists(store.keys.sessions("old"), store.keys.inbox("old"))


def test_a_device_generation_is_dropped_when_its_stream_ends(cache, store):
    s = Stream(cache.channel, "dev1")
    s.next("registered")
    assert "dev1" in cache.service._generation and store.devices.is_alive("dev1")
    s.close()
    # the service forgets the generation, then marks the device gone: both, soon
    eventually(lambda: "dev1" not in cache.service._generation
               and not store.devices.is_alive("dev1"), "the generation dropped, the device gone")


def test_a_silent_drafter_is_detached_with_an_error_and_listed_as_last_seen_when_heard(cache,
                                                                                        store):
    """A board that announces a heartbeat of 0.3 s and sends nothing after its registration is
    detached after three of them (at least 1 s): its stream ends UNAVAILABLE saying why (a
    clean end read as the cache closing it), and the listing's last-seen time is counted from
    when it was last heard, not from when the cache gave up on it."""
    s = Stream(cache.channel, "mute", heartbeat_ms=300)
    s.next("registered")
    with pytest.raises(grpc.RpcError) as ended:
        s.next("a message after the detach")
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "heard nothing from drafter 'mute'" in ended.value.details()
    assert "heartbeat every 0.3 s" in ended.value.details()
    eventually(lambda: not store.devices.is_alive("mute"), "the silent board marked gone")
    listed = {d.device_id: d for d in store.devices.listing()}["mute"]
    assert not listed.attached
    assert listed.last_seen_s >= 0.9  # silent for at least the 1 s the cache waited
    s.close()


# -- 2. inbox event names -------------------------------------------------------------------------
def test_inbox_events_assign_commit_close_reach_the_drafter(cache, store):
    s = Stream(cache.channel, "dev1")
    s.next("registered")
    store.create("s1", [1, 2, 3], SamplingParams(), "dev1")
    a = s.next("assignment")
    assert (a.session_id, list(a.tokens), a.epoch) == ("s1", [1, 2, 3], 0)
    assert not a.HasField("output_end")  # no max_new_tokens said: the board keeps its window
    store.create("s2", [1, 2, 3], SamplingParams(), "dev1", max_new_tokens=5)
    a = s.next("assignment")
    assert (a.session_id, a.output_end) == ("s2", 8)  # no draft token at 7 or beyond is used
    inbox = store.keys.inbox("dev1")
    store.redis.xadd(inbox, {"t": "commit", "sid": "s1", "epoch": 1, "end": 4, "fix": 1, "tok": 9})
    c = s.next("commit")
    assert (c.session_id, c.epoch, c.committed_end, c.is_fix, c.fix_position, c.fix_token) == \
        ("s1", 1, 4, True, 3, 9)
    store.redis.xadd(inbox, {"t": "close", "sid": "s1"})
    assert s.next("closed").session_id == "s1"
    s.close()


def test_an_attach_whose_client_left_while_it_waited_takes_no_device_over(cache, store):
    """An attach that waited (on Redis, say) while its client went away, a proxy's reset
    attempt, must not take the id from the live stream that replaced it: it ends at once,
    and the live stream keeps its generation and is not ended."""
    live = Stream(cache.channel, "dev1")
    live.next("registered")
    gen = cache.service._generation["dev1"]
    gone = SimpleNamespace(is_active=lambda: False, peer=lambda: "ipv4:10.0.0.9:1",
                           abort=None, add_callback=None)  # used past the check: would raise
    register = pb.DrafterMessage(register=pb.Register(device_id="dev1", draft_model="test",
                                                      max_sessions=4))
    assert list(cache.service.Attach(iter([register]), gone)) == []
    assert cache.service._generation["dev1"] == gen
    store.create("s1", [1, 2, 3], SamplingParams(), "dev1")
    assert live.next("assignment").session_id == "s1"  # the live stream goes on
    live.close()


def test_a_chunk_pushed_while_the_caches_redis_is_down_is_unavailable_with_a_hint():
    """The cache is up but its Redis is not: PushDraft says UNAVAILABLE with the retry hint (as
    Attach does), not UNKNOWN with a traceback in the cache's log."""
    from edgespec.wire.convert import RETRY_AFTER_MD

    handle = RedisHandle()
    st = RedisSessionStore(handle.client, prefix="h:", ttl_s=60)
    st.set_target({"model": "tiny", "fingerprint": "fp", "vocab_size": VOCAB, "window": 8,
                   "chunk": 4})
    st.create("s1", [1, 2, 3], SamplingParams(), "dev")
    c = Cache(st)
    try:
        handle.proc.kill()  # and never restarted: nobody runs the handle's monitor here
        handle.proc.wait()
        with pytest.raises(grpc.RpcError) as e:
            c.push(pb.DraftChunk(session_id="s1", epoch=0, start=3, tokens=[4]), device="dev")
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "Redis" in e.value.details()
        assert dict(e.value.trailing_metadata()).get(RETRY_AFTER_MD)
    finally:
        c.stop()
        st.shutdown()
        handle.close()


def test_a_quiet_chunk_is_answered_only_when_refused(cache, store):
    """``DraftChunk.quiet``: a stored chunk gets no ack (one message a chunk less on the
    verifier's host), a refused one still does; a chunk that does not ask is answered as
    always (an older drafter's). The stream answers in order, so the first ack read after a
    quiet chunk was stored is the next chunk's."""
    store.create("s1", [1, 2, 3], SamplingParams(), "dev1")
    s = Stream(cache.channel, "dev1")
    s.next("registered")
    s.send(pb.DraftChunk(session_id="s1", epoch=0, start=3, tokens=[5, 6], quiet=True))
    s.send(pb.DraftChunk(session_id="s1", epoch=7, start=5, tokens=[7], quiet=True))  # stale
    ack = s.next("ack")
    assert (ack.start, ack.code) == (5, grpc.StatusCode.FAILED_PRECONDITION.value[0])
    s.send(pb.DraftChunk(session_id="s1", epoch=0, start=5, tokens=[7]))
    ack = s.next("ack")
    assert (ack.start, ack.code, ack.kept) == (5, grpc.StatusCode.OK.value[0], 1)
    assert draft_len(store, "s1") == 3
    s.close()


def test_a_drafter_that_never_reads_its_events_delays_no_other_drafters(cache, store, monkeypatch,
                                                                         caplog):
    """Every attached drafter's inbox is read by one thread (``inbox_reader``): a drafter that
    reads nothing of its stream while its sessions' commits pile up holds back its own events
    only (its full outbox is not read for), another drafter's commit reaches it meanwhile, and
    once its outbox has been full for ``STUCK_S`` its stream is cancelled."""
    from cache_service import drafter_outbox

    monkeypatch.setattr(drafter_outbox, "MAX_PENDING", 4)
    monkeypatch.setattr(drafter_outbox, "STUCK_S", 0.5)
    store.create("s1", [1, 2, 3], SamplingParams(), "dev1")
    store.create("s2", [1, 2, 3], SamplingParams(), "dev2")
    out: queue.Queue = queue.Queue()
    out.put(pb.DrafterMessage(register=pb.Register(device_id="dev1", draft_model="test")))
    channel = grpc.insecure_channel(cache.address, options=[("grpc.http2.bdp_probe", 0)])
    call = pb_grpc.DraftCacheStub(channel).Attach(iter(out.get, None))  # never read until below
    other = Stream(cache.channel, "dev2")
    other.next("registered")
    eventually(lambda: store.devices.sessions_of("dev1") and
               store.redis.exists(store.keys.alive("dev1")), "dev1 attached")
    with caplog.at_level(logging.WARNING, logger="edgespec.cache"):
        end = 3
        for i in range(10_000):  # several times what gRPC's window holds of them
            [res] = store.commit_many([Verdict("s1", i, end, 0, 5)])
            assert res.error is None
            end += 1
        [res] = store.commit_many([Verdict("s2", 0, 3, 0, 9)])
        fix = other.next("commit")
        assert (fix.session_id, fix.is_fix, fix.fix_token) == ("s2", True, 9)
        eventually(lambda: "read nothing of its stream" in caplog.text, "the drafter detached")
    other.close()
    _cancelled_by_the_cache(call, out, channel)


def test_the_inbox_reader_runs_while_a_drafter_is_attached(cache, store):
    """The one thread reading the drafters' inboxes starts with the first stream and ends with
    the last (a cache with no drafter attached spends nothing polling), and starts again with
    the next."""
    reader = cache.service._inboxes
    for _ in range(2):
        s = Stream(cache.channel, "dev1")
        s.next("registered")
        assert reader._thread is not None and reader._thread.is_alive()
        s.close()
        eventually(lambda: reader._thread is None, "the reader ended with the last stream")


def test_stopping_the_cache_ends_every_stream_and_marks_its_drafter_gone_first(store):
    """``stop`` returns once every Attach handler has finished, each drafter marked gone on the
    Redis still open (a handler left running past the Redis's close held serve's exit for as
    long as its retries), and each drafter is told UNAVAILABLE, so that it attaches again."""
    c = Cache(store)
    try:
        streams = [Stream(c.channel, f"dev{i}") for i in range(3)]
        for s in streams:
            s.next("registered")
        assert all(store.devices.is_alive(f"dev{i}") for i in range(3))
        c.service.stop()
        assert not c.service._streams
        assert not any(store.devices.is_alive(f"dev{i}") for i in range(3))
        for s in streams:
            with pytest.raises(grpc.RpcError) as e:
                while True:  # what was sent before the stop (heartbeats), then the error
                    s.next("assign")
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in e.value.details()
        late = Stream(c.channel, "late")  # attaching after stop: refused, nothing registered
        with pytest.raises(grpc.RpcError) as e:
            late.next("registered")
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "late" not in {d.device_id for d in store.devices.listing()}
    finally:
        c.stop()
