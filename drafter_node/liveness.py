"""An edge board's Attach stream kept alive: the application heartbeat both ways."""

from __future__ import annotations

import logging
import queue
import threading
import time

from edgespec.v1 import edgespec_pb2 as pb
from edgespec.wire.keepalive import SILENT_HEARTBEATS

log = logging.getLogger("edgespec.drafter")


class Liveness(threading.Thread):
    """One Attach stream's application heartbeat (``edgespec.wire.keepalive``): send a
    Heartbeat every ``beat_s``, and cancel the stream (the agent then attaches again) when the
    cache, which announced its own interval in Registered, has been silent for
    SILENT_HEARTBEATS of them."""

    def __init__(self, call, out: queue.Queue, beat_s: float, cache: str):
        super().__init__(daemon=True, name="attach-heartbeat")
        self.call, self.out, self.beat_s, self.cache = call, out, beat_s, cache
        self.last_heard = time.monotonic()
        self.silent_s = 0.0  # until the cache says its interval (an older cache: never)
        self.gave_up: str | None = None  # why it cancelled the stream, if it did
        self._done = threading.Event()
        self.start()

    def heard(self, msg: pb.CacheMessage) -> None:
        self.last_heard = time.monotonic()
        if msg.WhichOneof("kind") == "registered" and msg.registered.heartbeat_ms > 0:
            self.silent_s = max(1.0, SILENT_HEARTBEATS * msg.registered.heartbeat_ms / 1000)

    def stop(self) -> None:
        self._done.set()

    def run(self) -> None:
        tick = min(self.beat_s, 0.5)
        next_beat = time.monotonic() + self.beat_s
        while not self._done.wait(tick):
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + self.beat_s
                self.out.put(pb.DrafterMessage(heartbeat=pb.Heartbeat(
                    sent_unix_ms=int(time.time() * 1000))))
            if self.silent_s and now - self.last_heard > self.silent_s:
                # the agent logs the lost link with this reason (not the CANCELLED its own
                # cancel raises) and attaches again
                self.gave_up = (f"heard nothing from the cache at {self.cache} for "
                                f"{now - self.last_heard:.1f} s")
                self.call.cancel()
                return
