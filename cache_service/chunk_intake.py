"""A drafter's chunks into the store: an Attach stream's reader (``read_stream``: its chunks,
one or a board's ``DraftChunks``, checked and stored with what other streams push meanwhile, the
``ChunkBatcher``), and ``PushDraft``'s one chunk (``push_one``, a round trip of its own). Every
chunk is counted stored or refused in the cache's metrics; a refusal is answered with an ack
that carries its status code.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import redis

from edgespec.v1 import edgespec_pb2 as pb

from .chunk_batcher import ChunkBatcher
from .chunk_checks import ChunkRefused, check_and_push, checked_chunk, chunk_ack
from .drafter_outbox import DrafterOutbox
from .refusal_pace import RefusalPaces
from .store import RedisSessionStore
from .store_records import ChunkPush, PushResult

if TYPE_CHECKING:  # prometheus_client is needed only where metrics are kept
    from .metrics import CacheMetrics

log = logging.getLogger("edgespec.cache")

MAX_BATCH_CHUNKS = 256  # chunks in one DraftChunks (the ones beyond are refused unread)


@dataclass
class StoredChunks:
    """A message's chunks, stored or refused: the acks to send, and how many count against
    the board's pace (refused, or stored with no news: no token kept, no drafter newly idle)."""

    acks: list[pb.ChunkAck]
    paced: int


