"""The chunks of every attached board stored together: one Redis round trip for what came in
meanwhile, not one a chunk.

Each Attach stream's reader thread checks its board's chunk (``chunk_checks``) and hands it here;
one thread appends what is queued in one ``RedisSessionStore.push_many`` call and hands each
reader its chunk's outcome. A reader waits for its own chunk, so a board's chunks are stored in
the order it sent them and a board that floods the stream is held back by its own reader, as
when each reader stored its chunks itself; chunks that arrive while a call is in flight go in
the next (on a step's burst, when every board answers the same commit, one call a few boards).
The redis-py work a command costs (a connection taken from the pool, the command packed, the
reply parsed) was half of the cache's Python CPU with one call a chunk
(``scripts/cache_fleet_cost.py`` under a sampling profiler).

A call that Redis fails fails each of its chunks (their readers end their streams, as with one
call a chunk); a call that fails otherwise is made again chunk by chunk, so that the chunk that
broke it is refused alone and no other board's chunk or stream pays for it.

The thread starts at the first chunk and ends once nothing came for ``IDLE_S``.
"""

from __future__ import annotations

import logging
import queue
import threading

import redis

from .store import RedisSessionStore
from .store_records import ChunkPush, PushResult, StoreError

log = logging.getLogger("edgespec.cache")

MAX_BATCH = 256  # chunks in one call: a bound on the script's time inside Redis
IDLE_S = 5.0


class _Pending:
    """One reader's chunk in the queue; ``done`` is released once ``outcome`` is set."""

    __slots__ = ("chunk", "done", "outcome")

    def __init__(self, chunk: ChunkPush):
        self.chunk = chunk
        self.done = threading.Lock()
        self.done.acquire()  # released by the batching thread: a lock is the cheapest wait
        self.outcome: PushResult | StoreError | BaseException | None = None


class ChunkBatcher:
    """``push``: store a chunk as ``RedisSessionStore.push`` would, batched with the chunks
    other threads push meanwhile."""

    def __init__(self, store: RedisSessionStore):
        self.store = store
        self._queue: queue.SimpleQueue[_Pending] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running = False
        self.calls = 0  # push_many calls made (the batching's effect, for tests and metrics)
        self.chunks = 0

    def push(self, chunk: ChunkPush) -> PushResult:
        """Store ``chunk``; raises its ``StoreError`` when refused (kind "error" when storing
        it failed otherwise), and ``redis.RedisError`` when Redis failed the call it went in."""
        [outcome] = self.push_all([chunk])
        if isinstance(outcome, StoreError):
            raise outcome
        return outcome

    def push_all(self, chunks: list[ChunkPush]) -> list[PushResult | StoreError]:
        """Store several chunks, in order (a board's ``DraftChunks``): each one's outcome or
        refusal; raises ``redis.RedisError`` when Redis failed a call they went in."""
        pending = [_Pending(c) for c in chunks]
        with self._lock:
            for p in pending:
                self._queue.put(p)
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, daemon=True, name="chunk-batcher").start()
        for p in pending:
            p.done.acquire()
        outcomes = [p.outcome for p in pending]
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, StoreError):
                raise outcome
        return outcomes  # type: ignore[return-value]  # results and refusals only, by now

    def _next_batch(self) -> list[_Pending] | None:
        """What is queued (waiting up to ``IDLE_S`` for a first chunk); None: the thread ends."""
        try:
            first = self._queue.get(timeout=IDLE_S)
        except queue.Empty:
            with self._lock:  # a push that queued meanwhile sees _running and is served
                if self._queue.empty():
                    self._running = False
                    return None
            first = self._queue.get()
        batch = [first]
        while len(batch) < MAX_BATCH:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            outcomes = self._outcomes([p.chunk for p in batch])
            self.calls += 1
            self.chunks += len(batch)
            for pending, outcome in zip(batch, outcomes):
                pending.outcome = outcome
                pending.done.release()

    def _outcomes(self, chunks: list[ChunkPush]) -> list:
        """``push_many``'s answers to ``chunks``. A Redis failure is every chunk's (the readers
        end their streams); any other failure of a call of several chunks is found out chunk by
        chunk, so that one board's chunk that breaks the call fails no other board's stream."""
        try:
            return self.store.push_many(chunks)
        except redis.RedisError as e:
            return [e] * len(chunks)
        except Exception as e:
            if len(chunks) == 1:  # refused alone (its ack says INTERNAL); its stream goes on
                log.exception("storing a chunk of session %s failed", chunks[0].session_id)
                return [StoreError(-7, f"the cache failed to store the chunk: {e!r}")]
            return [self._outcomes([c])[0] for c in chunks]
