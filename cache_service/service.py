"""The DraftCache gRPC service: the drafters' only door to the session state in Redis.

Each drafter holds one ``Attach`` stream. The first message registers it (device id, draft model,
tokenizer fingerprint); a fingerprint that differs from the target's is refused with
FAILED_PRECONDITION. The cache then sends the device's current sessions (a snapshot, so a drafter
that reconnects resumes where the cache stands), and from then on every event of the device's
inbox stream in Redis: new assignments, commits (fixes among them), closed sessions. Chunks the
drafter sends are checked and pushed atomically; each is answered with a ``ChunkAck`` whose code
is a gRPC status code (FAILED_PRECONDITION for a stale epoch or a misplaced chunk). A newer
stream for the same device id replaces an older one.
"""

from __future__ import annotations

import logging
import queue
import threading

import grpc

from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc
from edgespec.wire import params_to_pb, q_from_pb

from .store import RedisSessionStore, StoreError

log = logging.getLogger("edgespec.cache")

DEVICE_METADATA = "x-edgespec-device"
_CODES = {"unknown": grpc.StatusCode.NOT_FOUND, "stale": grpc.StatusCode.FAILED_PRECONDITION,
          "finished": grpc.StatusCode.FAILED_PRECONDITION,
          "position": grpc.StatusCode.FAILED_PRECONDITION,
          "mixed": grpc.StatusCode.INVALID_ARGUMENT}


