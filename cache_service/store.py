"""The draft cache's state in Redis, and the atomic operations on it (Lua scripts).

Keys (prefix ``es:`` by default):

    es:s:{sid}            hash: prompt_len, epoch, device, params (JSON), idle, done
    es:s:{sid}:tok        string: prompt + committed tokens, packed little-endian uint32
    es:s:{sid}:draft      string: the draft beyond the committed tokens, packed the same way
    es:s:{sid}:q          list: one packed sparse q' per draft token (sampled model drafts only)
    es:dev:{id}:inbox     stream: assignment / commit (fix) / close events for a drafter
    es:dev:{id}:alive     string with a short TTL while the drafter's stream is open
    es:dev:{id}:sessions  set: the device's active sessions
    es:devices            hash: device id -> JSON registration
    es:target             hash: the verifier's model, tokenizer fingerprint, vocabulary, window
    es:wake               list: a token per pushed chunk; the verifier blocks on it

Bounds: a draft never exceeds the window, the inbox streams are capped (MAXLEN ~), the wake list
is trimmed, and every session key expires ``ttl_s`` after its last commit, so an abandoned
session disappears by itself.

The verifier's side (``create``, ``take_when_ready``, ``commit_many``, ``close``) is the same
interface as the in-process ``edgespec.session.LocalSessionStore``.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import redis

from edgespec.config import SamplingParams
from edgespec.sampling import SparseQ
from edgespec.session import Fix, TakenDraft, Verdict

PUSH_LUA = """
local h = redis.call('HMGET', KEYS[1], 'epoch', 'done')
if not h[1] then return {-1, 'unknown session'} end
if h[2] == '1' then return {-3, 'session is finished'} end
if tonumber(h[1]) ~= tonumber(ARGV[1]) then
  return {-2, 'chunk from epoch ' .. ARGV[1] .. ', session is at epoch ' .. h[1]}
end
local endpos = redis.call('STRLEN', KEYS[2]) / 4
local dlen = redis.call('STRLEN', KEYS[3]) / 4
if tonumber(ARGV[2]) ~= endpos + dlen then
  return {-4, 'chunk starts at ' .. ARGV[2] .. ', the draft ends at ' .. (endpos + dlen)}
end
local nq = tonumber(ARGV[4])
local qlen = redis.call('LLEN', KEYS[4])
if dlen > 0 and ((nq > 0) ~= (qlen > 0)) then
  return {-5, 'a draft cannot mix sampled and deterministic chunks'}
end
local keep = math.min(string.len(ARGV[3]) / 4, tonumber(ARGV[6]) - dlen)
if keep < 0 then keep = 0 end
if keep > 0 then
  redis.call('APPEND', KEYS[3], string.sub(ARGV[3], 1, keep * 4))
  for i = 1, math.min(keep, nq) do redis.call('RPUSH', KEYS[4], ARGV[6 + i]) end
end
redis.call('HSET', KEYS[1], 'idle', ARGV[5])
redis.call('LPUSH', KEYS[5], '1')
redis.call('LTRIM', KEYS[5], 0, 63)
return {keep, endpos}
"""

COMMIT_LUA = """
local h = redis.call('HMGET', KEYS[1], 'epoch', 'device')
if not h[1] then return {-1, 'unknown session'} end
if tonumber(h[1]) ~= tonumber(ARGV[1]) then return {-2, 'verdict for a stale epoch'} end
local draft = redis.call('GET', KEYS[3]) or ''
local n = tonumber(ARGV[2])
local dlen = string.len(draft) / 4
if n > dlen then return {-4, 'accepted more tokens than were drafted'} end
redis.call('APPEND', KEYS[2], string.sub(draft, 1, n * 4) .. ARGV[3])
local endpos = redis.call('STRLEN', KEYS[2]) / 4
local epoch = tonumber(h[1])
local isfix = 1
if dlen > n and string.sub(draft, n * 4 + 1, n * 4 + 4) == ARGV[3] then
  isfix = 0
  redis.call('SET', KEYS[3], string.sub(draft, n * 4 + 5))
  redis.call('LTRIM', KEYS[4], n + 1, -1)
else
  redis.call('SET', KEYS[3], '')
  redis.call('DEL', KEYS[4])
  epoch = epoch + 1
  redis.call('HSET', KEYS[1], 'epoch', epoch, 'idle', '0')
end
if ARGV[4] == '1' then redis.call('HSET', KEYS[1], 'done', '1') end
if h[2] and h[2] ~= '' then
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[6], '*', 't', 'c', 'sid', ARGV[7],
             'epoch', epoch, 'end', endpos, 'fix', isfix, 'tok', ARGV[8])
