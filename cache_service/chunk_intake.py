"""A drafter's chunks into the store: an Attach stream's reader (``read_stream``: its chunks,
one or a board's ``DraftChunks``, checked and stored with what other streams push meanwhile, the
``ChunkBatcher``), and ``PushDraft``'s one chunk (``push_one``, a round trip of its own). Every
chunk is counted stored or refused in the cache's metrics; a refusal is answered with an ack
that carries its status code.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import grpc
import redis

from edgespec.v1 import edgespec_pb2 as pb

from .chunk_batcher import ChunkBatcher
from .chunk_checks import ChunkRefused, check_and_push, checked_chunk, chunk_ack
from .drafter_outbox import DrafterOutbox
from .store import RedisSessionStore
from .store_records import ChunkPush

if TYPE_CHECKING:  # prometheus_client is needed only where metrics are kept
    from .metrics import CacheMetrics

log = logging.getLogger("edgespec.cache")

MAX_BATCH_CHUNKS = 256  # chunks in one DraftChunks (the ones beyond are refused)
# a board's refused chunks the cache checks a second, after a burst: past them its stream is
# read more slowly (a refusal cost ~90 us of the server's CPU, most of them a Redis script's
# round trip: a board flooding refusals at 10,000 a second took 93% of a core and doubled
# everyone's latency). An honest board's refusals are a fix's stale chunks, a few a session-step
REFUSALS_PER_S = 512.0
REFUSAL_BURST = 2048.0
MAX_REFUSAL_WAIT_S = 5.0  # the debt a message may run up (300,000 chunks in one: not 10 min)


class RefusalPace:
    """A token bucket of one stream's refusals: ``after(n)`` counts n more refusals and says
    how long to wait before reading the stream again (0: at once). Waiting leaves the board's
    messages unread, so gRPC's flow control holds the board back: its refusals cost the server
    at most ``rate`` a second, whatever it sends, and nobody else's chunks wait for them. A
    message's refusals owe at most ``max_wait_s`` (one of 300,000 chunks, the ones past a
    message's 256 refused without a look, would otherwise hold its stream ten minutes)."""

    def __init__(self, rate: float = REFUSALS_PER_S, burst: float = REFUSAL_BURST,
                 clock=time.monotonic, max_wait_s: float = MAX_REFUSAL_WAIT_S):
        self.rate, self.burst, self.clock = rate, burst, clock
        self.most_owed = rate * max_wait_s
        self.allowance, self.at = burst, clock()
        self.held = 0  # the times it has asked for a wait

    def after(self, refused: int) -> float:
        now = self.clock()
        self.allowance = min(self.burst, self.allowance + (now - self.at) * self.rate)
        self.at = now
        self.allowance = max(self.allowance - refused, -self.most_owed)
        if self.allowance >= 0:
            return 0.0
        self.held += 1
        return -self.allowance / self.rate


