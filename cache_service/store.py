"""The draft cache's state in Redis, and the atomic operations on it (Lua scripts).

Keys (prefix ``es:`` by default):

    es:s:{sid}            hash: prompt_len, epoch, device, params (JSON, seed included), idle,
                          done, finish (reason), max_new
    es:s:{sid}:tok        string: prompt + committed tokens, packed little-endian uint32
    es:s:{sid}:draft      string: the draft beyond the committed tokens, packed the same way
    es:s:{sid}:br         list: the draft's branches (token trees), each packed [pos, tokens...]
    es:dev:{id}:inbox     stream: assignment / commit (fix) / close events for a drafter
    es:dev:{id}:alive     string with a short TTL while the drafter's stream is open
    es:dev:{id}:sessions  set: the device's active sessions
    es:devices            hash: device id -> JSON registration
    es:devices:seen       sorted set: device id -> last seen (registrations idle long are pruned)
    es:target             hash: the verifier's model, tokenizer fingerprint, vocabulary, window
    es:wake               pub/sub channel: a message per pushed chunk wakes the verifier
    es:cb:f, es:cb:lru, es:cb:v   the fleet-wide Cacheback table (``cache_service.fleet_table``),
                          taught every session's output when the verifier closes it

Bounds: a draft never exceeds the window, the inbox streams are capped (MAXLEN ~), and every
session key expires ``ttl_s`` after its last commit, so an abandoned session disappears by itself.

The verifier's side (``create``, ``take_when_ready``, ``commit_many``, ``close``) implements
``edgespec.protocol.SessionStore``, as the in-process ``LocalSessionStore`` does.
"""

from __future__ import annotations

import functools
import json
import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import redis

from edgespec.config import SamplingParams
from edgespec.fleet_table import record_output
from edgespec.protocol import (MAX_BRANCHES, Branch, CommitOutcome, DraftWant, Fix,
                               SessionVanished, StoreUnavailable, TakenDraft, Verdict,
                               chunk_branches, take_branches)

from .fleet_table import RedisFleetTable
from .store_lua import COMMIT_LUA, LIVE_SESSIONS_LUA, PRUNE_LUA, PUSH_LUA

log = logging.getLogger("edgespec.cache")


