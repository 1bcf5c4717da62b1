"""A hostile or broken drafter against the real DraftCache service (in-process gRPC on loopback,
the embedded Redis): malformed ids, chunks and trees are INVALID_ARGUMENT and store nothing, and
no other board pays. Bounded drafter-side state and the inbox: ``test_drafter_streams``;
per-device tokens and mutual TLS: ``test_device_credentials``; the agent's side:
``test_agent_faults``."""

from __future__ import annotations

import logging
import queue

import grpc
import pytest

from edgespec.config import ConfigError, SamplingParams
from edgespec.protocol.ids import check_device_id, check_session_id
from edgespec.protocol.contract import Branch, DraftWant
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc

# the in-process cache: its fixtures (used by name) and helpers
from cache_harness import (  # noqa: F401
    SAMPLED, VOCAB, WAIT_S, Cache, Stream, cache, code_of, draft_len, eventually, redis_handle,
    store)


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


def test_a_stream_that_never_registers_is_closed_and_frees_its_slot(cache, store, caplog):
    """An Attach stream that sends nothing would hold an attach slot (``--max-drafters``)
    forever, whatever token it holds: it gets ``RegisterWait.wait_s`` to register."""
    cache.service.registering.wait_s = 0.5
    caplog.set_level(logging.WARNING, logger="edgespec.cache")
    silent: queue.Queue = queue.Queue()
    call = pb_grpc.DraftCacheStub(cache.channel).Attach(iter(silent.get, None), timeout=WAIT_S)
    with pytest.raises(grpc.RpcError) as e:
        next(call)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    said = [r.getMessage() for r in caplog.records if "sent no Register" in r.getMessage()]
    assert len(said) == 1, said
    silent.put(None)
    honest = Stream(cache.channel, "dev1")  # one that registers at once is served as ever
    assert honest.next("registered").window == 8
    honest.close()
