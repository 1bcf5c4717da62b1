"""The edge drafter agent: attach to the draft cache, draft for assigned sessions, apply fixes.

One bidirectional ``Attach`` stream carries everything. A receiver thread records what the cache
sends in the drafting loop's book (``cache_messages``: assignments, commits, fixes, closed
sessions); a drafting thread runs the drafting loop (``edgespec.drafters.drafting_loop``, the same
loop the in-process engine runs over its local store) with the agent as its transport: it drafts
ahead for every session with room in its window (W tokens beyond the committed position), in
chunks of c tokens, outside the lock (a fix never waits behind a model drafter's forward), tags
each chunk with its epoch and start position, and never waits for a verdict. When the link
drops, the agent forgets its sessions, waits with exponential backoff and attaches again; the
cache then sends the current state of its sessions. A drafter that drafts in microseconds
(``Drafter.cheap``: MaG, Cacheback) sends each session's room in one chunk: every chunk is a
message the cache's host handles (on a server whose cores the cache shares, the verifier's).
For the same reason a chunk asks for no acknowledgement when stored (``DraftChunk.quiet``), but
one in ``ACK_EVERY``, which times the link's round trip; a refused chunk is always answered.
A cache that answers but refuses for now (its Redis recovering) says when to come back (trailing
metadata ``retry-after-ms``): the agent comes back then instead of backing off (``next_backoff``),
so drafting resumes within moments of the cache serving again.

A session the drafter cannot serve (``open`` fails, e.g. no free KV slot when a pinned session
arrives beyond capacity, or ``propose``/``rollback`` fails later) is refused, never fatal: the
agent logs it, keeps the session as refused, and pushes an empty ``idle`` chunk for it now and
after each of its commits, so the verifier does not wait for drafts that will not come and
decodes it alone. Other sessions go on as before.

With ``tree_width`` > 1 the agent drafts trees (``propose_tree``) and sends them as version-1
tree chunks (``edgespec.wire.trees``); a fix that carries a branch's tokens (``fix_more``) rolls
the session back and appends them all.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

import grpc

from edgespec.config import ConfigError
from edgespec.drafters import Draft, Drafter
from edgespec.drafters.draft_book import DraftBook, DraftTarget
from edgespec.drafters.drafting_loop import AHEAD_CHUNK, run_drafting
from edgespec.protocol.ids import check_device_id
from edgespec.wire.trees import TREE_VERSION, tree_to_wire
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc
from edgespec.wire.convert import REPLACED_STREAM, auth_metadata, retry_after_s
from edgespec.wire.channels import make_channel
from edgespec.wire.keepalive import heartbeat_interval_s
from edgespec.wire.reachability import check_address, probe

from .cache_messages import CacheMessages
from .first_attach import handshake_hint, settings_refusal
from .fleet_client import RemoteFleetTable
from .liveness import Liveness

if TYPE_CHECKING:  # prometheus_client is needed only where metrics are kept
    from .metrics import DrafterMetrics

log = logging.getLogger("edgespec.drafter")

FATAL = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION,
         grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED}
BACKOFF_START_S = 0.2
# in its first FAST_START_S, until its first attach, a board's backoff for a cache that does not
# answer (UNAVAILABLE) stops doubling here: one started beside a server that is loading its
# model attaches within about a second of the server's ready, where a 10 s cap left it out of
# the first requests. Past that window, after a first attach, and for a cache that answers (a
# refusal: full, say), the backoff grows to ``backoff_max_s``, so that a fleet rebooted with
# its server does not keep a starting cache's port busy for long
FIRST_ATTACH_BACKOFF_MAX_S = 1.0
FAST_START_S = 60.0
STILL_UNREACHABLE_LOG_S = 30.0  # while the cache stays unreachable, say so this often
MIN_RETRY_S = 0.1  # the shortest wait a retry hint may ask for
STEADY_LINK_S = 10.0  # a link that lasted this long resets the backoff when it ends
WHOLE_ROOM = 1 << 20  # a chunk limit no session's room reaches: the room is the limit
REPLACED_FORGOTTEN_S = 60.0  # a 'replaced' this long ago no longer counts towards stopping
MAX_CHUNKS_A_MESSAGE = 256  # chunks queued together sent as one DraftChunks (the cache's most)
ACK_EVERY = 8  # one chunk in this many asks the cache for its ack when stored (DraftChunk.quiet)


def _fix_of(code: grpc.StatusCode) -> str:
    """What the drafter's user changes for a refusal of its token, said after the cache's
    reason (the cache's message is the same for every caller)."""
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return ("; give the drafter the server's --auth-token (or, where the server has "
                "--device-tokens, this device's token) with --auth-token or $EDGESPEC_AUTH_TOKEN")
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return "; where the server has --device-tokens, give the drafter this device's token"
    return ""


def next_backoff(delay: float, error: grpc.RpcError | None, backoff_max_s: float,
                 jitter: float | None = None, starting: bool = False
                 ) -> tuple[float, float]:
    """After a link ended: (seconds to wait before attaching again, the backoff for the next
    failure). A refusal that carries a retry hint (a live cache, refusing for now) is retried
    after the hint (at most ``backoff_max_s``) and resets the backoff; anything else (no cache
    answering, a stream that ended, a refusal) waits ``delay`` and doubles it up to
    ``backoff_max_s``, or, where nothing answered (UNAVAILABLE, or a stream that ended) while
    ``starting`` (no attach yet, in the agent's first ``FAST_START_S``), up to
    ``FIRST_ATTACH_BACKOFF_MAX_S``. Both waits are jittered by +-20% (``jitter`` in [0, 1];
    None: random)."""
    factor = 0.8 + 0.4 * (random.random() if jitter is None else jitter)
    hint = retry_after_s(error) if error is not None else None
    if hint is not None:  # a hint of 0 from a broken cache: never a reconnect loop
        return min(backoff_max_s, max(MIN_RETRY_S, hint)) * factor, BACKOFF_START_S
    fast = starting and (error is None or error.code() == grpc.StatusCode.UNAVAILABLE)
    cap = min(backoff_max_s, FIRST_ATTACH_BACKOFF_MAX_S) if fast else backoff_max_s
    return delay * factor, min(cap, delay * 2)


def outgoing_messages(out: queue.Queue, batches: Callable[[], bool]
                      ) -> Iterator[pb.DrafterMessage]:
    """An Attach stream's messages from ``out`` until None: a chunk with the chunks queued right
    behind it in one DraftChunks while ``batches()`` (the cache said it reads them), every other
    message alone, in order."""
    nothing = object()
    held: Any = nothing  # a message taken while gathering chunks (None too), sent after them
    while True:
        msg, held = (out.get(), nothing) if held is nothing else (held, nothing)
        if msg is None:
            return
        if not batches() or msg.WhichOneof("kind") != "chunk":
            yield msg
            continue
        chunks = [msg.chunk]
        while len(chunks) < MAX_CHUNKS_A_MESSAGE:
            try:
                held = out.get_nowait()
            except queue.Empty:
                break
            if held is None or held.WhichOneof("kind") != "chunk":
                break
            chunks.append(held.chunk)
            held = nothing
        yield msg if len(chunks) == 1 else pb.DrafterMessage(chunks=pb.DraftChunks(chunks=chunks))


class DrafterAgent(CacheMessages):
    def __init__(self, cache: str, device_id: str, drafter: Drafter, fingerprint: str = "",
                 window: int | None = None, chunk: int | None = None, token: str | None = None,
                 tls_ca: str | None = None, tls: bool = False, max_sessions: int = 8,
                 backoff_max_s: float = 10.0, tls_cert: str | None = None,
                 tls_key: str | None = None, metrics: DrafterMetrics | None = None,
                 tree_width: int = 1, pace: bool = True):
        """``token``: the shared token, or this device's own token when the cache has
        per-device credentials. ``tls_cert``/``tls_key``: this device's client certificate
        (mutual TLS). ``metrics``: where to count chunks, fixes and link round trips (None:
        not counted). ``tree_width`` > 1: send tree chunks, the drafter's chain with up to
        tree_width - 1 branches (the verifier verifies them within its batch budget). ``pace``
        False: chunks of ``chunk`` tokens always (else sized to land within the verifier's
        step: ``edgespec.drafters.chunk_pace``)."""
        check_address(cache, "--cache")
        self.cache, self.device_id, self.drafter = cache, check_device_id(device_id), drafter
        if bool(tls_cert) != bool(tls_key):
            raise ConfigError("a client certificate needs both --tls-cert and --tls-key")
        self.fingerprint = fingerprint
        self.window, self.chunk = window, chunk
        self.vocab: int | None = None  # the target's, from Registered
        self.ahead_chunk = AHEAD_CHUNK  # a fix waits for no more of a chunk drafted ahead
        self.first_chunk = 1  # after a fix, its first token reaches the cache a token sooner
        if drafter.cheap:
            # a drafter that drafts in microseconds (MaG, Cacheback) sends a session's room in
            # one chunk (and ``chunk`` the window, unless given): each chunk is a message the
            # cache's host handles, and a cheap draft cut in pieces reaches it no sooner
            self.ahead_chunk = self.first_chunk = WHOLE_ROOM
        # a board's own time: a fix waits for no more than one job, or, for a drafter that
        # drafts its sessions together (llama.cpp's sequences), one turn of its forwards
        self.jobs_at_once = max(1, drafter.batch_jobs)
        self.token, self.tls_ca, self.tls = token, tls_ca, tls
        self.tls_cert, self.tls_key = tls_cert, tls_key
        self.speaks_tls = bool(tls or tls_ca or tls_cert)  # how make_channel connects
        self.max_sessions = max_sessions
        self.backoff_max_s = backoff_max_s
        self.metrics = metrics
        if not 1 <= tree_width <= 16:
            raise ConfigError(f"tree_width must be in [1, 16], got {tree_width}")
        self.tree_width = tree_width
        self.book = DraftBook(pace=pace)  # the sessions drafted for, guarded by cond
        if metrics is not None:
            metrics.watch(self.book)
        self.cond = threading.Condition()
        self.stopping = threading.Event()
        self.connected = threading.Event()
        self.attaches = 0  # successful registrations, reconnections included
        self.chunks_sent = 0
        self._unacked = -1  # chunks sent since the last that asked for its ack (the first asks)
        self.cache_batches = False  # the cache reads DraftChunks (its Registered said so)
        self.refused = 0  # sessions refused because the drafter failed on them
        self._outage_since: float | None = None  # when the cache became unreachable
        self._outage_told_at = 0.0  # when the outage was last logged (rate-limited)
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
        # one drafting loop for the agent's life, over the sessions of whichever link is up
        drafting = threading.Thread(
            target=run_drafting, daemon=True, name=f"draft-{self.device_id}",
            args=(self.drafter, self, self.book, lambda: not self.stopping.is_set()))
        drafting.start()
        try:
            self._attach_until_stopped()
        finally:
            self.stopping.set()
            with self.cond:
                self.cond.notify_all()
            drafting.join()

    def _attach_until_stopped(self) -> None:
        delay, started = BACKOFF_START_S, time.monotonic()
        replaced_at: float | None = None  # when the cache last said another took the id over
        while not self.stopping.is_set():
            error, why = None, None
            attaches, began = self.attaches, time.monotonic()
            try:
                self._attach_once()
            except grpc.RpcError as e:
                if self.stopping.is_set():
                    break  # stop() cancelled the stream
                if e.code() in FATAL:
                    raise ConfigError(f"the cache refused drafter {self.device_id!r}: "
                                      f"{e.details()}{_fix_of(e.code())}") from None
                found = probe(self.cache)[0] if not self.attaches and \
                    e.code() == grpc.StatusCode.UNAVAILABLE else None
                why_not = settings_refusal(self.cache, found, self.speaks_tls) \
                    if found else None
                if why_not is not None:
                    raise ConfigError(why_not) from None
                if e.code() == grpc.StatusCode.ABORTED and \
                        str(e.details()).startswith(REPLACED_STREAM):
                    # only this process reads this stream: another took the id over. Once is
                    # forgiven (a stale attempt of this board's, reset by a proxy, could have
                    # looked newer); again before a steady link, this board gives the id up
                    if replaced_at is not None:
                        raise ConfigError(f"the cache at {self.cache} ended this drafter's "
                                          f"link twice: {e.details()}; the newer drafter keeps "
                                          f"the id and this one stops (if two boards were "
                                          f"given one --device-id, give each its own)") from None
                    replaced_at = time.monotonic()
                    log.error("the cache at %s ended this drafter's link: %s (another drafter "
                              "with --device-id %s?); attaching again once", self.cache,
                              e.details(), self.device_id)
                error = e
            except ConfigError:
                raise  # a setting to fix (an unreadable certificate file, ...)
            except ConnectionError as e:  # the cache broke the protocol (``_apply``)
                why = str(e)
            except Exception:
                log.exception("the link to %s failed", self.cache)
            finally:
                self.connected.clear()
                self._forget_sessions()
            if time.monotonic() - began >= STEADY_LINK_S:  # a link that lasted: backoff anew
                delay = BACKOFF_START_S  # (not after links a cache closes at once: no loop)
            if replaced_at is not None and time.monotonic() - replaced_at >= REPLACED_FORGOTTEN_S:
                replaced_at = None  # a board that kept its link since: a replacement is news
            wait, delay = next_backoff(
                delay, error, self.backoff_max_s,
                starting=not self.attaches and time.monotonic() - started < FAST_START_S)
            if not self.stopping.is_set():
                self._log_retry(error, wait, attached=self.attaches > attaches, why=why)
            if self.stopping.wait(wait):
                break

    def _log_retry(self, error: grpc.RpcError | None, wait: float, attached: bool,
                   why: str | None = None) -> None:
        """Every lost link is logged ("lost": a link that existed, ended by an error or closed
        by the cache); a cache not reached (yet, or again) is said at once, then every
        ``STILL_UNREACHABLE_LOG_S`` while it lasts."""
        why = why or (f"{error.code().name}: {error.details()}" if error is not None
                      else "the cache closed the stream")
        hint = handshake_hint(why) if self.speaks_tls else None
        if hint:  # the board's own TLS handshake failed: what to check, with the error
            why = f"{why}; {hint}"
        now = time.monotonic()
        if attached:
            self._outage_since = None  # a failed re-attach starts an outage (said at once)
            log.warning("link to %s lost (%s); retrying in %.1fs", self.cache, why, wait)
        elif self._outage_since is None:
            self._outage_since = self._outage_told_at = now
            when = "since the link was lost" if self.attaches else "yet"
            log.warning("cannot reach the cache at %s %s (%s); retrying", self.cache, when, why)
        elif now - self._outage_told_at >= STILL_UNREACHABLE_LOG_S:
            self._outage_told_at = now
            log.warning("still cannot reach the cache at %s after %.0f s (%s); retrying",
                        self.cache, now - self._outage_since, why)
        else:
            log.debug("still cannot reach the cache at %s (%s); retrying in %.1fs", self.cache,
                      why, wait)

    def _attach_once(self) -> None:
        channel = make_channel(self.cache, self.tls_ca, self.tls, client_cert=self.tls_cert,
                               client_key=self.tls_key)
        out: queue.Queue = queue.Queue()
        beat_s = heartbeat_interval_s()
        out.put(pb.DrafterMessage(register=pb.Register(
            device_id=self.device_id, draft_model=self.drafter.name,
            tokenizer_fingerprint=self.fingerprint, max_sessions=self.max_sessions,
            heartbeat_ms=int(beat_s * 1000), batches=True)))
        with self.cond:
            self._out = out
            self.cache_batches = False  # until this cache's Registered says otherwise

        stub = pb_grpc.DraftCacheStub(channel)
        responses = stub.Attach(outgoing_messages(out, lambda: self.cache_batches),
                               metadata=auth_metadata(self.token))
        with self.cond:
            self._call = responses
        if self.stopping.is_set():
            responses.cancel()
        link = Liveness(responses, out, beat_s, self.cache)
        try:
            for msg in responses:
                link.heard(msg)
                if self.stopping.is_set():
                    break
                if msg.WhichOneof("kind") == "batch":
                    self._apply_batch(msg.batch, link)
                else:
                    self._apply(msg)
        except grpc.RpcError as e:
            # its own cancel, for the cache's silence: said as why (any other status, the
            # cache's own, is handled as it says: a retry hint, a replaced stream, ...)
            if link.gave_up and e.code() == grpc.StatusCode.CANCELLED and \
                    not self.stopping.is_set():
                raise ConnectionError(link.gave_up) from None
            raise
        finally:
            link.stop()
            out.put(None)
            if self.metrics is not None:
                self.metrics.link_lost()
            with self.cond:
                self._out = self._call = None
                self.connected.clear()
                self.cond.notify_all()
            responses.cancel()
            channel.close()

    def _forget_sessions(self) -> None:
        with self.cond:
            self.book.close_all()

    # -- the drafting loop's transport (edgespec.drafters.drafting_loop.DraftChannel) ---
    def refresh(self, book: DraftBook) -> None:
        """Nothing to do: the receiver records what the cache sends as it comes."""

    def can_draft(self, sid: str, start: int) -> bool:
        return True  # the cache answers a misplaced chunk with a refusal, never a wrong draft

    def deliver(self, sid: str, target: DraftTarget, start: int, draft: Draft) -> None:
        """A drafted chunk to the cache: a chain, or a tree chunk when the drafter offered
        branches."""
        if self._out is None:
            return
        chunk = pb.DraftChunk(session_id=sid, epoch=target.epoch, start=start,
                              tokens=draft.tokens, idle=len(draft) == 0)
        if draft.branches:
            nodes, parents = tree_to_wire(draft.tokens, draft.branches)
            chunk.tokens[:] = nodes
            chunk.tree_parents.extend(parents)
            chunk.tree_version = TREE_VERSION
        self._send(self._out, chunk)
        self.chunks_sent += 1

    def refuse(self, sid: str, target: DraftTarget, start: int, why: str) -> None:
        """Tell the cache, with an idle chunk, that nothing is coming for this session."""
        self.refused += 1
        self._send_idle(sid, target, start)

    def _send_idle(self, sid: str, target: DraftTarget, start: int) -> None:
        if self._out is not None:
            self._send(self._out, pb.DraftChunk(session_id=sid, epoch=target.epoch, start=start,
                                                idle=True))

    def _send(self, out: queue.Queue, chunk: pb.DraftChunk) -> None:
        # the cache answers one chunk in ACK_EVERY when it is stored (the link's round trip,
        # sampled), every refused one: an ack a chunk would cost the verifier's host a message
        self._unacked = (self._unacked + 1) % ACK_EVERY
        chunk.quiet = self._unacked != 0
        if self.metrics is not None:  # before queuing it: its ack cannot come first
            self.metrics.chunk_sent(chunk.session_id, chunk.start, len(chunk.tokens),
                                    acked=not chunk.quiet)
        out.put(pb.DrafterMessage(chunk=chunk))