class ChunkIntake:
    def __init__(self, store: RedisSessionStore, window: int, per_device: bool,
                 metrics: CacheMetrics | None):
        """``per_device``: the cache knows each drafter by its own token (a chunk for another
        device's session is PERMISSION_DENIED, else FAILED_PRECONDITION)."""
        self.store, self.window, self.per_device, self.metrics = store, window, per_device, metrics
        self.batcher = ChunkBatcher(store)
        # each board's, by device, its streams' and its pushes' together; without device
        # tokens a pushed chunk's device is the caller's word: PushDraft's callers share one
        self.paces = RefusalPaces()

    def refused(self, e: ChunkRefused, n: int = 1) -> None:
        """Count ``n`` refused chunks (stored ones are counted where they are stored)."""
        if self.metrics is not None:
            self.metrics.chunk_refused(e.code, n)

    def push_one(self, device: str, chunk: pb.DraftChunk, vocab: Callable[[], int]
                 ) -> pb.ChunkAck:
        """``PushDraft``'s chunk, stored in a round trip of its own; raises ``ChunkRefused``
        (not counted: the caller counts what it refuses). While pushed chunks are refused, or
        stored with no news, faster than their pace allows (``paces``: the device's with
        device tokens, else every caller's together), each is refused unchecked
        (RESOURCE_EXHAUSTED), before anything is read from Redis. ``vocab``: the target's
        vocabulary size, read once the pace lets the chunk through."""
        key = device if self.per_device else ""
        owed, first = self.paces.after(key, 0)
        self._say_pushes_held(first, key)
        if owed:
            raise ChunkRefused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"pushed chunks are refused faster than "
                               f"{self.paces.of(key).rate:.0f} a second: none is checked for "
                               f"{owed:.1f} s")
        try:
            ack, news = check_and_push(self.store, device, chunk, vocab(), self.window,
                                       self.per_device)
        except ChunkRefused:
            self._say_pushes_held(self.paces.after(key, 1)[1], key)
            raise
        if not news:
            self._say_pushes_held(self.paces.after(key, 1)[1], key)
        if self.metrics is not None:
            self.metrics.chunk_stored(ack.kept)
        return ack

    def _say_pushes_held(self, first: bool, key: str) -> None:
        if first:  # once a board (or, without device tokens, once for every caller)
            log.warning("pushed chunks%s are refused faster than %.0f a second: PushDraft "
                        "refuses them unchecked while that lasts",
                        f" of drafter {key}" if key else "", self.paces.of(key).rate)

    def store_chunks(self, device: str, chunks: Sequence[pb.DraftChunk], vocab: int
                     ) -> StoredChunks:
        """An Attach stream's chunks checked, then stored together with what other streams
        push meanwhile; the acks to send: every refusal, and the stored chunks that are not
        quiet, in the chunks' order (as if each was sent alone). Chunks past
        ``MAX_BATCH_CHUNKS`` are refused unread, with one ack for them all (a message of two
        million empty chunks fits in gRPC's 4 MiB: an ack each would cost seconds and a
        gigabyte)."""
        beyond = len(chunks) - MAX_BATCH_CHUNKS
        acks: list[pb.ChunkAck | None] = []  # each chunk's, in order; None: stored quietly
        checked: list[tuple[int, pb.DraftChunk, ChunkPush]] = []
        for i, chunk in enumerate(chunks[:MAX_BATCH_CHUNKS] if beyond > 0 else chunks):
            try:
                checked.append((i, chunk, checked_chunk(self.store, device, chunk, vocab,
                                                        self.window)))
                acks.append(None)
            except ChunkRefused as e:
                acks.append(self._refusal(chunk, e))
        outcomes = self.batcher.push_all([c for _, _, c in checked]) if checked else []
        idle = 0  # stored with no news: paced as refusals are
        for (i, chunk, c), outcome in zip(checked, outcomes):
            try:
                ack = chunk_ack(chunk, c, outcome, self.per_device)
            except ChunkRefused as e:
                acks[i] = self._refusal(chunk, e)
                continue
            if self.metrics is not None:
                self.metrics.chunk_stored(ack.kept)
            assert isinstance(outcome, PushResult)  # chunk_ack raised for a refusal
            idle += not outcome.news
            if not chunk.quiet:  # stored: the drafter asked for no ack (a refusal has one)
                acks[i] = ack
        out = [a for a in acks if a is not None]
        ok = grpc.StatusCode.OK.value[0]
        paced = idle + sum(a.code != ok for a in out)
        if beyond > 0:
            out.append(self._refusal(chunks[MAX_BATCH_CHUNKS], ChunkRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a DraftChunks holds at most {MAX_BATCH_CHUNKS} chunks: the {beyond} past them "
                "are refused unread"), beyond))
            paced += beyond
        return StoredChunks(out, paced)

    def _refusal(self, chunk: pb.DraftChunk, e: ChunkRefused, n: int = 1) -> pb.ChunkAck:
        """The ack refusing ``chunk`` (``n``: the chunks it answers for, counted refused)."""
        self.refused(e, n)
        sid = chunk.session_id
        if e.code == grpc.StatusCode.INVALID_ARGUMENT and len(sid) > 64:
            sid = ""  # never echo a huge id back
        return pb.ChunkAck(session_id=sid, start=chunk.start, code=e.code.value[0],
                           message=str(e))

    def read_stream(self, it, device: str, vocab: int, out: DrafterOutbox, stop, lost: list[str],
                    heard: list[float]) -> None:
        """An Attach stream's reader thread: its chunks stored and answered until the stream
        ends (``stop`` set, ``out`` ended); a Redis failure goes into ``lost`` (the stream then
        ends UNAVAILABLE), ``heard`` holds when the drafter last sent anything."""
        try:
            for msg in it:
                heard[0] = time.monotonic()  # a chunk or a heartbeat: the drafter is there
                kind = msg.WhichOneof("kind")
                if kind == "chunk":
                    stored = self.store_chunks(device, [msg.chunk], vocab)
                elif kind == "chunks":
                    stored = self.store_chunks(device, msg.chunks.chunks, vocab)
                else:
                    continue
                if not all(out.put(pb.CacheMessage(ack=ack)) for ack in stored.acks):
                    break  # the stream ended, or the drafter reads nothing of it
                wait, first = self.paces.after(device, stored.paced)
                if wait:
                    if first:
                        log.warning("drafter %s: its chunks are refused faster than %.0f a "
                                    "second; its stream is read no faster than that (a chunk "
                                    "stored with no news counts as refused)",
                                    device, self.paces.of(device).rate)
                    # its silence while unread is the cache's doing, not the board's
                    heard[0] = time.monotonic() + wait
                    if stop.wait(wait):
                        break
                    heard[0] = time.monotonic()
        except grpc.RpcError:
            pass  # the drafter went away
        except redis.RedisError as e:
            lost.append(f"the cache's Redis failed: {e}")
            log.warning("drafter %s: storing a chunk failed: %s", device, e)
        except Exception:
            log.exception("drafter %s: reading chunks failed", device)
        finally:
            stop.set()
            out.end()
