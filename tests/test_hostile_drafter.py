"""A hostile or broken drafter against the real DraftCache service (in-process gRPC on loopback,
the embedded Redis): malformed ids are INVALID_ARGUMENT, bounded drafter-side state in Redis
and in the service, and the inbox event names. Per-device tokens and mutual TLS:
``test_device_credentials``; the agent's side: ``test_agent_faults``."""

from __future__ import annotations

import logging
import queue
import time
from types import SimpleNamespace

import grpc
import pytest

from cache_service.redis_conn import RedisHandle
from cache_service.store import RedisSessionStore
from edgespec.config import ConfigError, SamplingParams
from edgespec.protocol.ids import check_device_id, check_session_id
from edgespec.protocol.contract import Branch, DraftWant, Verdict
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc

# the in-process cache: its fixtures (used by name) and helpers
from cache_harness import (  # noqa: F401
    SAMPLED, VOCAB, Cache, Stream, cache, code_of, draft_len, eventually, redis_handle, store)


# -- 1. an old drafter's q' (a removed field) is skipped, not refused -----------------------------
def test_a_chunk_with_the_removed_q_field_is_stored_without_it(cache, store):
    store.create("s1", [1, 2, 3], SAMPLED, "dev1")
    chunk = pb.DraftChunk(session_id="s1", epoch=0, start=3, tokens=[5])
    old_q = bytes([0x0A, 0x01, 0x05, 0x12, 0x04]) + b"\x00\x00\x80\x3f"  # SparseQ{[5], [1.0]}
    old = pb.DraftChunk.FromString(chunk.SerializeToString() + bytes([(5 << 3) | 2, len(old_q)])
                                   + old_q)
    assert cache.push(old, device="dev1").kept == 1
    assert draft_len(store, "s1") == 1
    assert store.redis.keys("*:q") == []


# -- 2. ids are checked before they reach a Redis key ---------------------------------------------
def test_id_formats():
    for good in ("board-1", "a", "jetson.orin_2", "A" * 64):
        assert check_device_id(good) == good
    for bad in ("", "-x", ".x", "dev:1", "dev 1", "dev/1", "x" * 65, "dev\n", None, 7):
        with pytest.raises(ConfigError):
            check_device_id(bad)
    for good in ("0123456789abcdef", "f" * 32, "s1", "a_b-C"):
        assert check_session_id(good) == good
    for bad in ("", "abc:tok", "a.b", "x" * 65, "a b", b"abc"):
        with pytest.raises(ConfigError):
            check_session_id(bad)
    with pytest.raises(ConfigError) as e:
        check_session_id("q" * 65536)
    assert len(str(e.value)) < 200 and "q" * 41 not in str(e.value)


def test_malformed_ids_are_invalid_argument(cache, store):
    store.create("s1", [1, 2, 3], SamplingParams(), "dev1")
    chunk = pb.DraftChunk(session_id="s1", epoch=0, start=3, tokens=[5])
    # another key type of the same session (WRONGTYPE inside Redis before ids were checked)
    bad_sid = pb.DraftChunk(session_id="s1:tok", epoch=0, start=3, tokens=[5])
    assert code_of(lambda: cache.push(bad_sid, device="dev1")) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: cache.push(chunk, device="dev1:inbox")) == \
        grpc.StatusCode.INVALID_ARGUMENT
    huge = pb.DraftChunk(session_id="a" * 65536, epoch=0, start=3, tokens=[5])
    with pytest.raises(grpc.RpcError) as e:
        cache.push(huge, device="dev1")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(e.value.details()) < 200
    for device in ("dev:1", "x" * 100):
        s = Stream(cache.channel, device)
        with pytest.raises(grpc.RpcError) as e:
            s.next("registered")
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        s.close()
    assert cache.push(chunk, device="dev1").kept == 1


def test_a_malformed_chunk_on_the_stream_is_refused_and_the_stream_goes_on(cache, store):
    store.create("s1", [1, 2, 3], SamplingParams(), "dev1")
    s = Stream(cache.channel, "dev1")
    s.next("registered")
    s.send(pb.DraftChunk(session_id="s1:tok", epoch=0, start=3, tokens=[5]))
    ack = s.next("ack")
    assert ack.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    s.send(pb.DraftChunk(session_id="s1", epoch=0, start=3, tokens=[5, 6]))
    ack = s.next("ack")
    assert ack.code == grpc.StatusCode.OK.value[0] and ack.kept == 2
    s.close()


