"""The draft cache's drafters in Redis: registrations, liveness (a short-lived mark while a
drafter's stream is open), pruning of drafters gone for long, each one's live sessions, and the
pick of the least-loaded attached drafter for a new session (reserved until its session exists,
so that concurrent requests spread over the fleet)."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

import redis

from .codec import InboxEvent, KeyLayout, raises_store_unavailable, text
from .store_lua import LIVE_SESSIONS_LUA, PRUNE_LUA


MAX_REGISTRATIONS = 4096  # drafters registered at once, attached or not


@dataclass
class DeviceInfo:
    device_id: str
    draft_model: str
    attached: bool
    sessions: int
    max_sessions: int
    last_seen_s: float  # 0 while attached


HAND_OVER_TRIES = 3  # transactions a hand-over tries while its watched keys change under it


class HandOver(NamedTuple):
    """What a hand-over found: the session's drafter after it ("" for none; None: the session
    is gone or done), and whether this call moved it."""

    owner: str | None
    moved: bool = False


def registered_limit(raw) -> int:
    """A drafter's own ``max_sessions`` from its registration (unsaid or unreadable: none)."""
    try:
        return int(json.loads(raw).get("max_sessions") or 0) or 1 << 30
    except (ValueError, TypeError, AttributeError):
        return 1 << 30


