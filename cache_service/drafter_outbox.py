"""What the draft cache has to send one attached drafter, bounded.

An Attach stream's messages (chunk acknowledgements, assignments, commits and fixes) are queued by
the stream's reader and event threads and sent by its handler. A drafter is an untrusted device:
one that sends chunks and never reads the stream would have the cache queue an acknowledgement
per chunk without end. ``DrafterOutbox`` holds at most ``MAX_PENDING`` messages; a thread that
finds it full waits (the reader then stops reading chunks, and gRPC's flow control holds the
drafter's sends back), and once the drafter has read nothing for ``STUCK_S`` the stream is
cancelled: the drafter is detached, as one gone silent is, and its sessions are verified
without its drafts until it attaches again. ``with_queued``: a message to send and what else is
queued behind it, as one CacheBatch.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

from edgespec.v1 import edgespec_pb2 as pb

log = logging.getLogger("edgespec.cache")

MAX_PENDING = 1024  # messages queued for one drafter's stream
STUCK_S = 30.0  # how long a full outbox waits for the drafter to read before detaching it
_POLL_S = 0.25
MAX_SEND_BATCH = 256  # queued messages sent to a board in one CacheBatch


class DrafterOutbox:
    """A bounded queue of messages for one drafter's stream; ``None`` (``end``) ends it."""

    def __init__(self, device: str, stop: threading.Event, cancel: Callable[[], Any]):
        """``stop``: set when the stream ends (a full outbox then stops waiting); ``cancel``:
        ends the stream (the call's ``context.cancel``)."""
        self.device, self.stop, self.cancel = device, stop, cancel
        self.stuck_s = STUCK_S
        self._queue: queue.Queue = queue.Queue(MAX_PENDING)

    def put(self, msg: Any) -> bool:
        """Queue ``msg``, waiting while the outbox is full; False when the stream ended first,
        or the drafter read nothing for ``stuck_s`` (the stream is then cancelled)."""
        since = time.monotonic()
        while not self.stop.is_set():
            try:
                self._queue.put(msg, timeout=_POLL_S)
                return True
            except queue.Full:
                if time.monotonic() - since >= self.stuck_s:
                    self.give_up()
                    return False
        return False

    def offer(self, msg: Any) -> bool:
        """Queue ``msg`` if there is room; False when the outbox is full (never waits)."""
        try:
            self._queue.put_nowait(msg)
            return True
        except queue.Full:
            return False

    def give_up(self) -> None:
        """The drafter read nothing of its full outbox for ``stuck_s``: detach it (its stream
        cancelled)."""
        log.warning("drafter %s: it read nothing of its stream for %.0f s with %d messages "
                    "waiting: detaching it", self.device, self.stuck_s, self._queue.qsize())
        # cancelled before ``stop`` is set: ``stop`` ends the stream's handler, and a handler
        # that returned first would end the stream OK instead of CANCELLED
        self.cancel()
        self.stop.set()

    def end(self) -> None:
        """Wake the stream's handler to end it (``stop`` is set by then); never waits."""
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass  # the handler sees ``stop`` at its next poll

    def get(self, timeout: float) -> Any:
        """The next message (None: the stream ends); raises ``queue.Empty`` after ``timeout``."""
        return self._queue.get(timeout=timeout)

    def get_queued(self, most: int) -> list[Any]:
        """Up to ``most`` more messages already queued, never waiting (a None among them: the
        stream ends there, and is the last)."""
        got: list[Any] = []
        while len(got) < most:
            try:
                got.append(self._queue.get_nowait())
            except queue.Empty:
                break
            if got[-1] is None:
                break
        return got


def with_queued(msg: pb.CacheMessage, out: DrafterOutbox) -> tuple[pb.CacheMessage, bool]:
    """``msg`` and what else ``out`` holds for the board, as one CacheBatch (``msg`` itself when
    nothing else is queued), and whether the stream ends after it."""
    more = out.get_queued(MAX_SEND_BATCH - 1)
    ended = bool(more) and more[-1] is None
    if ended:
        more.pop()
    if not more:
        return msg, ended
    return pb.CacheMessage(batch=pb.CacheBatch(messages=[msg, *more])), ended
