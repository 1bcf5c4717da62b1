"""The verifier's wake-up on a pushed chunk: a pub/sub subscription on its own connection and
thread, turned into a sequence number and a condition variable, and which sessions were woken
(a chunk's message names its session's key)."""

from __future__ import annotations

import threading
from collections import deque

import redis

KEPT = 4096  # wake-ups remembered by key: a waiter further behind re-reads every session


class ChunkWaker:
    """Wakes a waiting verifier when a drafter pushes a chunk: a pub/sub subscription on its
    own connection and thread, turned into a sequence number and a condition variable."""

    def __init__(self, client: redis.Redis, channel: str):
        self.client, self.channel = client, channel
        self.seq = 0
        # (seq, the woken session's key; None: unknown, every session may have moved)
        self._woken: deque[tuple[int, str | None]] = deque(maxlen=KEPT)
        self._cond = threading.Condition()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True, name="chunk-waker")
        self._thread.start()

    def wait(self, seen: int, timeout: float) -> None:
        with self._cond:
            if self.seq == seen:
                self._cond.wait(timeout)

    def woken_since(self, seen: int) -> tuple[set[str] | None, int]:
        """The keys of the sessions woken after ``seen`` (a ``seq``), or None where that is not
        known (a lost subscription, a message that names none, or too long ago: read them all);
        and the ``seq`` they run to (taken with them: a later wake-up is in the next call's)."""
        keys: set[str] = set()
        with self._cond:
            if self.seq - seen > len(self._woken):
                return None, self.seq
            for seq, key in reversed(self._woken):
                if seq <= seen:
                    break
                if key is None:
                    return None, self.seq
                keys.add(key)
            return keys, self.seq

    def _bump(self, key: str | None = None) -> None:
        with self._cond:
            self.seq += 1
            self._woken.append((self.seq, key))
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
                    message = pubsub.get_message(timeout=0.5)
                    if message is not None:
                        data = message.get("data")
                        # a chunk names its session's key; an older cache sends '1': unknown
                        key = data.decode(errors="replace") if isinstance(data, bytes) else None
                        self._bump(key if key and key != "1" else None)
            # redis-py's own errors, and its internals' when a connection closes under a read
            # (an AttributeError on the dropped buffer): the listener lives on either way
            except Exception:
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
