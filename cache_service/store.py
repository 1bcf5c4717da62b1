"""The draft cache's session state in Redis and the atomic operations on it (Lua scripts,
``store_lua``): the verifier's side (``create``, ``take_when_ready``, ``commit_many``, ``close``:
``edgespec.protocol.contract.SessionStore``, as the in-process ``LocalSessionStore``) and the
drafters' (``push``, ``snapshot``, their inbox events), over the key layout of ``codec``. The
drafters themselves are ``devices``'s; closed sessions teach the fleet table through
``fleet_recorder``; a pushed chunk wakes a waiting verifier through ``chunk_waker``.

Bounds: a draft never exceeds the window, the inbox streams are capped (MAXLEN ~), and every
session key expires ``ttl_s`` after its last commit (the expiry moves on with the commits that
cross a multiple of 16 tokens), so an abandoned session disappears by itself.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from typing import Any, Mapping, Sequence

import redis

from edgespec.config import SamplingParams
from edgespec.protocol.lineage import Lineage
from edgespec.protocol.contract import (MAX_BRANCHES, Branch, CommitOutcome, DraftWant, Fix,
                               SessionVanished, StoreUnavailable, TakenDraft, Verdict,
                               take_branches)

from .chunk_waker import ChunkWaker
from .codec import (InboxEvent, KeyLayout, pack_tokens, params_from_json, params_to_json,
                    raises_store_unavailable, text, unpack_tokens)
from .devices import DeviceRegistry, HandOver
from .fleet_recorder import FleetRecorder
from .fleet_table import RedisFleetTable
from .store_lua import COMMIT_MANY_LUA, PUSH_MANY_LUA, TAKE_MANY_LUA
from .store_records import (COMMIT_REPLY, INT, TAKE_HEADER, ChunkPush, DraftRow, PushResult,
                            SessionRecord, SessionSnapshot, StoreError, packed_chunk,
                            packed_verdict)

log = logging.getLogger("edgespec.cache")


class RedisSessionStore:
    def __init__(self, client: redis.Redis, prefix: str = "es:", ttl_s: int = 600,
                 inbox_maxlen: int = 10000, wait_ms: float = 10.0,
                 fleet_leaders: int = 1 << 17):
        self.redis = client
        self.keys = KeyLayout(prefix)
        self.devices = DeviceRegistry(client, self.keys, ttl_s)
        # the fleet-wide Cacheback table, taught every closed session's output
        self.fleet = RedisFleetTable(client, prefix, fleet_leaders) if fleet_leaders else None
        self._recorder = FleetRecorder(client, self.keys, self.fleet) if self.fleet else None
        self.ttl_s = ttl_s
        self.inbox_maxlen = inbox_maxlen
        self.wait_ms = wait_ms
        self._push_many = client.register_script(PUSH_MANY_LUA)
        # the step's two scripts on a connection of their own, taken from the pool once: one
        # taken and given back at each call (with its checks and events) cost a one-session
        # step ~60-125 us here (bench-host --stores redis --sessions 1, its commit stage)
        self._step_client = redis.Redis(connection_pool=client.connection_pool,
                                        single_connection_client=True)
        self._commit_many = self._step_client.register_script(COMMIT_MANY_LUA)
        self._take_many = self._step_client.register_script(TAKE_MANY_LUA)
        self._device_of: dict[str, str] = {}
        # (epoch, committed end) of the sessions this process created, as its own commits left
        # them (only a commit moves them; a board's chunks never do): a step that asks a session
        # for nothing (a server serving it alone, or a planner that finds its board's drafts do
        # not pay) takes its empty draft from here, without a round trip; any doubt (a refused
        # or lost commit) drops the entry until a commit of it lands again
        self._known: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()
        self._chunk_waker: ChunkWaker | None = None

    # -- target and devices ------------------------------------------------------------------
    def set_target(self, info: dict) -> None:
        self.redis.hset(self.keys.target, mapping={k: str(v) for k, v in info.items()})

    def ensure_target(self, info: dict) -> None:
        """Register the target again if Redis lost it (a restart without persistence)."""
        if not self.redis.exists(self.keys.target):
            self.set_target(info)

    def target(self) -> dict:
        raw = self.redis.hgetall(self.keys.target)
        return {text(k): text(v) for k, v in raw.items()}

    # -- the verifier's side -----------------------------------------------------------------
    @raises_store_unavailable
    def create(self, sid: str, prompt: list[int], params: SamplingParams,
               drafter: str | None, max_new_tokens: int = 0,
               committed: Sequence[int] = (), verify: str = "exact",
               lineage: Lineage = Lineage()) -> None:
        """A new session, or (``committed`` given) one resumed from its committed output: the
        epoch moves past any earlier one, so chunks drafted before the resume are refused.
        ``lineage``: the kernel set whose decoding its output is, kept for its resumes."""
        h, tok, draft, br = self.keys.session(sid)
        device = drafter or ""
        with self._lock:  # what an earlier session of this id left is no longer known
            self._known.pop(sid, None)
        old_epoch = self.redis.hget(h, "epoch")
        epoch = int(old_epoch) + 1 if old_epoch is not None else 0
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(h, tok, draft, br)
        pipe.hset(h, mapping={"prompt_len": len(prompt), "epoch": epoch, "device": device,
                              "params": params_to_json(params), "idle": 0, "done": 0,
                              "max_new": max_new_tokens, "finish": "", "verify": verify,
                              "kernels": lineage.kernels, "differs": lineage.differs_from})
        pipe.set(tok, pack_tokens(list(prompt) + list(committed)))
        pipe.set(draft, b"")
        for key in (h, tok, draft):
            pipe.expire(key, self.ttl_s)
        if device:
            pipe.sadd(self.keys.sessions(device), sid)
            pipe.expire(self.keys.sessions(device), self.ttl_s)
            pipe.xadd(self.keys.inbox(device), InboxEvent("assign", sid).fields(),
                      maxlen=self.inbox_maxlen, approximate=True)
        pipe.execute()
        with self._lock:
            self._device_of[sid] = device
            self._known[sid] = (epoch, len(prompt) + len(committed))

    @raises_store_unavailable
    def load(self, sid: str) -> SessionRecord | None:
        """A session as the cache holds it (for resuming it), or None if it is gone."""
        return self._load(sid)

    def _load(self, sid: str) -> SessionRecord | None:
        h, tok = self.keys.session(sid)[:2]
        pipe = self.redis.pipeline(transaction=True)
        pipe.hgetall(h)
        pipe.get(tok)
        fields, blob = pipe.execute()
        if not fields or b"prompt_len" not in fields:
            return None
        f = {k.decode(): v.decode() for k, v in fields.items()}
        tokens = unpack_tokens(blob)
        n = int(f["prompt_len"])
        if len(tokens) < max(n, 1):  # its tokens' key is gone (evicted, deleted): so is it
            return None
        done = f.get("done") == "1"
        return SessionRecord(sid, tokens[:n], tokens[n:], params_from_json(f.get("params")),
                             int(f.get("max_new") or 0), f.get("device") or None,
                             (f.get("finish") or None) if done else None,
                             int(f.get("epoch") or 0), done, f.get("verify", ""),
                             Lineage(f.get("kernels", ""), int(f.get("differs") or 0)))

    def _read(self, wants: list[DraftWant]) -> list[DraftRow]:
        """Each wanted session's state, read by one script (``TAKE_MANY_LUA``)."""
        if not wants:
            return []
        packed = b"".join(struct.pack("<iii", 4 * w.k, MAX_BRANCHES if w.branch_budget else 0,
                                      len(sid)) + sid
                          for w in wants for sid in (w.session_id.encode(),))
        blob = self._take_many(args=[self.keys.prefix, packed])
        rows, at = [], 0
        for _ in wants:
            epoch, idle, tok_len, drafting, got = TAKE_HEADER.unpack_from(blob, at)
            at += TAKE_HEADER.size
            draft = blob[at:at + got]
            at += got
            (nbr,), at = INT.unpack_from(blob, at), at + INT.size
            branches = []
            for _ in range(nbr):
                (size,), at = INT.unpack_from(blob, at), at + INT.size
                branches.append(blob[at:at + size])
                at += size
            rows.append(DraftRow(None if epoch < 0 else epoch, idle == 1, drafting == 1,
                                  tok_len // 4, got // 4, draft, branches))
        return rows

    @raises_store_unavailable
    def take_when_ready(self, wants: list[DraftWant], wait_s: float
                        ) -> list[TakenDraft | SessionVanished]:
        """Wait up to ``wait_s`` until every session's draft is ready (those not to wait for
        aside), then take up to k tokens of each. The wait ends early on a pushed chunk (a
        pub/sub wake-up), and its deadline is kept to the millisecond by this process, not by
        Redis's coarse BLPOP timer. A session is waited for at most its own ``wait_s``. A
        session this process created and asks for nothing is answered from what its last
        commit here returned (a board's chunks move neither its epoch nor its end)."""
        with self._lock:
            known = [None if w.k or w.branch_budget else self._known.get(w.session_id)
                     for w in wants]
        asked = [w for w, at in zip(wants, known) if at is None]
        rows = iter(self._take_rows(asked, wait_s) if asked else ())
        taken: list[TakenDraft | SessionVanished] = []
        for w, at in zip(wants, known):
            if at is not None:
                taken.append(TakenDraft(at[0], at[1], [], [], ready=True))
                continue
            row = next(rows)
            if row.epoch is None:
                taken.append(SessionVanished(f"session {w.session_id} vanished from the cache"))
                continue
            tokens, start = unpack_tokens(row.draft), row.committed_end
            # stored as [absolute position, tokens...]: at is taken from the draft's start
            branches = [Branch(x[0] - start, tuple(x[1:]))
                        for x in map(unpack_tokens, row.branches) if len(x) > 1]
            taken.append(TakenDraft(row.epoch, start, tokens,
                                    take_branches(branches, len(tokens), w.branch_budget),
                                    ready=row.ready(w.k), drafting=row.drafting))
        return taken

    def _take_rows(self, wants: list[DraftWant], wait_s: float) -> list[DraftRow]:
        """``take_when_ready``'s wait and read: the sessions as Redis holds them once every
        draft waited for is ready or its time is up. Each wake-up (a pushed chunk, naming its
        session) reads again only the sessions still waited for that it names: a draft only
        grows until this verifier commits, and only a push, which wakes, grows it; so a step
        waiting for many boards reads each session about once, not once a chunk of any board.
        A wake-up that names none (a lost subscription) reads every session waited for."""
        now = time.monotonic()
        until = [w.waits_until(now + wait_s, now) for w in wants]
        seen = self._waker.seq  # before the read: a chunk pushed during it wakes the wait
        rows = self._read(wants)
        while True:
            now = time.monotonic()
            pending = [i for i in range(len(wants)) if wants[i].wait and until[i] > now
                       and not rows[i].ready(wants[i].k)]
            if not pending:
                return rows
            self._waker.wait(seen, min(until[i] for i in pending) - now)
            woken, seen = self._waker.woken_since(seen)
            todo = pending if woken is None else \
                [i for i in pending if self.keys.session(wants[i].session_id)[0] in woken]
            for i, row in zip(todo, self._read([wants[i] for i in todo])):
                rows[i] = row

    @raises_store_unavailable
    def commit_many(self, verdicts: list[Verdict]) -> list[CommitOutcome]:
        """Apply verdicts in one script (``COMMIT_MANY_LUA``), in one round trip; a refused
        one is reported in its slot. Raises only ``StoreUnavailable`` (then retry with the same
        verdicts: one that landed is recognised as a replay)."""
        if not verdicts:
            return []
        packed = b"".join(map(packed_verdict, verdicts))
        try:
            replies, messages = self._commit_many(
                args=[self.ttl_s, self.inbox_maxlen, self.keys.prefix, packed])
        except BaseException:  # landed or not: what this process knew of them is in doubt
            self._forget(verdicts)
            raise
        full = [m for m in messages if "OOM command not allowed" in text(m)]  # any version's
        if full:  # Redis refuses writes (maxmemory, noeviction): an outage, not the sessions'
            # a script is refused for memory only before its first write: nothing landed
            self._forget(verdicts)
            raise StoreUnavailable(f"the draft cache's Redis is out of memory (its maxmemory): "
                                   f"{text(full[0])}")
        out = []
        with self._lock:
            for v, (code, epoch, end) in zip(verdicts, COMMIT_REPLY.iter_unpack(replies)):
                if code < 0:  # epoch: the message's index
                    out.append(CommitOutcome(error=StoreError(code, messages[epoch - 1])
                                             .args[0]))
                else:  # code 2: a replay, answered as applied
                    out.append(CommitOutcome(Fix.of_verdict(v, epoch) if code == 1 else None))
                if code >= 0 and not v.done:
                    self._known[v.session_id] = (epoch, end)
                else:
                    self._known.pop(v.session_id, None)
        return out

    def _forget(self, verdicts: list[Verdict]) -> None:
        with self._lock:
            for v in verdicts:
                self._known.pop(v.session_id, None)

    def close(self, sid: str, finish_reason: str = "stop", keep_s: int = 120) -> None:
        """Mark a session finished; its keys linger ``keep_s`` for late readers (a client
        resuming to read its last tokens). Never raises: the keys expire by themselves."""
        self.close_many({sid: finish_reason}, keep_s)

    def close_many(self, finished: Mapping[str, str], keep_s: int = 120) -> None:
        """``close`` of each session (id -> finish reason), in one round trip (one
        transaction): a step whose sessions end together waited for one each (~1.3 ms here)."""
        devices = {}
        with self._lock:
            for sid in finished:
                devices[sid] = self._device_of.pop(sid, "")
                self._known.pop(sid, None)
        if self._recorder is not None:
            for sid in finished:
                self._recorder.record(sid)
        try:
            pipe = self.redis.pipeline(transaction=True)
            for sid, finish_reason in finished.items():
                keys = self.keys.session(sid)
                pipe.hset(keys[0], mapping={"done": 1, "finish": finish_reason})
                for key in keys:
                    pipe.expire(key, keep_s)
                if device := devices[sid]:
                    pipe.srem(self.keys.sessions(device), sid)
                    pipe.xadd(self.keys.inbox(device), InboxEvent("close", sid).fields(),
                              maxlen=self.inbox_maxlen, approximate=True)
            pipe.execute()
        except redis.RedisError as e:
            log.warning("closing %d session(s) in the cache (%s%s) failed (%s); they expire by "
                        "themselves", len(finished), ", ".join(list(finished)[:4]),
                        ", ..." if len(finished) > 4 else "", e)

    @property
    def _waker(self) -> ChunkWaker:
        with self._lock:
            if self._chunk_waker is None:  # only a verifier waits for chunks
                self._chunk_waker = ChunkWaker(self.redis, self.keys.wake)
            return self._chunk_waker

    def finish_recording(self) -> None:
        """Wait until the sessions closed so far are recorded in the fleet table."""
        if self._recorder is not None:
            self._recorder.wait_idle()

    def shutdown(self) -> None:
        self._step_client.close()  # its connection back to the pool
        if self._chunk_waker is not None:
            self._chunk_waker.stop()
        if self._recorder is not None:
            self._recorder.stop()  # it records what is queued, then stops

    # -- the drafters' side (the cache service) ------------------------------------------------
    def push(self, sid: str, epoch: int, start: int, tokens: list[int], idle: bool,
             window: int, branches=(), device: str = "") -> PushResult:
        """Append a chunk (``branches``: alternatives to its tokens, ``at`` relative to it);
        ``device`` given: only if the session is that device's (else ``StoreError`` of kind
        "device"), checked in the same script."""
        return self.push_chunk(ChunkPush.of(sid, epoch, start, tokens, idle, window, branches,
                                            device))

    def push_chunk(self, chunk: ChunkPush) -> PushResult:
        """``push_many`` of one chunk; raises its ``StoreError`` when refused."""
        res = self.push_many([chunk])[0]
        if isinstance(res, StoreError):
            raise res
        return res

    def push_many(self, chunks: Sequence[ChunkPush]) -> list[PushResult | StoreError]:
        """Append several chunks in one round trip, in order, each as ``push`` would: its
        outcome, or its refusal (a failure of the script on one chunk, as kind "error"), apart;
        raises ``redis.RedisError`` when Redis cannot be reached. A chunk whose numbers do not
        fit the script's (``chunk_checks`` refuses such chunks first) is refused alone, as kind
        "error", and not sent."""
        out: list[PushResult | StoreError | None] = [None] * len(chunks)
        packed = []
        for i, c in enumerate(chunks):
            try:
                packed.append(packed_chunk(c, MAX_BRANCHES))
            except (struct.error, OverflowError) as e:
                out[i] = StoreError(-7, f"the chunk cannot be stored: {e}")
        replies: Any = self._push_many(args=[self.keys.prefix, self.keys.wake,
                                             b"".join(packed)]) if packed else []
        answers = iter(replies)
        for i, o in enumerate(out):
            if o is None:
                a, b, *news = next(answers)  # (kept, committed end, news), or a refusal's
                out[i] = PushResult(int(a), int(b), bool(int(news[0]))) if int(a) >= 0 \
                    else StoreError(int(a), b)
        return out  # type: ignore[return-value]  # every chunk answered by now

    @raises_store_unavailable
    def hand_over(self, sid: str, device: str, previous: str = "") -> HandOver:
        """``DeviceRegistry.hand_over`` of a session this verifier runs (its close then goes
        to the drafter the cache names)."""
        got = self.devices.hand_over(sid, device, previous, self.inbox_maxlen)
        if got.owner is not None:
            with self._lock:
                self._device_of[sid] = got.owner
        return got

    def session_device(self, sid: str) -> str | None:
        dev = self.redis.hget(self.keys.session(sid)[0], "device")
        return None if dev is None else text(dev)

    def snapshot(self, sid: str) -> SessionSnapshot | None:
        """What a drafter needs to draft for a running session, or None."""
        rec = self._load(sid)
        if rec is None or rec.done:
            return None
        # not said for a loose session: its drafts past the end may confirm a mismatch before
        # it (verify.loose's window)
        said = rec.max_new_tokens > 0 and rec.verify != "loose"
        return SessionSnapshot(sid, rec.prompt + rec.committed, rec.params, rec.epoch,
                               len(rec.prompt) + rec.max_new_tokens if said else None)

    def told_afresh(self, sid: str) -> None:
        """A board that attaches is sent the session whole (``snapshot``), told nothing of a
        rest: the commits that ask it nothing reach it again until it is told of one (the commit
        script's ``rest``, ``hush`` and ``hushep`` fields forgotten)."""
        self.redis.hdel(self.keys.session(sid)[0], "rest", "hush", "hushep")

    def last_event_id(self, device: str) -> str:
        last: Any = self.redis.xrevrange(self.keys.inbox(device), count=1)
        return text(last[0][0]) if last else "0-0"

    def read_inboxes(self, afters: Mapping[str, str], block_ms: int
                     ) -> dict[str, list[tuple[str, InboxEvent | None]]]:
        """``read_events`` of several devices in one read (device -> the id read after):
        what each device's inbox holds after it, by device (none: not listed)."""
        keys = {self.keys.inbox(d): d for d in afters}
        # [[stream, [(id, {field: value})]]] (redis-py types a reply as a union of shapes)
        got: Any = self.redis.xread({k: afters[d] for k, d in keys.items()}, block=block_ms,
                                    count=256)
        return {keys[text(key)]: [(text(eid), InboxEvent.parse(
                    {text(k): text(v) for k, v in fields.items()})) for eid, fields in entries]
                for key, entries in (got or [])}

    def read_events(self, device: str, after: str, block_ms: int
                    ) -> list[tuple[str, InboxEvent | None]]:
        """The inbox entries after ``after``: (entry id, its event; None: a kind this version
        does not know, skipped by the reader)."""
        return self.read_inboxes({device: after}, block_ms).get(device, [])