class ChunkRefused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class DraftCacheService(pb_grpc.DraftCacheServicer):
    def __init__(self, store: RedisSessionStore, window: int = 16, chunk: int = 4,
                 poll_ms: int = 1000):
        self.store, self.window, self.chunk, self.poll_ms = store, window, chunk, poll_ms
        self._lock = threading.Lock()
        self._generation: dict[str, int] = {}
        self._stopping = threading.Event()

    def stop(self) -> None:
        self._stopping.set()

    # -- chunks ---------------------------------------------------------------------------------
    def _check_and_push(self, device: str, chunk: pb.DraftChunk, vocab: int) -> pb.ChunkAck:
        owner = self.store.session_device(chunk.session_id)
        if owner is None:
            raise ChunkRefused(grpc.StatusCode.NOT_FOUND, f"unknown session {chunk.session_id!r}")
        if owner != device:
            raise ChunkRefused(grpc.StatusCode.FAILED_PRECONDITION,
                               f"session {chunk.session_id} is not assigned to {device!r}")
        tokens = list(chunk.tokens)
        if any(not 0 <= t < vocab for t in tokens):
            raise ChunkRefused(grpc.StatusCode.INVALID_ARGUMENT,
                               f"draft token ids must be in [0, {vocab})")
        q = q_from_pb(chunk.q)
        if q is not None:
            _check_q(q, tokens, vocab)
        try:
            res = self.store.push(chunk.session_id, chunk.epoch, chunk.start, tokens, q,
                                  chunk.idle, self.window)
        except StoreError as e:
            raise ChunkRefused(_CODES.get(e.kind, grpc.StatusCode.INTERNAL), str(e)) from None
        return pb.ChunkAck(session_id=chunk.session_id, start=chunk.start, kept=res.kept,
                           committed_end=res.committed_end, code=grpc.StatusCode.OK.value[0])

    def _vocab(self) -> int:
        return int(self.store.target().get("vocab_size", 1 << 31))

    def PushDraft(self, request, context):
        device = dict(context.invocation_metadata()).get(DEVICE_METADATA, "")
        try:
            return self._check_and_push(device, request, self._vocab())
        except ChunkRefused as e:
            context.abort(e.code, str(e))

    # -- the attach stream ------------------------------------------------------------------------
    def Attach(self, request_iterator, context):
        first = next(request_iterator, None)
        if first is None or not first.HasField("register"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be Register")
        reg = first.register
        if not reg.device_id or len(reg.device_id) > 128:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "device_id must be 1-128 characters")
        target = self.store.target()
        if not target:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no verifier has registered a target yet")
        if reg.tokenizer_fingerprint and reg.tokenizer_fingerprint != target["fingerprint"]:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"drafter tokenizer {reg.tokenizer_fingerprint} differs from the "
                          f"target's {target['fingerprint']} ({target.get('model', '')})")
        device = reg.device_id
        with self._lock:
            gen = self._generation.get(device, 0) + 1
            self._generation[device] = gen
        self.store.register_device(device, {"draft_model": reg.draft_model,
                                            "max_sessions": reg.max_sessions})
        log.info("drafter %s attached (%s)", device, reg.draft_model)
        vocab = int(target.get("vocab_size", 1 << 31))
        out: queue.Queue = queue.Queue()
        stop = threading.Event()
        context.add_callback(stop.set)
        out.put(pb.CacheMessage(registered=pb.Registered(
            target_model=target.get("model", ""), tokenizer_fingerprint=target["fingerprint"],
            window=self.window, chunk=self.chunk, vocab_size=vocab)))
        after = self.store.last_event_id(device)
        for sid in self.store.device_sessions(device):
            msg = self._assignment(sid)
            if msg is not None:
                out.put(msg)
        threading.Thread(target=self._read_chunks, daemon=True, name=f"chunks-{device}",
                         args=(request_iterator, device, vocab, out, stop)).start()
        threading.Thread(target=self._pump_events, daemon=True, name=f"events-{device}",
                         args=(device, gen, after, out, stop)).start()
        try:
            while not stop.is_set():
                try:
                    msg = out.get(timeout=0.5)
                except queue.Empty:
                    continue
                if msg is None:
                    break
                yield msg
        finally:
            stop.set()
            with self._lock:
                current = self._generation.get(device) == gen
            if current:
                self.store.mark_gone(device)
                log.info("drafter %s detached", device)

    def _read_chunks(self, it, device, vocab, out, stop) -> None:
        try:
            for msg in it:
                if not msg.HasField("chunk"):
                    continue
                try:
                    ack = self._check_and_push(device, msg.chunk, vocab)
                except ChunkRefused as e:
                    ack = pb.ChunkAck(session_id=msg.chunk.session_id, start=msg.chunk.start,
                                      code=e.code.value[0], message=str(e))
                out.put(pb.CacheMessage(ack=ack))
        except grpc.RpcError:
            pass  # the drafter went away
        except Exception:
            log.exception("drafter %s: reading chunks failed", device)
        finally:
            stop.set()
            out.put(None)

    def _pump_events(self, device, gen, after, out, stop) -> None:
        try:
            while not stop.is_set() and not self._stopping.is_set():
                with self._lock:
                    if self._generation.get(device) != gen:
                        break  # a newer stream took this device over
                self.store.mark_alive(device, ttl_ms=self.poll_ms * 5)
                for eid, ev in self.store.read_events(device, after, self.poll_ms):
                    after = eid
                    msg = self._event_message(ev)
                    if msg is not None:
                        out.put(msg)
        except Exception:
            log.exception("drafter %s: reading events failed", device)
        finally:
            stop.set()
            out.put(None)

    def _assignment(self, sid: str) -> pb.CacheMessage | None:
        snap = self.store.snapshot(sid)
        if snap is None:
            return None
        return pb.CacheMessage(assignment=pb.Assignment(
            session_id=sid, tokens=snap.tokens, sampling=params_to_pb(snap.params),
            epoch=snap.epoch))

    def _event_message(self, ev: dict) -> pb.CacheMessage | None:
        kind, sid = ev.get("t"), ev.get("sid", "")
        if kind == "a":
            return self._assignment(sid)
        if kind == "x":
            return pb.CacheMessage(closed=pb.SessionClosed(session_id=sid))
        if kind == "c":
            end = int(ev["end"])
            fix = ev["fix"] == "1"
            return pb.CacheMessage(commit=pb.Commit(
                session_id=sid, epoch=int(ev["epoch"]), committed_end=end, is_fix=fix,
                fix_position=end - 1 if fix else 0, fix_token=int(ev["tok"]) if fix else 0))
        return None


def _check_q(q, tokens: list[int], vocab: int) -> None:
    if len(q) != len(tokens):
        raise ChunkRefused(grpc.StatusCode.INVALID_ARGUMENT, "a chunk needs one q' per token")
    for tok, x in zip(tokens, q):
        if len(x.ids) != len(x.probs) or not x.ids or len(x.ids) > 1024:
            raise ChunkRefused(grpc.StatusCode.INVALID_ARGUMENT, "q' needs 1-1024 ids and probs")
        if any(not 0 <= i < vocab for i in x.ids) or any(p < 0 for p in x.probs):
            raise ChunkRefused(grpc.StatusCode.INVALID_ARGUMENT, "q' ids or probabilities out of range")
        if abs(sum(x.probs) - 1) > 1e-3:
            raise ChunkRefused(grpc.StatusCode.INVALID_ARGUMENT, "q' probabilities must sum to 1")
        if tok not in x.ids:
            raise ChunkRefused(grpc.StatusCode.INVALID_ARGUMENT, "a drafted token is outside its q'")