class ChunkIntake:
    def __init__(self, store: RedisSessionStore, window: int, per_device: bool,
                 metrics: CacheMetrics | None):
        """``per_device``: the cache knows each drafter by its own token (a chunk for another
        device's session is PERMISSION_DENIED, else FAILED_PRECONDITION)."""
        self.store, self.window, self.per_device, self.metrics = store, window, per_device, metrics
        self.batcher = ChunkBatcher(store)
        self.refusal_pace = RefusalPace  # each stream's own, made as it is read
        # PushDraft's, every caller's together: its device is the caller's word (no token of
        # its own), so a flood under many names is paced as one
        self.push_pace = RefusalPace()
        self._push_lock = threading.Lock()
        self._push_warned = False  # said once, the first time it refuses unchecked

    def refused(self, e: ChunkRefused) -> None:
        """Count a refused chunk (stored ones are counted where they are stored)."""
        if self.metrics is not None:
            self.metrics.chunk_refused(e.code)

    def push_one(self, device: str, chunk: pb.DraftChunk, vocab: int) -> pb.ChunkAck:
        """``PushDraft``'s chunk, stored in a round trip of its own; raises ``ChunkRefused``
        (not counted: the caller counts what it refuses). While pushed chunks are refused
        faster than ``push_pace`` allows, each is refused unchecked (RESOURCE_EXHAUSTED)."""
        with self._push_lock:
            owed = self.push_pace.after(0)
            first = owed > 0 and not self._push_warned
            self._push_warned = self._push_warned or owed > 0
        if owed:
            if first:
                log.warning("pushed chunks are refused faster than %.0f a second: PushDraft "
                            "refuses every chunk unchecked while that lasts",
                            self.push_pace.rate)
            raise ChunkRefused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"pushed chunks are refused faster than "
                               f"{self.push_pace.rate:.0f} a second: none is checked for "
                               f"{owed:.1f} s")
        try:
            ack = check_and_push(self.store, device, chunk, vocab, self.window, self.per_device)
        except ChunkRefused:
            with self._push_lock:
                self.push_pace.after(1)
            raise
        if self.metrics is not None:
            self.metrics.chunk_stored(ack.kept)
        return ack

    def store_chunks(self, device: str, chunks: Iterable[pb.DraftChunk], vocab: int
                     ) -> list[pb.ChunkAck]:
        """An Attach stream's chunks checked, then stored together with what other streams
        push meanwhile; the acks to send: every refusal, and the stored chunks that are not
        quiet, in the chunks' order (as if each was sent alone)."""
        acks: list[pb.ChunkAck | None] = []  # each chunk's, in order; None: stored quietly
        checked: list[tuple[int, pb.DraftChunk, ChunkPush]] = []
        for i, chunk in enumerate(chunks):
            try:
                if i >= MAX_BATCH_CHUNKS:
                    raise ChunkRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                       f"a DraftChunks holds at most {MAX_BATCH_CHUNKS} chunks")
                checked.append((i, chunk, checked_chunk(self.store, device, chunk, vocab,
                                                        self.window)))
                acks.append(None)
            except ChunkRefused as e:
                acks.append(self._refusal(chunk, e))
        outcomes = self.batcher.push_all([c for _, _, c in checked]) if checked else []
        for (i, chunk, c), outcome in zip(checked, outcomes):
            try:
                ack = chunk_ack(chunk, c, outcome, self.per_device)
            except ChunkRefused as e:
                acks[i] = self._refusal(chunk, e)
                continue
            if self.metrics is not None:
                self.metrics.chunk_stored(ack.kept)
            if not chunk.quiet:  # stored: the drafter asked for no ack (a refusal has one)
                acks[i] = ack
        return [a for a in acks if a is not None]

    def _refusal(self, chunk: pb.DraftChunk, e: ChunkRefused) -> pb.ChunkAck:
        self.refused(e)
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
        pace = self.refusal_pace()
        ok = grpc.StatusCode.OK.value[0]
        try:
            for msg in it:
                heard[0] = time.monotonic()  # a chunk or a heartbeat: the drafter is there
                kind = msg.WhichOneof("kind")
                if kind == "chunk":
                    acks = self.store_chunks(device, [msg.chunk], vocab)
                elif kind == "chunks":
                    acks = self.store_chunks(device, msg.chunks.chunks, vocab)
                else:
                    continue
                if not all(out.put(pb.CacheMessage(ack=ack)) for ack in acks):
                    break  # the stream ended, or the drafter reads nothing of it
                wait = pace.after(sum(a.code != ok for a in acks))
                if wait:
                    if pace.held == 1:
                        log.warning("drafter %s: its chunks are refused faster than %.0f a "
                                    "second; its stream is read no faster than that",
                                    device, pace.rate)
                    if stop.wait(wait):
                        break
                    heard[0] = time.monotonic()  # its silence meanwhile is the cache's doing
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