def _unavailable_on_redis_errors(method):
    """The verifier's calls raise ``StoreUnavailable`` when Redis cannot serve them (down,
    restarting, out of memory), so that no role above the store knows it is Redis."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except (redis.RedisError, OSError) as e:
            raise StoreUnavailable(f"the draft cache's Redis: {e}") from e

    return wrapper

def pack_tokens(tokens) -> bytes:
    return np.asarray(tokens, dtype="<u4").tobytes()


def unpack_tokens(blob: bytes | None) -> list[int]:
    return np.frombuffer(blob or b"", dtype="<u4").astype(np.int64).tolist()


def params_to_json(p: SamplingParams) -> str:
    return json.dumps({"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p,
                       "seed": p.seed})


def params_from_json(s: str | bytes | None) -> SamplingParams:
    return SamplingParams(**json.loads(s)) if s else SamplingParams()


class StoreError(Exception):
    """A refused operation. ``kind``: unknown, stale, finished, position, mixed."""

    KINDS = {-1: "unknown", -2: "stale", -3: "finished", -4: "position", -5: "mixed"}

    def __init__(self, code: int, message: str | bytes):
        super().__init__(message.decode() if isinstance(message, bytes) else message)
        self.kind = self.KINDS.get(code, "error")


@dataclass
class PushResult:
    kept: int
    committed_end: int


@dataclass
class DeviceInfo:
    device_id: str
    draft_model: str
    attached: bool
    sessions: int
    max_sessions: int
    last_seen_s: float  # 0 while attached


@dataclass
class SessionRecord:
    """A session as stored: what a verifier needs to resume it."""

    session_id: str
    prompt: list[int]
    committed: list[int]
    params: SamplingParams
    max_new_tokens: int
    device: str | None
    finish_reason: str | None  # set once the session finished ("stop" or "length")
    epoch: int
    done: bool  # closed, whatever the reason (cancelled and failed sessions are resumable)
    verify: str = ""  # "exact" or "loose" as verified so far ("": recorded before it was kept)


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


@dataclass
class SessionSnapshot:
    session_id: str
    tokens: list[int]
    params: SamplingParams
    epoch: int


class RedisSessionStore:
    def __init__(self, client: redis.Redis, prefix: str = "es:", ttl_s: int = 600,
                 inbox_maxlen: int = 10000, wait_ms: float = 10.0,
                 fleet_leaders: int = 1 << 17):
        self.redis = client
        # the fleet-wide Cacheback table: every closed session's output is recorded into it, by
        # a thread of its own (a 512-token session costs ~28 ms of Lua) off the verifier's loop
        self.fleet = RedisFleetTable(client, prefix, fleet_leaders) if fleet_leaders else None
        self._fleet_queue: queue.Queue[str | None] = queue.Queue(maxsize=1024)
        self._fleet_thread: threading.Thread | None = None
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.inbox_maxlen = inbox_maxlen
        self.wait_ms = wait_ms
        self._push = client.register_script(PUSH_LUA)
        self._commit = client.register_script(COMMIT_LUA)
        self._device_of: dict[str, str] = {}
        self._reserved: Counter = Counter()
        self._lock = threading.Lock()
        self._chunk_waker: ChunkWaker | None = None

    # -- keys ------------------------------------------------------------------------------------
    def session_keys(self, sid: str) -> list[str]:
        """[hash, committed tokens, draft, branches] keys of a session."""
        base = f"{self.prefix}s:{sid}"
        return [base, base + ":tok", base + ":draft", base + ":br"]

    def inbox_key(self, device: str) -> str:
        return f"{self.prefix}dev:{device}:inbox"

    def alive_key(self, device: str) -> str:
        return f"{self.prefix}dev:{device}:alive"

    def sessions_key(self, device: str) -> str:
        return f"{self.prefix}dev:{device}:sessions"

    @property
    def wake_key(self) -> str:
        return f"{self.prefix}wake"

    # -- target and devices ------------------------------------------------------------------
    def set_target(self, info: dict) -> None:
        self.redis.hset(f"{self.prefix}target", mapping={k: str(v) for k, v in info.items()})

    def ensure_target(self, info: dict) -> None:
        """Register the target again if Redis lost it (a restart without persistence)."""
        if not self.redis.exists(f"{self.prefix}target"):
            self.set_target(info)

    def target(self) -> dict:
        return {k.decode(): v.decode() for k, v in self.redis.hgetall(f"{self.prefix}target").items()}

    # Registrations (es:devices) of drafters not seen alive for this long are forgotten, with
    # their session set and inbox; es:devices:seen (sorted set) holds when each was last alive.
    device_max_idle_s: float = 3600.0

    @property
    def devices_key(self) -> str:
        return f"{self.prefix}devices"

    @property
    def seen_key(self) -> str:
        return f"{self.prefix}devices:seen"

    def _script(self, attr: str, text: str):
        script = self.__dict__.get(attr)
        if script is None:
            script = self.__dict__[attr] = self.redis.register_script(text)
        return script

    def register_device(self, device: str, info: dict) -> None:
        now = time.time()
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.devices_key, device, json.dumps(info))
        pipe.zadd(self.seen_key, {device: now})
        pipe.execute()
        self.mark_alive(device)
        self.prune_devices(now)

    def mark_alive(self, device: str, ttl_ms: int = 5000) -> None:
        """The device's stream is open: alive for ``ttl_ms``; its last-seen time and the expiry
        of its session set are refreshed."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.alive_key(device), "1", px=ttl_ms)
        pipe.zadd(self.seen_key, {device: time.time()})
        pipe.expire(self.sessions_key(device), self.ttl_s)
        pipe.execute()

    def mark_gone(self, device: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self.alive_key(device))
        pipe.zadd(self.seen_key, {device: time.time()})
        pipe.execute()

    def is_alive(self, device: str) -> bool:
        return bool(device) and bool(self.redis.exists(self.alive_key(device)))

    def prune_devices(self, now: float | None = None) -> list[str]:
        """Forget drafters not alive and not seen for ``device_max_idle_s``: their
        registration, session set and inbox. Returns the forgotten device ids."""
        cutoff = (time.time() if now is None else now) - self.device_max_idle_s
        gone = self._script("_prune_lua", PRUNE_LUA)(
            keys=[self.devices_key, self.seen_key], args=[cutoff, f"{self.prefix}dev:", 256])
        return [d.decode() for d in gone]

    def _live_sessions(self, devices: list[str]) -> list[list[str]]:
        """Per device, its sessions that still exist and are not done; the others are dropped
        from its set (a crashed verifier never closes its sessions), and the set's expiry is
        refreshed."""
        script = self._script("_live_lua", LIVE_SESSIONS_LUA)
        pipe = self.redis.pipeline(transaction=False)
        for dev in devices:
            script(keys=[self.sessions_key(dev)], args=[f"{self.prefix}s:", self.ttl_s], client=pipe)
        return [sorted(s.decode() for s in live) for live in pipe.execute()]

    @_unavailable_on_redis_errors
    def pick_device(self) -> str | None:
        """The attached drafter with the fewest live sessions below its own limit, or None.

        The pick is reserved until ``create`` registers the session, so concurrent requests
        spread over the fleet instead of all choosing the same least-loaded device."""
        now = time.time()
        self.prune_devices(now)
        regs = {d.decode(): raw for d, raw in self.redis.hgetall(self.devices_key).items()}
        pipe = self.redis.pipeline(transaction=False)
        for dev in regs:
            pipe.exists(self.alive_key(dev))
        up = pipe.execute()
        alive = [dev for dev, a in zip(regs, up) if a]
        dead = [dev for dev, a in zip(regs, up) if not a]
        if dead:  # registrations from before last-seen marks start ageing now
            self.redis.zadd(self.seen_key, {dev: now for dev in dead}, nx=True)
        loads = dict(zip(alive, (len(s) for s in self._live_sessions(alive))))
        with self._lock:
            best, best_load = None, None
            for dev in alive:
                load = loads[dev] + self._reserved[dev]
                try:
                    limit = int(json.loads(regs[dev]).get("max_sessions") or 0) or 1 << 30
                except (ValueError, TypeError, AttributeError):
                    limit = 1 << 30
                if load < limit and (best_load is None or load < best_load):
                    best, best_load = dev, load
            if best is not None:
                self._reserved[best] += 1
            return best

    def devices(self) -> list[DeviceInfo]:
        """Every registered drafter: attached or not, its load and when it was last seen."""
        now = time.time()
        regs = {d.decode(): raw for d, raw in self.redis.hgetall(self.devices_key).items()}
        pipe = self.redis.pipeline(transaction=False)
        for dev in regs:
            pipe.exists(self.alive_key(dev))
            pipe.zscore(self.seen_key, dev)
        flags = pipe.execute()
        loads = self._live_sessions(list(regs))
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

    def release_pick(self, device: str | None) -> None:
        """Give back a reservation whose session was never created."""
        if device:
            with self._lock:
                if self._reserved[device] > 0:
                    self._reserved[device] -= 1

    # -- the verifier's side -----------------------------------------------------------------
    @_unavailable_on_redis_errors
    def create(self, sid: str, prompt: list[int], params: SamplingParams,
               drafter: str | None, max_new_tokens: int = 0,
               committed: Sequence[int] = (), verify: str = "exact") -> None:
        """A new session, or (``committed`` given) one resumed from its committed output: the
        epoch moves past any earlier one, so chunks drafted before the resume are refused."""
        h, tok, draft, br = self.session_keys(sid)
        device = drafter or ""
        old_epoch = self.redis.hget(h, "epoch")
        epoch = int(old_epoch) + 1 if old_epoch is not None else 0
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(h, tok, draft, br)
        pipe.hset(h, mapping={"prompt_len": len(prompt), "epoch": epoch, "device": device,
                              "params": params_to_json(params), "idle": 0, "done": 0,
                              "max_new": max_new_tokens, "finish": "", "verify": verify})
        pipe.set(tok, pack_tokens(list(prompt) + list(committed)))
        pipe.set(draft, b"")
        for key in (h, tok, draft):
            pipe.expire(key, self.ttl_s)
        if device:
            pipe.sadd(self.sessions_key(device), sid)
            pipe.expire(self.sessions_key(device), self.ttl_s)
            pipe.xadd(self.inbox_key(device), {"t": "assign", "sid": sid},
                      maxlen=self.inbox_maxlen, approximate=True)
        pipe.execute()
        with self._lock:
            self._device_of[sid] = device

    @_unavailable_on_redis_errors
    def load(self, sid: str) -> SessionRecord | None:
        """A session as the cache holds it (for resuming it), or None if it is gone."""
        return self._load(sid)

    def _load(self, sid: str) -> SessionRecord | None:
        h, tok = self.session_keys(sid)[:2]
        pipe = self.redis.pipeline(transaction=True)
        pipe.hgetall(h)
        pipe.get(tok)
        fields, blob = pipe.execute()
        if not fields or b"prompt_len" not in fields:
            return None
        f = {k.decode(): v.decode() for k, v in fields.items()}
        tokens = unpack_tokens(blob)
        n = int(f["prompt_len"])
        done = f.get("done") == "1"
        return SessionRecord(sid, tokens[:n], tokens[n:], params_from_json(f.get("params")),
                             int(f.get("max_new") or 0), f.get("device") or None,
                             (f.get("finish") or None) if done else None,
                             int(f.get("epoch") or 0), done, f.get("verify", ""))

    def _read(self, wants: list[DraftWant]) -> list[tuple]:
        pipe = self.redis.pipeline(transaction=True)
        with self._lock:
            devices = [self._device_of.get(w.session_id) or "-" for w in wants]
        for w, device in zip(wants, devices):
            h, tok, draft, br = self.session_keys(w.session_id)
            pipe.hmget(h, "epoch", "idle", "device")
            pipe.strlen(tok)
            pipe.strlen(draft)
            pipe.getrange(draft, 0, 4 * w.k - 1)
            pipe.exists(self.alive_key(device))
            if w.branch_budget:
                pipe.lrange(br, 0, MAX_BRANCHES - 1)
        out = iter(pipe.execute())
        rows = []
        for w in wants:
            row = tuple(next(out) for _ in range(5))
            rows.append(row + (next(out) if w.branch_budget else [],))  # + asked-for branches
        return rows

    @_unavailable_on_redis_errors
    def take_when_ready(self, wants: list[DraftWant], wait_s: float
                        ) -> list[TakenDraft | SessionVanished]:
        """Wait up to ``wait_s`` until every session's draft is ready, then take up to k tokens
        of each. The wait ends early on a pushed chunk (a pub/sub wake-up), and its deadline is
        kept to the millisecond by this process, not by Redis's coarse BLPOP timer."""
        deadline = time.monotonic() + wait_s
        while True:
            seen = self._waker.seq
            rows = self._read(wants)
            ready = all(_ready(row, w.k) for row, w in zip(rows, wants))
            left = deadline - time.monotonic()
            if ready or left <= 0:
                break
            self._waker.wait(seen, left)
        taken: list[TakenDraft | SessionVanished] = []
        for (hm, tok_len, _, draft, _, brs), w in zip(rows, wants):
            if hm[0] is None:
                taken.append(SessionVanished(f"session {w.session_id} vanished from the cache"))
                continue
            tokens = unpack_tokens(draft)
            start = tok_len // 4
            # stored as [absolute position, tokens...]: at is taken from the draft's start
            branches = [Branch(x[0] - start, tuple(x[1:])) for x in map(unpack_tokens, brs)
                        if len(x) > 1]
            taken.append(TakenDraft(int(hm[0]), start, tokens,
                                    take_branches(branches, len(tokens), w.branch_budget)))
        return taken

    @_unavailable_on_redis_errors
    def commit_many(self, verdicts: list[Verdict]) -> list[CommitOutcome]:
        """Apply verdicts in one round trip; a refused one is reported in its slot. Raises
        only ``StoreUnavailable`` (then retry with the same verdicts)."""
        pipe = self.redis.pipeline(transaction=False)
        with self._lock:
            devices = [self._device_of.get(v.session_id, "") for v in verdicts]
        for v, device in zip(verdicts, devices):
            fix = Fix.of_verdict(v, 0).tokens  # the inbox event's, if it is a fix
            self._commit(keys=[*self.session_keys(v.session_id), self.inbox_key(device or "-")],
                         args=[v.epoch, v.n_accepted, pack_tokens([v.token]), int(v.done),
                               self.ttl_s, self.inbox_maxlen, v.session_id, fix[0], v.start,
                               v.finish_reason, pack_tokens(v.branch),
                               ",".join(map(str, fix[1:]))],
                         client=pipe)
        out = []
        for v, res in zip(verdicts, pipe.execute(raise_on_error=False)):
            if isinstance(res, redis.ConnectionError | redis.TimeoutError |
                          redis.exceptions.NoScriptError):
                # the store, not this session: the step is retried
                raise StoreUnavailable(f"the draft cache's Redis: {res}") from res
            if isinstance(res, Exception):
                out.append(CommitOutcome(error=str(res)))
            elif res[0] < 0:
                out.append(CommitOutcome(error=StoreError(res[0], res[1]).args[0]))
            else:
                isfix, epoch, _ = res  # isfix 2: a replay, answered as applied
                out.append(CommitOutcome(Fix.of_verdict(v, epoch) if isfix == 1 else None))
        return out

    def close(self, sid: str, finish_reason: str = "stop", keep_s: int = 120) -> None:
        """Mark a session finished; its keys linger ``keep_s`` for late readers (a client
        resuming to read its last tokens). Never raises: the keys expire by themselves."""
        with self._lock:
            device = self._device_of.pop(sid, "")
        self._queue_fleet_record(sid)
        try:
            pipe = self.redis.pipeline(transaction=True)
            h = self.session_keys(sid)[0]
            pipe.hset(h, mapping={"done": 1, "finish": finish_reason})
            for key in self.session_keys(sid):
                pipe.expire(key, keep_s)
            if device:
                pipe.srem(self.sessions_key(device), sid)
                pipe.xadd(self.inbox_key(device), {"t": "close", "sid": sid},
                          maxlen=self.inbox_maxlen, approximate=True)
            pipe.execute()
        except redis.RedisError as e:
            log.warning("closing session %s in the cache failed (%s); it expires by itself",
                        sid, e)

    def _queue_fleet_record(self, sid: str) -> None:
        if self.fleet is None:
            return
        with self._lock:
            if self._fleet_thread is None:
                self._fleet_thread = threading.Thread(target=self._record_fleet_forever,
                                                      name="fleet-record", daemon=True)
                self._fleet_thread.start()
        try:
            self._fleet_queue.put_nowait(sid)
        except queue.Full:
            log.warning("the fleet table is behind; session %s not recorded in it", sid)

    def _record_fleet_forever(self) -> None:
        while True:
            sid = self._fleet_queue.get()
            if sid is None:
                self._fleet_queue.task_done()
                return
            try:
                self._record_fleet(sid)
            except Exception:  # never lose the thread: the next session is recorded again
                log.exception("recording session %s in the fleet table failed", sid)
            finally:
                self._fleet_queue.task_done()

    def _record_fleet(self, sid: str) -> None:
        """Teach the fleet table a session's committed output (its prompt's tail as leaders)."""
        if self.fleet is None:
            return
        h, tok = self.session_keys(sid)[:2]
        try:
            prompt_len, blob = self.redis.hget(h, "prompt_len"), self.redis.get(tok)
        except redis.RedisError as e:
            log.warning("session %s not recorded in the fleet table: %s", sid, e)
            return
        if prompt_len is None or blob is None:
            return
        record_output(self.fleet, unpack_tokens(blob), int(prompt_len))

    @property
    def _waker(self) -> ChunkWaker:
        with self._lock:
            if self._chunk_waker is None:  # only a verifier waits for chunks
                self._chunk_waker = ChunkWaker(self.redis, self.wake_key)
            return self._chunk_waker

    def shutdown(self) -> None:
        if self._chunk_waker is not None:
            self._chunk_waker.stop()
        with self._lock:
            thread, self._fleet_thread = self._fleet_thread, None
        if thread is not None:  # it records what is queued, then stops
            self._fleet_queue.put(None)
            thread.join(timeout=10)

    # -- the drafters' side (the cache service) ------------------------------------------------
    def push(self, sid: str, epoch: int, start: int, tokens: list[int], idle: bool,
             window: int, branches=()) -> PushResult:
        """Append a chunk (``branches``: alternatives to its tokens, ``at`` relative to it)."""
        brs = []
        for b in chunk_branches(tokens, branches, len(tokens)):
            pos = start + b.at  # stored by absolute position: the draft's start moves
            brs += [pos, pack_tokens([pos, *b.tokens])]
        res = self._push(keys=[*self.session_keys(sid), self.wake_key],
                         args=[epoch, start, pack_tokens(tokens), int(idle), window,
                               MAX_BRANCHES, len(brs) // 2, *brs])
        if res[0] < 0:
            raise StoreError(res[0], res[1])
        return PushResult(int(res[0]), int(res[1]))

    def session_device(self, sid: str) -> str | None:
        dev = self.redis.hget(self.session_keys(sid)[0], "device")
        return None if dev is None else dev.decode()

    def snapshot(self, sid: str) -> SessionSnapshot | None:
        """What a drafter needs to draft for a running session, or None."""
        rec = self._load(sid)
        if rec is None or rec.done:
            return None
        return SessionSnapshot(sid, rec.prompt + rec.committed, rec.params, rec.epoch)

    def device_sessions(self, device: str) -> list[str]:
        """The device's sessions that still exist and are not done (stale ones are dropped)."""
        return self._live_sessions([device])[0]

    def last_event_id(self, device: str) -> str:
        last = self.redis.xrevrange(self.inbox_key(device), count=1)
        return last[0][0].decode() if last else "0-0"

    def read_events(self, device: str, after: str, block_ms: int) -> list[tuple[str, dict]]:
        got = self.redis.xread({self.inbox_key(device): after}, block=block_ms, count=256)
        if not got:
            return []
        return [(eid.decode(), {k.decode(): v.decode() for k, v in fields.items()})
                for eid, fields in got[0][1]]


def _ready(row: tuple, k: int) -> bool:
    if row[0][0] is None:
        return True  # vanished: nothing to wait for
    hm, _, draft_len, _, alive, _ = row
    has_drafter = bool(hm[2]) and alive == 1
    return not has_drafter or hm[1] == b"1" or draft_len // 4 >= k
