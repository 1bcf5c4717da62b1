"""The edge drafter agent: attach to the draft cache, draft for assigned sessions, apply fixes.

One bidirectional ``Attach`` stream carries everything. A receiver thread applies what the cache
sends (assignments open draft sessions, commits move the committed position, fixes roll a
session back and append the verifier's token, closes end sessions); a drafting thread drafts
ahead for every session with room in its window (W tokens beyond the committed position), in
chunks of c tokens, tagging each chunk with its epoch and start position, and never waits for a
verdict. When the link drops, the agent forgets its sessions, waits with exponential backoff and
attaches again; the cache then sends the current state of its sessions.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
from dataclasses import dataclass

import grpc

from edgespec.config import ConfigError
from edgespec.drafters import Drafter, DraftSession
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc
from edgespec.wire import auth_metadata, make_channel, params_from_pb, q_to_pb

log = logging.getLogger("edgespec.drafter")

FATAL = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION,
         grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED}


@dataclass
class _Session:
    draft: DraftSession
    epoch: int
    committed_end: int
    idle: bool = False


class DrafterAgent:
    def __init__(self, cache: str, device_id: str, drafter: Drafter, fingerprint: str = "",
                 window: int | None = None, chunk: int | None = None, token: str | None = None,
                 tls_ca: str | None = None, tls: bool = False, max_sessions: int = 8,
                 backoff_max_s: float = 10.0):
        self.cache, self.device_id, self.drafter = cache, device_id, drafter
        self.fingerprint = fingerprint
        self.window, self.chunk = window, chunk
        self.token, self.tls_ca, self.tls = token, tls_ca, tls
        self.max_sessions = max_sessions
        self.backoff_max_s = backoff_max_s
        self.sessions: dict[str, _Session] = {}
        self.cond = threading.Condition()
        self.stopping = threading.Event()
        self.connected = threading.Event()
        self.attaches = 0  # successful registrations, reconnections included
        self.chunks_sent = 0

    # -- lifecycle ------------------------------------------------------------------------------
    def stop(self) -> None:
        self.stopping.set()
        with self.cond:
            self.cond.notify_all()

    def run(self) -> None:
        """Attach, serve, and re-attach with backoff until stopped or refused for good."""
        delay = 0.2
        while not self.stopping.is_set():
            try:
                self._attach_once()
                delay = 0.2
            except grpc.RpcError as e:
                if e.code() in FATAL:
                    raise ConfigError(f"the cache refused drafter {self.device_id!r}: "
                                      f"{e.details()}") from None
                log.warning("link to %s lost (%s); retrying in %.1fs", self.cache,
                            e.code().name, delay)
            finally:
                self.connected.clear()
                self._forget_sessions()
            if self.stopping.wait(delay * (0.8 + 0.4 * random.random())):
                break
            delay = min(self.backoff_max_s, delay * 2)

    def _attach_once(self) -> None:
        channel = make_channel(self.cache, self.tls_ca, self.tls)
        out: queue.Queue = queue.Queue()
        out.put(pb.DrafterMessage(register=pb.Register(
            device_id=self.device_id, draft_model=self.drafter.name,
            tokenizer_fingerprint=self.fingerprint, max_sessions=self.max_sessions)))

        def outgoing():
            while True:
                msg = out.get()
                if msg is None:
                    return
                yield msg

        stub = pb_grpc.DraftCacheStub(channel)
        responses = stub.Attach(outgoing(), metadata=auth_metadata(self.token))
        drafting = threading.Thread(target=self._draft_loop, args=(out,), daemon=True,
                                    name=f"draft-{self.device_id}")
        try:
            for msg in responses:
                if self.stopping.is_set():
                    break
                self._apply(msg)
                if msg.HasField("registered") and not drafting.is_alive():
                    drafting.start()
        finally:
            out.put(None)
            with self.cond:
                self.connected.clear()
                self.cond.notify_all()
            responses.cancel()
            channel.close()
            if drafting.is_alive():
                drafting.join(timeout=5)

    def _forget_sessions(self) -> None:
        with self.cond:
            for s in self.sessions.values():
                s.draft.close()
            self.sessions.clear()

    # -- what the cache sends ---------------------------------------------------------------------
    def _apply(self, msg: pb.CacheMessage) -> None:
        kind = msg.WhichOneof("kind")
        with self.cond:
            if kind == "registered":
                reg = msg.registered
                self.window = self.window or reg.window
                self.chunk = self.chunk or reg.chunk
                self.attaches += 1
                self.connected.set()
                log.info("attached to %s as %s (target %s)", self.cache, self.device_id,
                         reg.target_model)
            elif kind == "assignment":
                a = msg.assignment
                if a.session_id in self.sessions:
                    self.sessions.pop(a.session_id).draft.close()
                draft = self.drafter.open(list(a.tokens), params_from_pb(a.sampling))
                self.sessions[a.session_id] = _Session(draft, a.epoch, len(a.tokens))
            elif kind == "commit":
                self._apply_commit(msg.commit)
            elif kind == "closed":
                s = self.sessions.pop(msg.closed.session_id, None)
                if s is not None:
                    s.draft.close()
            elif kind == "ack" and msg.ack.code != grpc.StatusCode.OK.value[0]:
                log.debug("chunk refused: %s", msg.ack.message)
            self.cond.notify_all()

    def _apply_commit(self, c: pb.Commit) -> None:
        s = self.sessions.get(c.session_id)
        if s is None:
            return
        if c.is_fix and c.epoch > s.epoch:
            s.draft.rollback(c.fix_position)
            s.draft.append([c.fix_token])
            s.epoch = c.epoch
            s.idle = False
        s.committed_end = max(s.committed_end, c.committed_end)

    # -- drafting ---------------------------------------------------------------------------------
    def _next_work(self):
        """Under the lock: a session with room in its window that is not idle."""
        for sid, s in self.sessions.items():
            ahead = len(s.draft.tokens) - s.committed_end
            if not s.idle and ahead < self.window:
                return sid, s, min(self.chunk, self.window - ahead)
        return None

    def _draft_loop(self, out: queue.Queue) -> None:
        while not self.stopping.is_set():
            with self.cond:
                if not self.connected.is_set():
                    return
                work = self._next_work()
                if work is None:
                    self.cond.wait(timeout=0.5)
                    continue
                sid, s, n = work
                epoch, start = s.epoch, len(s.draft.tokens)
                try:
                    draft = s.draft.propose(n)
                except Exception:
                    log.exception("drafting failed for %s; leaving it to the verifier", sid)
                    s.idle = True
                    continue
                s.idle = len(draft) == 0
            out.put(pb.DrafterMessage(chunk=pb.DraftChunk(
                session_id=sid, epoch=epoch, start=start, tokens=draft.tokens,
                q=q_to_pb(draft.q), idle=len(draft) == 0)))
            self.chunks_sent += 1