class DeviceRegistry:
    """The drafters registered in one Redis under ``keys``."""

    def __init__(self, client: redis.Redis, keys: KeyLayout, ttl_s: int = 600,
                 max_idle_s: float = 3600.0):
        self.redis, self.keys, self.ttl_s = client, keys, ttl_s
        # registrations of drafters not seen alive for this long are forgotten, with their
        # session set and inbox; keys.seen (a sorted set) holds when each was last alive
        self.max_idle_s = max_idle_s
        self._reserved: Counter = Counter()
        self._lock = threading.Lock()


    def _script(self, attr: str, text: str):
        script = self.__dict__.get(attr)
        if script is None:
            script = self.__dict__[attr] = self.redis.register_script(text)
        return script

    def register(self, device: str, info: dict) -> None:
        """Register (or update) ``device``; registrations beyond ``MAX_REGISTRATIONS`` are
        forgotten, the drafters detached longest first: every admission reads them all, so that
        drafters attaching under ever new ids cannot slow it down without end."""
        now = time.time()
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.devices, device, json.dumps(info))
        pipe.zadd(self.keys.seen, {device: now})
        pipe.execute()
        self.mark_alive(device)
        self.prune(now)
        count = self.redis.hlen(self.keys.devices)
        if count > MAX_REGISTRATIONS:  # the attached ones are read past, never forgotten
            self.prune(now, keep_s=-1.0, forget=count - MAX_REGISTRATIONS, limit=count)

    def mark_alive(self, device: str, ttl_ms: int = 5000) -> None:
        """The device's stream is open: alive for ``ttl_ms``; its last-seen time and the expiry
        of its session set are refreshed."""
        pipe = self.redis.pipeline(transaction=False)
        self._alive_into(pipe, [device], ttl_ms)
        pipe.execute()

    def mark_alive_many(self, devices: list[str], ttl_ms: int = 5000) -> list[bool]:
        """``mark_alive`` of each device, in one round trip; whether each is registered."""
        if not devices:
            return []
        pipe = self.redis.pipeline(transaction=False)
        self._alive_into(pipe, devices, ttl_ms)
        pipe.hmget(self.keys.devices, devices)
        return [v is not None for v in pipe.execute()[-1]]

    def _alive_into(self, pipe, devices: list[str], ttl_ms: int) -> None:
        """``mark_alive``'s commands for ``devices``, queued on ``pipe``."""
        now = time.time()
        for device in devices:
            pipe.set(self.keys.alive(device), "1", px=ttl_ms)
            pipe.expire(self.keys.sessions(device), self.ttl_s)
        pipe.zadd(self.keys.seen, {device: now for device in devices})

    def mark_gone(self, device: str, seen_at: float | None = None) -> None:
        """The device's stream ended: not alive; last seen alive at ``seen_at`` (wall-clock
        seconds; None: now, a stream that ended while the drafter was heard)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self.keys.alive(device))
        pipe.zadd(self.keys.seen, {device: time.time() if seen_at is None else seen_at})
        pipe.execute()

    def is_alive(self, device: str) -> bool:
        return bool(device) and bool(self.redis.exists(self.keys.alive(device)))

    @raises_store_unavailable
    def alive_many(self, devices: list[str]) -> list[bool]:
        """``is_alive`` of each device, in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for device in devices:
            pipe.exists(self.keys.alive(device))
        return [bool(up) for up in pipe.execute()]

    def prune(self, now: float | None = None, keep_s: float | None = None,
              forget: int = 256, limit: int = 256) -> list[str]:
        """Forget drafters not alive and not seen for ``keep_s`` (default ``max_idle_s``): their
        registration, session set and inbox, at most ``forget`` of them of the ``limit``
        longest unseen. Returns the forgotten device ids."""
        keep = self.max_idle_s if keep_s is None else keep_s
        cutoff = (time.time() if now is None else now) - keep
        gone = self._script("_prune_lua", PRUNE_LUA)(
            keys=[self.keys.devices, self.keys.seen],
            args=[cutoff, self.keys.device_prefix, limit, forget])
        return [d.decode() for d in gone]

    def live_sessions(self, devices: list[str]) -> list[list[str]]:
        """Per device, its sessions that still exist and are not done; the others are dropped
        from its set (a crashed verifier never closes its sessions), and the set's expiry is
        refreshed."""
        script = self._script("_live_lua", LIVE_SESSIONS_LUA)
        pipe = self.redis.pipeline(transaction=False)
        for dev in devices:
            script(keys=[self.keys.sessions(dev)], args=[self.keys.session_prefix, self.ttl_s],
                   client=pipe)
        return [sorted(s.decode() for s in live) for live in pipe.execute()]

    @raises_store_unavailable
    def pick(self) -> str | None:
        """The attached drafter with the fewest live sessions below its own limit, or None.

        The pick is reserved until ``create`` registers the session, so concurrent requests
        spread over the fleet instead of all choosing the same least-loaded device."""
        got = self.pick_many(1)
        return got[0] if got else None

    @raises_store_unavailable
    def pick_many(self, n: int) -> list[str]:
        """Up to ``n`` picks over one reading of the fleet, each as ``pick``'s with the ones
        before it counted (each reserved: ``release`` each)."""
        now = time.time()
        self.prune(now)
        regs = {text(d): raw for d, raw in self.redis.hgetall(self.keys.devices).items()}
        pipe = self.redis.pipeline(transaction=False)
        for dev in regs:
            pipe.exists(self.keys.alive(dev))
        up = pipe.execute()
        alive = [dev for dev, a in zip(regs, up) if a]
        dead = [dev for dev, a in zip(regs, up) if not a]
        if dead:  # registrations from before last-seen marks start ageing now
            self.redis.zadd(self.keys.seen, {dev: now for dev in dead}, nx=True)
        loads = dict(zip(alive, (len(s) for s in self.live_sessions(alive))))
        limits = {dev: registered_limit(regs[dev]) for dev in alive}
        out: list[str] = []
        with self._lock:
            while len(out) < n:
                best, best_load = None, None
                for dev in alive:
                    load = loads[dev] + self._reserved[dev]
                    if load < limits[dev] and (best_load is None or load < best_load):
                        best, best_load = dev, load
                if best is None:
                    break
                self._reserved[best] += 1
                out.append(best)
        return out

    def listing(self) -> list[DeviceInfo]:
        """Every registered drafter: attached or not, its load and when it was last seen."""
        now = time.time()
        regs = {text(d): raw for d, raw in self.redis.hgetall(self.keys.devices).items()}
        pipe = self.redis.pipeline(transaction=False)
        for dev in regs:
            pipe.exists(self.keys.alive(dev))
            pipe.zscore(self.keys.seen, dev)
        flags = pipe.execute()
        loads = self.live_sessions(list(regs))
        out = []
        for j, (dev, raw) in enumerate(regs.items()):
            alive, seen = flags[2 * j], flags[2 * j + 1]
            try:
                info = json.loads(raw)
            except ValueError:
                info = {}
            out.append(DeviceInfo(dev, str(info.get("draft_model", "")), bool(alive),
                                  len(loads[j]), int(info.get("max_sessions") or 0),
                                  0.0 if alive or seen is None else max(0.0, now - seen)))
        return sorted(out, key=lambda d: d.device_id)

    def release(self, device: str | None) -> None:
        """Give back a reservation whose session was never created."""
        if device:
            with self._lock:
                if self._reserved[device] > 0:
                    self._reserved[device] -= 1

    def hand_over(self, sid: str, device: str, previous: str, inbox_maxlen: int
                  ) -> HandOver:
        """Session ``sid``, running and drafted by ``previous`` ("": by none), drafted by
        ``device`` from now on, atomically: its owner field, both drafters' session sets, an
        assignment in ``device``'s inbox (it drafts from the session's committed end, as for
        a new session) and, where ``previous`` is still registered, a close in its inbox (a
        board that comes back drops it; the push script refuses its chunks: the session is no
        longer its). The draft held is dropped (a chunk of ``device`` starts at the committed
        end) and the rest it was told of forgotten. Nothing changes where the session is gone
        or done, is no longer ``previous``'s (another replica's hand-over, or this one's whose
        reply was lost), or ``device`` holds its ``max_sessions`` (checked in the transaction:
        replicas handing sessions to one board at once stay within its limit)."""
        for _ in range(HAND_OVER_TRIES):
            try:
                return self._hand_over_once(sid, device, previous, inbox_maxlen)
            except redis.WatchError:
                # a watched key changed meanwhile (a commit, a board's set refreshed: its
                # EXPIRE counts), or EXEC's reply was lost (redis-py raises WatchError for a
                # connection lost while watching: the transaction may have run): the next try
                # reads the owner the cache holds now
                continue
        owner = self.redis.hget(self.keys.session(sid)[0], "device")  # changed under every try
        return HandOver(None if owner is None else text(owner))

    def _hand_over_once(self, sid: str, device: str, previous: str, inbox_maxlen: int
                        ) -> HandOver:
        """``hand_over``'s transaction, tried once (raises ``redis.WatchError`` where a watched
        key changed before it ran)."""
        h, _, draft, branches = self.keys.session(sid)
        mine = self.keys.sessions(device)
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.watch(h, mine)
            owner, done = pipe.hmget(h, "device", "done")
            if owner is None or text(done or b"0") == "1":
                return HandOver(None)
            if text(owner) != previous or pipe.scard(mine) >= self._limit(device):
                return HandOver(text(owner))
            registered = bool(previous) and bool(pipe.hexists(self.keys.devices, previous))
            pipe.multi()
            pipe.hset(h, mapping={"device": device, "idle": 0})
            pipe.hdel(h, "rest", "hush", "hushep")
            pipe.set(draft, b"", keepttl=True)
            pipe.delete(branches)
            if previous:
                pipe.srem(self.keys.sessions(previous), sid)
            if registered:  # (an inbox written after its prune would never expire)
                pipe.xadd(self.keys.inbox(previous), InboxEvent("close", sid).fields(),
                          maxlen=inbox_maxlen, approximate=True)
            pipe.sadd(mine, sid)
            pipe.expire(mine, self.ttl_s)
            pipe.xadd(self.keys.inbox(device), InboxEvent("assign", sid).fields(),
                      maxlen=inbox_maxlen, approximate=True)
            pipe.execute()
            return HandOver(device, True)

    def _limit(self, device: str) -> int:
        return registered_limit(self.redis.hget(self.keys.devices, device))

    def sessions_of(self, device: str) -> list[str]:
        """The device's sessions that still exist and are not done (stale ones are dropped)."""
        return self.live_sessions([device])[0]
