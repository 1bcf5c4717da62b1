"""One thread that reads every attached drafter's inbox and hands each event to its stream.

A drafter's commits, fixes, assignments and closes reach it through its inbox stream in Redis
(``codec.InboxEvent``). The cache read each inbox in a thread of its own, blocked in its own
``XREAD`` on a connection of its own: at 64 boards, 64 threads and connections, and a Redis round
trip for every event, since a board's events come one a step. ``InboxReader`` reads them all in
one ``XREAD`` over every subscribed inbox (a poll of ``BLOCK_MS`` at most, so that a board that
attaches is read from within it), once a poll marks every board alive and reads their
registrations, all in one round trip, and queues each event on its board's outbox.

A board whose outbox is full (it reads nothing of its stream) is not read for until its outbox
takes the messages held for it; once it has read nothing for its outbox's ``stuck_s`` its stream
is cancelled, as before. A subscription ends when its stream is replaced by a newer one of the
same device (``current`` says which), when Redis fails (every subscription: their streams end
with the reason, and the boards attach again after the retry hint) or forgets a board's
registration (Redis restarted without persistence), and when its stream ends (``remove``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import redis

from .drafter_outbox import DrafterOutbox
from .store import RedisSessionStore

log = logging.getLogger("edgespec.cache")

BLOCK_MS = 50  # the longest read: a board that attaches meanwhile is read from after it


@dataclass(eq=False)
class Subscription:
    """One Attach stream's events: its device and generation, the last inbox entry read, its
    outbox, its stream's stop flag and the list its end's reason goes to."""

    device: str
    gen: int
    after: str
    out: DrafterOutbox
    stop: threading.Event
    lost: list[str]
    held: deque = field(default_factory=deque)  # messages its full outbox did not take yet
    full_since: float | None = None

    def end(self, why: str | None = None) -> None:
        """End the stream (``why``: the reason its drafter is told)."""
        if why is not None:
            self.lost.append(why)
        self.stop.set()
        self.out.end()


class InboxReader:
    """Reads the subscribed drafters' inboxes (``add``, ``remove``) in one thread."""

    def __init__(self, store: RedisSessionStore, poll_ms: int,
                 message_of: Callable[[Any], Any], current: Callable[[str, int], bool],
                 stopping: threading.Event):
        """``message_of``: the stream message of an inbox event (None: nothing to send);
        ``current``: whether a device's generation is still its newest stream's."""
        self.store, self.poll_ms = store, poll_ms
        self.message_of, self.current, self.stopping = message_of, current, stopping
        self._subs: dict[str, Subscription] = {}  # by device
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, sub: Subscription) -> None:
        """Read ``sub``'s inbox from its ``after`` on; an older stream of its device ends. The
        reading thread runs while any stream is subscribed."""
        with self._lock:
            older = self._subs.get(sub.device)
            self._subs[sub.device] = sub
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="cache-inboxes")
                self._thread.start()
        if older is not None and older is not sub:
            older.end()

    def remove(self, sub: Subscription) -> None:
        with self._lock:
            if self._subs.get(sub.device) is sub:
                del self._subs[sub.device]

    def _run(self) -> None:
        checked = -float("inf")
        while not self.stopping.is_set():
            with self._lock:
                if not self._subs:  # the last stream ended: so does the thread (``add``
                    self._thread = None  # starts another)
                    return
                subs = [s for s in self._subs.values() if not s.stop.is_set()]
            for s in subs:
                if not self.current(s.device, s.gen):
                    self.remove(s)
                    s.end()  # a newer stream took this device over
            subs = [s for s in subs if not s.stop.is_set()]
            if not subs:
                self.stopping.wait(BLOCK_MS / 1000)
                continue
            try:
                if time.monotonic() - checked >= self.poll_ms / 1000:
                    checked = time.monotonic()
                    self._mark_alive(subs)
                readable = [s for s in subs if self._deliver_held(s)]
                if not readable:
                    self.stopping.wait(BLOCK_MS / 1000)
                    continue
                got = self.store.read_inboxes({s.device: s.after for s in readable},
                                              min(BLOCK_MS, self.poll_ms))
            except redis.RedisError as e:
                if not self.stopping.is_set():
                    log.warning("reading the drafters' inboxes failed: %s", e)
                    for s in subs:
                        self.remove(s)
                        s.end(f"the cache's Redis failed: {e}")
                continue
            except Exception:  # a bug's read: its streams end, the reader goes on
                if not self.stopping.is_set():
                    log.exception("reading the drafters' inboxes failed")
                    for s in subs:
                        self.remove(s)
                        s.end()
                continue
            by_device = {s.device: s for s in readable}
            for device, entries in got.items():
                s = by_device[device]
                for eid, ev in entries:
                    s.after = eid
                    msg = self.message_of(ev)
                    if msg is not None:
                        s.held.append(msg)
                self._deliver_held(s)

    def _mark_alive(self, subs: list[Subscription]) -> None:
        """Every board alive for five polls, and each one whose registration Redis forgot
        (it restarted without persistence: no session would be assigned to it) sent to attach
        again; one round trip for all."""
        registered = self.store.devices.mark_alive_many([s.device for s in subs],
                                                        ttl_ms=self.poll_ms * 5)
        for s, known in zip(subs, registered):
            if not known:
                log.warning("drafter %s: its registration vanished (Redis restarted); asking "
                            "it to attach again", s.device)
                self.remove(s)
                s.end("the cache's Redis restarted and lost this drafter's registration: "
                      "attach again")

    def _deliver_held(self, s: Subscription) -> bool:
        """Queue what is held for ``s``; whether all of it was taken (its inbox may be read).
        A drafter that has read nothing of a full outbox for its ``stuck_s`` is detached."""
        while s.held:
            if not s.out.offer(s.held[0]):
                now = time.monotonic()
                if s.full_since is None:
                    s.full_since = now
                elif now - s.full_since >= s.out.stuck_s:
                    s.out.give_up()
                    self.remove(s)
                return False
            s.held.popleft()
        s.full_since = None
        return not s.stop.is_set()