@pytest.mark.parametrize("tokens,parents,version,needle", [
    ([5, 6, 7], [-1, 0, 1], 2, "tree_version 2"),  # a layout this cache does not know
    ([5, 6], [-1, 0], 0, "no tree_parents"),  # a chain chunk with parents
    ([5, 6, 7], [-1, 0], 1, "one parent per token"),
    ([5, 6, 7], [-1, 0, 5], 1, "tree_parents[2]"),  # a parent after the node
    ([5, 6, 7, 8, 9], [-1, 0, 1, -1, 2], 1, "tree_parents[4]"),  # from the chain's last node
    ([5, 6, 7, 8, 9], [-1, 0, -1, 0, 2], 1, "tree_parents[4]"),  # continues another branch
    ([5, 6, 1 << 20], [-1, 0, -1], 1, "token ids"),  # a branch token outside the vocabulary
    ([5] + [7] * 70, [-1] + [-1] * 70, 1, "at most"),  # too many branch nodes
])
def test_a_malformed_tree_chunk_is_refused_and_stores_nothing(cache, store, tokens, parents,
                                                              version, needle):
    store.create("s1", [1, 2, 3], SamplingParams(), "dev1")
    tree = pb.DraftChunk(session_id="s1", epoch=0, start=3, tokens=tokens,
                         tree_parents=parents, tree_version=version)
    with pytest.raises(grpc.RpcError) as e:
        cache.push(tree, device="dev1")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details()
    assert draft_len(store, "s1") == 0 and store.redis.llen(store.keys.session("s1")[3]) == 0
    chain = pb.DraftChunk(session_id="s1", epoch=0, start=3, tokens=[5, 6], tree_version=0)
    assert cache.push(chain, device="dev1").kept == 2


@pytest.mark.parametrize("start", [-1, 1 << 31, 1 << 40])
@pytest.mark.parametrize("version", [0, 1])
def test_a_chunk_whose_start_is_no_position_is_refused(cache, store, start, version):
    """A start outside 0..2^31 (a tree's branch positions are stored as 32-bit numbers) is the
    chunk's INVALID_ARGUMENT, not an error of the cache; the stream's next chunk is stored."""
    store.create("s1", [1, 2, 3], SamplingParams(), "dev1")
    s = Stream(cache.channel, "dev1")
    s.next("registered")
    s.send(pb.DraftChunk(session_id="s1", epoch=0, start=start, tokens=[5, 6, 7],
                         tree_parents=[-1, 0, -1] if version else [], tree_version=version))
    ack = s.next("ack")
    assert ack.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "start" in ack.message
    s.send(pb.DraftChunk(session_id="s1", epoch=0, start=3, tokens=[5, 6]))
    ack = s.next("ack")
    assert ack.code == grpc.StatusCode.OK.value[0] and ack.kept == 2
    s.close()


@pytest.mark.parametrize("start,tokens,parents,version", [
    ((1 << 31) - 1, [5, 6, 7], [-1, 0, 0], 1),  # a branch at 2^31: past a 32-bit position
    ((1 << 31) - 2, [5, 6, 7], [], 0),  # a chain running past 2^31 - 1
])
def test_a_chunk_running_past_position_2_31_is_refused_and_no_other_board_pays(
        cache, store, start, tokens, parents, version):
    """A chunk whose start is a position but whose chain runs past 2^31 - 1 (its branches'
    positions are stored as 32-bit numbers) is refused in its ack; its stream and another
    board's, pushing at the same time, go on. Such a chunk once failed the whole batch of
    chunks it was stored with, ending every stream that had a chunk in it."""
    store.create("s1", [1, 2, 3], SamplingParams(), "dev1")
    store.create("s2", [1, 2, 3], SamplingParams(), "dev2")
    bad, good = Stream(cache.channel, "dev1"), Stream(cache.channel, "dev2")
    bad.next("registered")
    good.next("registered")
    for i in range(3):
        bad.send(pb.DraftChunk(session_id="s1", epoch=0, start=start, tokens=tokens,
                               tree_parents=parents, tree_version=version))
        good.send(pb.DraftChunk(session_id="s2", epoch=0, start=3 + i, tokens=[5]))
        ack = bad.next("ack")
        assert ack.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "2^31" in ack.message
        ack = good.next("ack")
        assert (ack.code, ack.kept) == (grpc.StatusCode.OK.value[0], 1)
    bad.send(pb.DraftChunk(session_id="s1", epoch=0, start=3, tokens=[5, 6]))
    ack = bad.next("ack")
    assert ack.code == grpc.StatusCode.OK.value[0] and ack.kept == 2
    assert draft_len(store, "s2") == 3
    for s in (bad, good):
        s.close()


