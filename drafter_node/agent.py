"""The edge drafter agent: attach to the draft cache, draft for assigned sessions, apply fixes.

One bidirectional ``Attach`` stream carries everything. A receiver thread applies what the cache
sends (assignments open draft sessions, commits move the committed position, fixes roll a
session back and append the verifier's token, closes end sessions); a drafting thread drafts
ahead for every session with room in its window (W tokens beyond the committed position), in
chunks of c tokens, tagging each chunk with its epoch and start position, and never waits for a
verdict. When the link drops, the agent forgets its sessions, waits with exponential backoff and
attaches again; the cache then sends the current state of its sessions. A cache that answers but
refuses for now (its Redis recovering) says when to come back (trailing metadata
``retry-after-ms``): the agent comes back then instead of backing off (``next_backoff``), so
drafting resumes within moments of the cache serving again.

A session the drafter cannot serve (``open`` fails, e.g. no free KV slot when a pinned session
arrives beyond capacity, or ``propose``/``rollback`` fails later) is refused, never fatal: the
agent logs it, keeps the session as refused, and pushes an empty ``idle`` chunk for it now and
after each of its commits, so the verifier does not wait for drafts that will not come and
decodes it alone. Other sessions go on as before.

With ``tree_width`` > 1 the agent drafts trees (``propose_tree``) and sends them as version-1
tree chunks (``edgespec.tree_wire``); a fix that carries a branch's tokens (``fix_more``) rolls
the session back and appends them all.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from edgespec.config import ConfigError
from edgespec.drafters import Drafter, DraftSession
from edgespec.ids import check_device_id
from edgespec.tree_wire import TREE_VERSION, tree_to_wire
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc
from edgespec.wire import auth_metadata, make_channel, params_from_pb, retry_after_s

from .fleet_client import RemoteFleetTable

if TYPE_CHECKING:  # prometheus_client is needed only where metrics are kept
    from .metrics import DrafterMetrics

log = logging.getLogger("edgespec.drafter")

FATAL = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION,
         grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED}
BACKOFF_START_S = 0.2


def next_backoff(delay: float, error: grpc.RpcError | None, backoff_max_s: float,
                 jitter: float | None = None) -> tuple[float, float]:
    """After a link ended: (seconds to wait before attaching again, the backoff for the next
    failure). A refusal that carries a retry hint (a live cache, refusing for now) is retried
    after the hint (at most ``backoff_max_s``) and resets the backoff; anything else (no cache
    answering, a stream that ended) waits ``delay`` and doubles it up to ``backoff_max_s``.
    Both waits are jittered by +-20% (``jitter`` in [0, 1]; None: random)."""
    factor = 0.8 + 0.4 * (random.random() if jitter is None else jitter)
    hint = retry_after_s(error) if error is not None else None
    if hint is not None:
        return min(backoff_max_s, hint) * factor, BACKOFF_START_S
    return delay * factor, min(backoff_max_s, delay * 2)


@dataclass
class _Session:
    """A session this device drafts for. ``draft`` is None once the session was refused."""

    draft: DraftSession | None
    epoch: int
    committed_end: int
    idle: bool = False

    @property
    def refused(self) -> bool:
        return self.draft is None


@dataclass
class _Work:
    """A session with room in its window: draft up to ``n`` tokens at ``start``."""

    session_id: str
    session: _Session
    epoch: int
    start: int
    n: int


class DrafterAgent:
    def __init__(self, cache: str, device_id: str, drafter: Drafter, fingerprint: str = "",
                 window: int | None = None, chunk: int | None = None, token: str | None = None,
                 tls_ca: str | None = None, tls: bool = False, max_sessions: int = 8,
                 backoff_max_s: float = 10.0, tls_cert: str | None = None,
                 tls_key: str | None = None, metrics: DrafterMetrics | None = None,
                 compute_slowdown: float = 1.0, tree_width: int = 1):
        """``token``: the shared token, or this device's own token when the cache has
        per-device credentials. ``tls_cert``/``tls_key``: this device's client certificate
        (mutual TLS). ``metrics``: where to count chunks, fixes and link round trips (None:
        not counted). ``compute_slowdown``: emulate a device this many times slower (a
        simulated fleet): each chunk is sent (slowdown - 1) x its drafting time later.
        ``tree_width`` > 1: send tree chunks, the drafter's chain with up to tree_width - 1
        branches (the verifier verifies them within its batch budget)."""
        self.cache, self.device_id, self.drafter = cache, check_device_id(device_id), drafter
        if bool(tls_cert) != bool(tls_key):
            raise ConfigError("a client certificate needs both --tls-cert and --tls-key")
        self.fingerprint = fingerprint
        self.window, self.chunk = window, chunk
        self.token, self.tls_ca, self.tls = token, tls_ca, tls
        self.tls_cert, self.tls_key = tls_cert, tls_key
        self.max_sessions = max_sessions
        self.backoff_max_s = backoff_max_s
        self.metrics = metrics
        if compute_slowdown < 1:
            raise ConfigError("compute_slowdown must be >= 1")
        self.compute_slowdown = compute_slowdown
        if not 1 <= tree_width <= 16:
            raise ConfigError(f"tree_width must be in [1, 16], got {tree_width}")
        self.tree_width = tree_width
        self.sessions: dict[str, _Session] = {}
        self.cond = threading.Condition()
        self.stopping = threading.Event()
        self.connected = threading.Event()
        self.attaches = 0  # successful registrations, reconnections included
        self.chunks_sent = 0
        self.refused = 0  # sessions refused because the drafter failed on them
        self._unreachable_told = False  # this outage is logged: further failures at debug
        self._out: queue.Queue | None = None  # the current stream's outgoing messages
        self._call = None  # the current Attach call, cancelled by stop()

    # -- lifecycle ------------------------------------------------------------------------------
    def stop(self) -> None:
        self.stopping.set()
        with self.cond:
            call = self._call
            self.cond.notify_all()
        if call is not None:
            call.cancel()  # a quiet stream would otherwise hold run() until its next message

    def run(self) -> None:
        """Attach, serve, and re-attach with backoff until stopped or refused for good. A
        drafter that drafts from the fleet-wide table (Cacheback) pulls it meanwhile."""
        if not self.drafter.uses_fleet:
            self._serve()
            return
        fleet = RemoteFleetTable(self.cache, self.token, self.tls_ca, self.tls, self.tls_cert,
                                 self.tls_key)
        self.drafter.use_fleet(fleet)
        try:
            self._serve()
        finally:
            self.drafter.use_fleet(None)
            fleet.close()

    def _serve(self) -> None:
        delay = BACKOFF_START_S
        while not self.stopping.is_set():
            error = None
            attaches = self.attaches
            try:
                self._attach_once()
                delay = BACKOFF_START_S
            except grpc.RpcError as e:
                if self.stopping.is_set():
                    break  # stop() cancelled the stream
                if e.code() in FATAL:
                    raise ConfigError(f"the cache refused drafter {self.device_id!r}: "
                                      f"{e.details()}") from None
                error = e
            except ConfigError:
                raise  # a setting to fix (an unreadable certificate file, ...)
            except Exception:
                log.exception("the link to %s failed", self.cache)
            finally:
                self.connected.clear()
                self._forget_sessions()
            wait, delay = next_backoff(delay, error, self.backoff_max_s)
            if error is not None:
                self._log_retry(error, wait, attached=self.attaches > attaches)
            if self.stopping.wait(wait):
                break

    def _log_retry(self, error: grpc.RpcError, wait: float, attached: bool) -> None:
        """"lost" only for a link that existed; a cache not reached (yet, or again) is said
        once, then quietly."""
        why = f"{error.code().name}: {error.details()}"
        if attached:
            self._unreachable_told = False
            log.warning("link to %s lost (%s); retrying in %.1fs", self.cache, why, wait)
        elif not self._unreachable_told:
            self._unreachable_told = True
            when = "since the link was lost" if self.attaches else "yet"
            log.warning("cannot reach the cache at %s %s (%s); retrying", self.cache, when, why)
        else:
            log.debug("still cannot reach the cache at %s (%s); retrying in %.1fs", self.cache,
                      why, wait)

    def _attach_once(self) -> None:
        channel = make_channel(self.cache, self.tls_ca, self.tls, client_cert=self.tls_cert,
                               client_key=self.tls_key)
        out: queue.Queue = queue.Queue()
        out.put(pb.DrafterMessage(register=pb.Register(
            device_id=self.device_id, draft_model=self.drafter.name,
            tokenizer_fingerprint=self.fingerprint, max_sessions=self.max_sessions)))
        with self.cond:
            self._out = out

        def outgoing():
            while True:
                msg = out.get()
                if msg is None:
                    return
                yield msg

        stub = pb_grpc.DraftCacheStub(channel)
        responses = stub.Attach(outgoing(), metadata=auth_metadata(self.token))
        with self.cond:
            self._call = responses
        if self.stopping.is_set():
            responses.cancel()
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
            if self.metrics is not None:
                self.metrics.link_lost()
            with self.cond:
                self._out = self._call = None
                self.connected.clear()
                self.cond.notify_all()
            responses.cancel()
            channel.close()
            if drafting.is_alive():
                drafting.join(timeout=5)

    def _forget_sessions(self) -> None:
        with self.cond:
            for sid, s in self.sessions.items():
                self._close(sid, s)
            self.sessions.clear()

    # -- refusing a session -------------------------------------------------------------------
    def _close(self, sid: str, s: _Session) -> None:
        """Under the lock: release what the session's draft holds; never raises."""
        draft, s.draft = s.draft, None
        if draft is not None:
            try:
                draft.close()
            except Exception:
                log.exception("closing the draft of session %s failed", sid)

    def _refuse(self, sid: str, s: _Session, why: str, start: int | None = None) -> None:
        """Under the lock: stop drafting for a session the drafter failed on and tell the
        cache, with an idle chunk, that nothing is coming for it."""
        log.warning("drafter %s cannot draft for session %s (%s); the verifier decodes it "
                    "alone", self.device_id, sid, why)
        self._close(sid, s)
        s.idle = True
        self.refused += 1
        self._send_idle(sid, s, s.committed_end if start is None else start)

    def _send_idle(self, sid: str, s: _Session, start: int) -> None:
        if self._out is not None:
            self._send(self._out, pb.DraftChunk(session_id=sid, epoch=s.epoch, start=start,
                                                idle=True))

    def _send(self, out: queue.Queue, chunk: pb.DraftChunk) -> None:
        if self.metrics is not None:  # before queuing it: its ack cannot come first
            self.metrics.chunk_sent(chunk.session_id, chunk.start, len(chunk.tokens))
        out.put(pb.DrafterMessage(chunk=chunk))

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
                self._apply_assignment(msg.assignment)
            elif kind == "commit":
                self._apply_commit(msg.commit)
            elif kind == "closed":
                s = self.sessions.pop(msg.closed.session_id, None)
                if s is not None:
                    self._close(msg.closed.session_id, s)
            elif kind == "ack":
                if self.metrics is not None:
                    self.metrics.ack_received(msg.ack.session_id, msg.ack.start, msg.ack.code)
                if msg.ack.code != grpc.StatusCode.OK.value[0]:
                    log.debug("chunk refused: %s", msg.ack.message)
                    self._forget_if_gone(msg.ack)
                    if self.tree_width > 1 and "tree" in msg.ack.message and \
                            msg.ack.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]:
                        log.warning("the cache refuses tree chunks (%s): drafting chains",
                                    msg.ack.message)
                        self.tree_width = 1
            self.cond.notify_all()

    def _forget_if_gone(self, ack: pb.ChunkAck) -> None:
        """A session the cache no longer has, or has finished, whose close we never got (the
        verifier died, say): drop it so that it does not hold a KV slot for ever."""
        gone = ack.code == grpc.StatusCode.NOT_FOUND.value[0] or "finished" in ack.message
        s = self.sessions.pop(ack.session_id, None) if gone else None
        if s is not None:
            self._close(ack.session_id, s)

    def _apply_assignment(self, a: pb.Assignment) -> None:
        old = self.sessions.pop(a.session_id, None)
        if old is not None:
            self._close(a.session_id, old)
        s = _Session(None, a.epoch, len(a.tokens))
        self.sessions[a.session_id] = s
        try:
            s.draft = self.drafter.open(list(a.tokens), params_from_pb(a.sampling))
        except Exception as e:
            self._refuse(a.session_id, s, f"{type(e).__name__}: {e}")

    def _apply_commit(self, c: pb.Commit) -> None:
        if c.is_fix and self.metrics is not None:
            self.metrics.fix_received()
        s = self.sessions.get(c.session_id)
        if s is None:
            return
        if s.refused:
            if c.epoch >= s.epoch:
                s.epoch = c.epoch
                s.committed_end = max(s.committed_end, c.committed_end)
                # a fix resets the session's idle flag in the cache: say it again
                self._send_idle(c.session_id, s, s.committed_end)
            return
        s.committed_end = max(s.committed_end, c.committed_end)
        if c.is_fix and c.epoch > s.epoch:
            s.epoch = c.epoch
            s.idle = False
            try:
                s.draft.rollback(c.fix_position)
                s.draft.append([c.fix_token, *c.fix_more])
            except Exception as e:
                self._refuse(c.session_id, s, f"applying a fix failed: {type(e).__name__}: {e}")

    # -- drafting ---------------------------------------------------------------------------------
    def _next_work(self) -> _Work | None:
        """Under the lock: a session with room in its window that is not idle."""
        for sid, s in self.sessions.items():
            if s.idle or s.refused:
                continue
            start = len(s.draft.tokens)
            ahead = start - s.committed_end
            if ahead < self.window:
                return _Work(sid, s, s.epoch, start, min(self.chunk, self.window - ahead))
        return None

    def _propose(self, work: _Work) -> pb.DraftChunk:
        """Draft a chunk for ``work``: a chain, or with ``tree_width`` > 1 a tree chunk when the
        drafter offered branches."""
        draft = work.session.draft.propose_tree(work.n, self.tree_width)  # 1: propose's chain
        chunk = pb.DraftChunk(session_id=work.session_id, epoch=work.epoch, start=work.start,
                              tokens=draft.tokens, idle=len(draft) == 0)
        if draft.branches:
            nodes, parents = tree_to_wire(draft.tokens, draft.branches)
            chunk.tokens[:] = nodes
            chunk.tree_parents.extend(parents)
            chunk.tree_version = TREE_VERSION
        return chunk

    def _draft_loop(self, out: queue.Queue) -> None:
        while not self.stopping.is_set():
            with self.cond:
                if not self.connected.is_set():
                    return
                work = self._next_work()
                if work is None:
                    self.cond.wait(timeout=0.5)
                    continue
                s = work.session
                began = time.perf_counter()
                try:
                    chunk = self._propose(work)
                except Exception as e:
                    self._refuse(work.session_id, s, f"drafting failed: {type(e).__name__}: {e}",
                                 start=work.start)
                    continue
                s.idle = len(chunk.tokens) == 0
                took = time.perf_counter() - began
            if self.compute_slowdown > 1:  # outside the lock: commits and fixes still apply
                time.sleep((self.compute_slowdown - 1) * max(0.0, took))
            self._send(out, chunk)
            self.chunks_sent += 1

