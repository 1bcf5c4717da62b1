"""Several messages in one on an Attach stream: a board's chunks drafted together as one
DraftChunks (each checked, stored and answered as if sent alone), and what the cache had queued
for a board as one CacheBatch, sent only to a board that says it reads them. Over a real gRPC
stream to the in-process cache (``cache_harness``), and the two sides' gathering alone."""

from __future__ import annotations

import queue
import threading

import grpc

from cache_service import chunk_intake
from cache_service.drafter_outbox import DrafterOutbox, with_queued
from cache_service.refusal_pace import RefusalPace, RefusalPaces
from drafter_node.agent import outgoing_messages
from edgespec.config import SamplingParams
from edgespec.v1 import edgespec_pb2 as pb

from cache_harness import (  # noqa: F401
    VOCAB, Stream, cache, draft_len, redis_handle, store)

OK = grpc.StatusCode.OK.value[0]


def _chunks(*chunks: pb.DraftChunk) -> pb.DrafterMessage:
    return pb.DrafterMessage(chunks=pb.DraftChunks(chunks=chunks))


def test_a_boards_draftchunks_are_stored_and_answered_each_as_if_alone(cache, store):
    for sid in ("s1", "s2", "s3"):
        store.create(sid, [1, 2, 3], SamplingParams(), "dev1")
    s = Stream(cache.channel, "dev1", batches=True)
    assert s.next("registered").batches  # this cache reads DraftChunks
    s.out.put(_chunks(
        pb.DraftChunk(session_id="s1", epoch=0, start=3, tokens=[5, 6], quiet=True),
        pb.DraftChunk(session_id="s1", epoch=0, start=5, tokens=[7], quiet=True),  # follows
        pb.DraftChunk(session_id="s2", epoch=4, start=3, tokens=[5], quiet=True),  # stale
        pb.DraftChunk(session_id="s3", epoch=0, start=3, tokens=[VOCAB], quiet=True),  # bad id
        pb.DraftChunk(session_id="s3", epoch=0, start=3, tokens=[8, 9])))  # asks for its ack
    acks = [s.next("ack") for _ in range(3)]
    by = {(a.session_id, a.code) for a in acks}
    assert by == {("s2", grpc.StatusCode.FAILED_PRECONDITION.value[0]),
                  ("s3", grpc.StatusCode.INVALID_ARGUMENT.value[0]), ("s3", OK)}
    assert [a.kept for a in acks if a.code == OK] == [2]
    assert [draft_len(store, sid) for sid in ("s1", "s2", "s3")] == [3, 0, 2]
    s.close()


def test_chunks_beyond_what_a_message_holds_are_refused_unread_with_one_ack(cache, store,
                                                                           monkeypatch):
    """Found by a hostile board's probe: two million empty chunks fit in one 4 MiB message,
    and an ack for each cost 14 s of the server's CPU and a gigabyte. The ones past
    ``MAX_BATCH_CHUNKS`` get one ack between them, and count against the board's pace."""
    monkeypatch.setattr(chunk_intake, "MAX_BATCH_CHUNKS", 2)
    intake = cache.service.intake
    intake.paces = RefusalPaces(lambda: RefusalPace(rate=0.01, burst=3.0, max_wait_s=0.5))
    for sid in ("s1", "s2", "s3"):
        store.create(sid, [1, 2, 3], SamplingParams(), "dev1")
    s = Stream(cache.channel, "dev1", batches=True)
    s.next("registered")
    s.out.put(_chunks(*(pb.DraftChunk(session_id=sid, epoch=0, start=3, tokens=[5])
                        for sid in ("s1", "s2", "s3", "s4", "s5", "s6"))))
    s.send(pb.DraftChunk(session_id="s3", epoch=0, start=3, tokens=[7]))  # the next message
    acks = [s.next("ack") for _ in range(4)]
    assert [(a.session_id, a.code) for a in acks] == [
        ("s1", OK), ("s2", OK), ("s3", grpc.StatusCode.INVALID_ARGUMENT.value[0]), ("s3", OK)]
    assert "the 4 past them are refused unread" in acks[2].message
    assert [draft_len(store, sid) for sid in ("s1", "s2", "s3")] == [1, 1, 1]
    assert intake.paces.of("dev1").held == 1  # four refused past a burst of three
    s.close()


def test_an_older_board_is_sent_every_message_alone_and_a_newer_the_same_in_order(cache, store):
    old = Stream(cache.channel, "old")  # its reader fails the test on any batch
    new = Stream(cache.channel, "new", batches=True)
    old.next("registered"), new.next("registered")
    for i in range(12):
        for device in ("old", "new"):
            store.create(f"{device}{i}", [1, 2, 3, i], SamplingParams(), device)
    for device, s in (("old", old), ("new", new)):
        got = [s.next("assignment") for _ in range(12)]
        assert [a.session_id for a in got] == [f"{device}{i}" for i in range(12)]
        assert [list(a.tokens) for a in got] == [[1, 2, 3, i] for i in range(12)]
    old.close(), new.close()


def _outbox(*msgs) -> DrafterOutbox:
    out = DrafterOutbox("dev", threading.Event(), lambda: None)
    for m in msgs:
        out.put(m)
    return out


def test_what_is_queued_for_a_board_goes_with_the_message_in_one_batch():
    closed = [pb.CacheMessage(closed=pb.SessionClosed(session_id=f"s{i}")) for i in range(4)]
    msg, ended = with_queued(closed[0], _outbox())
    assert msg is closed[0] and not ended  # nothing queued: the message alone
    msg, ended = with_queued(closed[0], _outbox(*closed[1:3]))
    assert [m.closed.session_id for m in msg.batch.messages] == ["s0", "s1", "s2"] and not ended
    out = _outbox(closed[1], None, closed[3])
    msg, ended = with_queued(closed[0], out)
    assert [m.closed.session_id for m in msg.batch.messages] == ["s0", "s1"] and ended
    assert with_queued(closed[2], _outbox(None)) == (closed[2], True)


def test_a_board_sends_the_chunks_queued_together_in_one_message_and_the_rest_alone():
    chunk = [pb.DrafterMessage(chunk=pb.DraftChunk(session_id=f"s{i}", start=i))
             for i in range(4)]
    beat = pb.DrafterMessage(heartbeat=pb.Heartbeat(sent_unix_ms=1))
    queued = [chunk[0], chunk[1], beat, chunk[2], beat, chunk[3], None]

    def sent(batches: bool) -> list:
        out: queue.Queue = queue.Queue()
        for m in queued:
            out.put(m)
        shown = []
        for m in outgoing_messages(out, lambda: batches):
            kind = m.WhichOneof("kind")
            shown.append([c.session_id for c in m.chunks.chunks] if kind == "chunks"
                         else m.chunk.session_id if kind == "chunk" else kind)
        return shown

    assert sent(True) == [["s0", "s1"], "heartbeat", "s2", "heartbeat", "s3"]
    assert sent(False) == ["s0", "s1", "heartbeat", "s2", "heartbeat", "s3"]


def test_a_batch_inside_a_batch_breaks_the_link():
    from types import SimpleNamespace

    import pytest

    from drafter_node.agent import DrafterAgent
    from edgespec.drafters import build_drafter

    agent = DrafterAgent("127.0.0.1:1", "dev", build_drafter("mag"), fingerprint="")
    inner = pb.CacheMessage(batch=pb.CacheBatch())
    with pytest.raises(ConnectionError, match="batch inside a batch"):
        agent._apply_batch(pb.CacheBatch(messages=[inner]), SimpleNamespace(heard=lambda m: None))