def test_the_acks_of_a_draftchunks_come_in_the_chunks_order(cache, store):
    """A ``DraftChunks``' chunks are answered as if each was sent alone, in order: a refusal
    among them is answered where its chunk stood, not before the stored ones."""
    store.create("s1", [1, 2, 3], SamplingParams(), "dev1")
    store.create("s3", [1, 2, 3], SamplingParams(), "dev1")
    s = Stream(cache.channel, "dev1")
    s.next("registered")
    s.out.put(pb.DrafterMessage(chunks=pb.DraftChunks(chunks=[
        pb.DraftChunk(session_id="s1", epoch=0, start=3, tokens=[5]),
        pb.DraftChunk(session_id="bad:id", epoch=0, start=3, tokens=[5]),
        pb.DraftChunk(session_id="s3", epoch=0, start=3, tokens=[5, 6]),
        pb.DraftChunk(session_id="s1", epoch=9, start=4, tokens=[5]),  # stale: the store's
    ])))
    acks = [s.next("ack") for _ in range(4)]
    ok, bad = grpc.StatusCode.OK.value[0], grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert [(a.start, a.code) for a in acks] == [
        (3, ok), (3, bad), (3, ok), (4, grpc.StatusCode.FAILED_PRECONDITION.value[0])]
    assert [a.session_id for a in acks] == ["s1", "bad:id", "s3", "s1"]
    s.close()


@pytest.mark.parametrize("field", ["draft_model", "tokenizer_fingerprint"])
def test_a_registration_with_unprintable_names_is_refused(cache, store, field):
    """A line break or a terminal code in a registration's names (both shown in the cache's log
    and ``edgespec status``) is INVALID_ARGUMENT; printable names, any script, attach."""
    def attach(value: str):
        out: queue.Queue = queue.Queue()
        out.put(pb.DrafterMessage(register=pb.Register(device_id="dev1", **{field: value})))
        call = pb_grpc.DraftCacheStub(cache.channel).Attach(iter(out.get, None))
        try:
            return next(call).WhichOneof("kind")
        finally:
            out.put(None)
            call.cancel()

    for value in ("mag\nhealth: NOT_SERVING", "mag\x1b[31m", "a\x00b"):
        with pytest.raises(grpc.RpcError) as e:
            attach(value)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "printable" in \
            e.value.details()
    if field == "draft_model":
        assert attach("mag-ÄÖ 語 (v2)") == "registered"
    else:  # printable: checked further, against the target's tokenizer
        with pytest.raises(grpc.RpcError) as e:
            attach("fp-ÄÖ 語 (v2)")
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "differs" in \
            e.value.details()


def test_a_tree_chunk_stores_its_chain_and_branches(cache, store):
    store.create("s1", [1, 2, 3], SamplingParams(), "dev1")
    # chain 5 6 7; a branch 8 9 instead of 6; a branch 4 instead of 5
    tree = pb.DraftChunk(session_id="s1", epoch=0, start=3, tokens=[5, 6, 7, 8, 9, 4],
                         tree_parents=[-1, 0, 1, 0, 3, -1], tree_version=1)
    assert cache.push(tree, device="dev1").kept == 3  # the chain's tokens
    assert draft_len(store, "s1") == 3
    (taken,) = store.take_when_ready([DraftWant("s1", 3, 8)], 0)
    assert taken.tokens == [5, 6, 7]
    assert taken.branches == [Branch(1, (8, 9)), Branch(0, (4,))]


# -- 5. bounded drafter-side state ----------------------------------------------------------------
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


# -- 6. inbox event names -------------------------------------------------------------------------
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