end
for i = 1, 4 do redis.call('EXPIRE', KEYS[i], ARGV[5]) end
return {isfix, epoch, endpos}
"""


def pack_tokens(tokens) -> bytes:
    return np.asarray(tokens, dtype="<u4").tobytes()


def unpack_tokens(blob: bytes | None) -> list[int]:
    return np.frombuffer(blob or b"", dtype="<u4").astype(np.int64).tolist()


def pack_q(q: SparseQ) -> bytes:
    return np.asarray(q.ids, dtype="<i4").tobytes() + np.asarray(q.probs, dtype="<f4").tobytes()


def unpack_q(blob: bytes) -> SparseQ:
    m = len(blob) // 8
    ids = np.frombuffer(blob[: 4 * m], dtype="<i4").tolist()
    probs = np.frombuffer(blob[4 * m:], dtype="<f4").astype(np.float64).tolist()
    return SparseQ(ids, probs)


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
class SessionSnapshot:
    session_id: str
    tokens: list[int]
    params: SamplingParams
    epoch: int


class RedisSessionStore:
    def __init__(self, client: redis.Redis, prefix: str = "es:", ttl_s: int = 600,
                 inbox_maxlen: int = 10000, wait_ms: float = 10.0):
        self.r = client
        self.p = prefix
        self.ttl_s = ttl_s
        self.inbox_maxlen = inbox_maxlen
        self.wait_ms = wait_ms
        self._push = client.register_script(PUSH_LUA)
        self._commit = client.register_script(COMMIT_LUA)
        self._device_of: dict[str, str] = {}
        self._reserved: Counter = Counter()
        self._lock = threading.Lock()

    # -- keys ------------------------------------------------------------------------------------
    def _s(self, sid: str) -> list[str]:
        base = f"{self.p}s:{sid}"
        return [base, base + ":tok", base + ":draft", base + ":q"]

    def inbox_key(self, device: str) -> str:
        return f"{self.p}dev:{device}:inbox"

    def alive_key(self, device: str) -> str:
        return f"{self.p}dev:{device}:alive"

    def sessions_key(self, device: str) -> str:
        return f"{self.p}dev:{device}:sessions"

    @property
    def wake_key(self) -> str:
        return f"{self.p}wake"

    # -- target and devices ------------------------------------------------------------------
    def set_target(self, info: dict) -> None:
        self.r.hset(f"{self.p}target", mapping={k: str(v) for k, v in info.items()})

    def target(self) -> dict:
        return {k.decode(): v.decode() for k, v in self.r.hgetall(f"{self.p}target").items()}

    def register_device(self, device: str, info: dict) -> None:
        self.r.hset(f"{self.p}devices", device, json.dumps(info))
        self.mark_alive(device)

    def mark_alive(self, device: str, ttl_ms: int = 5000) -> None:
        self.r.set(self.alive_key(device), "1", px=ttl_ms)

    def mark_gone(self, device: str) -> None:
        self.r.delete(self.alive_key(device))

    def is_alive(self, device: str) -> bool:
        return bool(device) and bool(self.r.exists(self.alive_key(device)))

    def pick_device(self) -> str | None:
        """The attached drafter with the fewest sessions below its own limit, or None.

        The pick is reserved until ``create`` registers the session, so concurrent requests
        spread over the fleet instead of all choosing the same least-loaded device."""
        with self._lock:
            best, best_load = None, None
            for dev, raw in self.r.hgetall(f"{self.p}devices").items():
                dev = dev.decode()
                if not self.is_alive(dev):
                    continue
                load = self.r.scard(self.sessions_key(dev)) + self._reserved[dev]
                limit = json.loads(raw).get("max_sessions") or 1 << 30
                if load < limit and (best_load is None or load < best_load):
                    best, best_load = dev, load
            if best is not None:
                self._reserved[best] += 1
            return best

    def release_pick(self, device: str | None) -> None:
        """Give back a reservation whose session was never created."""
        if device:
            with self._lock:
                if self._reserved[device] > 0:
                    self._reserved[device] -= 1

    # -- the verifier's side -----------------------------------------------------------------
    def create(self, sid: str, prompt: list[int], params: SamplingParams,
               drafter: str | None) -> None:
        h, tok, draft, q = self._s(sid)
        device = drafter or ""
        self._device_of[sid] = device
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(h, tok, draft, q)
        pipe.hset(h, mapping={"prompt_len": len(prompt), "epoch": 0, "device": device,
                              "params": params_to_json(params), "idle": 0, "done": 0})
        pipe.set(tok, pack_tokens(prompt))
        pipe.set(draft, b"")
        for key in (h, tok, draft):
            pipe.expire(key, self.ttl_s)
        if device:
            pipe.sadd(self.sessions_key(device), sid)
            pipe.xadd(self.inbox_key(device), {"t": "a", "sid": sid},
                      maxlen=self.inbox_maxlen, approximate=True)
        pipe.execute()

    def _read(self, wants: list[tuple[str, int, int]]) -> list[tuple]:
        pipe = self.r.pipeline(transaction=True)
        for sid, k, _ in wants:
            h, tok, draft, q = self._s(sid)
            pipe.hmget(h, "epoch", "idle", "device")
            pipe.strlen(tok)
            pipe.strlen(draft)
            pipe.getrange(draft, 0, 4 * k - 1)
            pipe.lrange(q, 0, k - 1)
            pipe.exists(self.alive_key(self._device_of.get(sid) or "-"))
        out = pipe.execute()
        return [tuple(out[i:i + 6]) for i in range(0, len(out), 6)]

    def take_when_ready(self, wants: list[tuple[str, int, int]], wait_s: float
                        ) -> list[TakenDraft]:
        """Wait up to ``wait_s`` until every session's draft is ready, then take up to k tokens
        of each. wants: (session id, k, tokens worth waiting for) triples."""
        deadline = time.monotonic() + wait_s
        while True:
            rows = self._read(wants)
            ready = all(_ready(row, w[2]) for row, w in zip(rows, wants))
            left = deadline - time.monotonic()
            if ready or left <= 0:
                break
            self.r.blpop([self.wake_key], timeout=max(left, 0.001))
        taken = []
        for (hm, tok_len, _, draft, qs, _), (sid, _, _) in zip(rows, wants):
            if hm[0] is None:
                raise KeyError(f"session {sid} vanished from the cache")
            tokens = unpack_tokens(draft)
            q = [unpack_q(b) for b in qs] if qs else None
            taken.append(TakenDraft(int(hm[0]), tok_len // 4, tokens,
                                    q[: len(tokens)] if q else None))
        return taken

    def commit_many(self, verdicts: list[Verdict]) -> list[Fix | None]:
        pipe = self.r.pipeline(transaction=False)
        for v in verdicts:
            device = self._device_of.get(v.session_id, "")
            self._commit(keys=[*self._s(v.session_id), self.inbox_key(device or "-")],
                         args=[v.epoch, v.n_accepted, pack_tokens([v.token]), int(v.done),
                               self.ttl_s, self.inbox_maxlen, v.session_id, v.token],
                         client=pipe)
        fixes = []
        for v, res in zip(verdicts, pipe.execute()):
            if res[0] < 0:
                raise StoreError(res[0], res[1])
            isfix, epoch, end = res
            fixes.append(Fix(0, epoch, end - 1, v.token) if isfix else None)
        return fixes

    def close(self, sid: str, keep_s: int = 60) -> None:
        """Mark a session finished; its keys linger ``keep_s`` for late readers."""
        device = self._device_of.pop(sid, "")
        pipe = self.r.pipeline(transaction=True)
        h = self._s(sid)[0]
        pipe.hset(h, "done", 1)
        for key in self._s(sid):
            pipe.expire(key, keep_s)
        if device:
            pipe.srem(self.sessions_key(device), sid)
            pipe.xadd(self.inbox_key(device), {"t": "x", "sid": sid},
                      maxlen=self.inbox_maxlen, approximate=True)
        pipe.execute()

    # -- the drafters' side (the cache service) ------------------------------------------------
    def push(self, sid: str, epoch: int, start: int, tokens: list[int],
             q: list[SparseQ] | None, idle: bool, window: int) -> PushResult:
        qs = [pack_q(x) for x in q] if q else []
        res = self._push(keys=[*self._s(sid), self.wake_key],
                         args=[epoch, start, pack_tokens(tokens), len(qs), int(idle), window, *qs])
        if res[0] < 0:
            raise StoreError(res[0], res[1])
        return PushResult(int(res[0]), int(res[1]))

    def session_device(self, sid: str) -> str | None:
        dev = self.r.hget(self._s(sid)[0], "device")
        return None if dev is None else dev.decode()

    def snapshot(self, sid: str) -> SessionSnapshot | None:
        h, tok, _, _ = self._s(sid)
        pipe = self.r.pipeline(transaction=True)
        pipe.hmget(h, "epoch", "params", "done")
        pipe.get(tok)
        (epoch, params, done), blob = pipe.execute()
        if epoch is None or done == b"1":
            return None
        return SessionSnapshot(sid, unpack_tokens(blob), params_from_json(params), int(epoch))

    def device_sessions(self, device: str) -> list[str]:
        return sorted(s.decode() for s in self.r.smembers(self.sessions_key(device)))

    def last_event_id(self, device: str) -> str:
        last = self.r.xrevrange(self.inbox_key(device), count=1)
        return last[0][0].decode() if last else "0-0"

    def read_events(self, device: str, after: str, block_ms: int) -> list[tuple[str, dict]]:
        got = self.r.xread({self.inbox_key(device): after}, block=block_ms, count=256)
        if not got:
            return []
        return [(eid.decode(), {k.decode(): v.decode() for k, v in fields.items()})
                for eid, fields in got[0][1]]


def _ready(row: tuple, k: int) -> bool:
    hm, _, draft_len, _, _, alive = row
    has_drafter = bool(hm[2]) and alive == 1
    return not has_drafter or hm[1] == b"1" or draft_len // 4 >= k
