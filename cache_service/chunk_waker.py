"""The verifier's wake-up on a pushed chunk: a pub/sub subscription on its own connection and
thread, turned into a sequence number and a condition variable."""

from __future__ import annotations

import threading

import redis


class ChunkWaker:
    """Wakes a waiting verifier when a drafter pushes a chunk: a pub/sub subscription on its
    own connection and thread, turned into a sequence number and a condition variable."""

    def __init__(self, client: redis.Redis, channel: str):
        self.client, self.channel = client, channel
        self.seq = 0
        self._cond = threading.Condition()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True, name="chunk-waker")
        self._thread.start()

    def wait(self, seen: int, timeout: float) -> None:
        with self._cond:
            if self.seq == seen:
                self._cond.wait(timeout)

    def _bump(self) -> None:
        with self._cond:
            self.seq += 1
            self._cond.notify_all()

    def _listen(self) -> None:
        delay = 0.05
        while not self._stopping.is_set():
            pubsub = None
            try:
                pubsub = self.client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self.channel)
                delay = 0.05
                while not self._stopping.is_set():
                    if pubsub.get_message(timeout=0.5) is not None:
                        self._bump()
            except (redis.RedisError, OSError, ValueError):
                self._bump()  # a lost subscription may have missed a wake-up: re-read
                self._stopping.wait(delay)
                delay = min(1.0, delay * 2)
            finally:
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except Exception:
                        pass

    def stop(self) -> None:
        self._stopping.set()
