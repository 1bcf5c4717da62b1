"""The DraftCache gRPC service: the drafters' only door to the session state in Redis.

Each drafter holds one ``Attach`` stream. The first message registers it (device id, draft model,
tokenizer fingerprint); a fingerprint that differs from the target's is refused with
FAILED_PRECONDITION. The cache then sends the device's current sessions (a snapshot, so a drafter
that reconnects resumes where the cache stands), and from then on every event of the device's
inbox stream in Redis: new assignments, commits (fixes among them), closed sessions. Chunks the
drafter sends are checked and pushed atomically; each is answered with a ``ChunkAck`` whose code
is a gRPC status code (FAILED_PRECONDITION for a stale epoch or a misplaced chunk). A newer
stream for the same device id replaces an older one.

A drafter is not trusted: device and session ids must match ``edgespec.protocol.ids`` (they are
spliced into Redis keys), draft token ids must be in the vocabulary, and a tree chunk must be well
formed; anything else is INVALID_ARGUMENT (``chunk_checks``).

With per-device credentials (``credentials``, see ``cache_service.credentials``) the device is
the one the caller's token belongs to: a Register for another device id, a PushDraft naming
another device, and a chunk for a session assigned to another device are PERMISSION_DENIED.
Without them, the device is what the drafter says (``Register.device_id``, or the
``x-edgespec-device`` metadata of PushDraft), and a chunk for another device's session is
FAILED_PRECONDITION.

With ``metrics`` (``cache_service.metrics.CacheMetrics``) the service counts open Attach streams,
registrations by device, chunks by result and status code, and draft tokens stored.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

import grpc
import redis

from edgespec.config import ConfigError
from edgespec.protocol.ids import check_device_id, shown
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc
from edgespec.wire.convert import REPLACED_STREAM, params_to_pb, retry_after_metadata
from edgespec.wire.keepalive import SILENT_HEARTBEATS, heartbeat_interval_s

from .chunk_checks import DEVICE_METADATA, ChunkRefused
from .chunk_intake import ChunkIntake
from .codec import InboxEvent
from .credentials import DeviceCredentials
from .drafter_outbox import DrafterOutbox, with_queued
from .inbox_reader import InboxReader, Subscription
from .register_wait import RegisterWait
from .store import RedisSessionStore

if TYPE_CHECKING:  # prometheus_client is needed only where metrics are kept
    from .metrics import CacheMetrics

log = logging.getLogger("edgespec.cache")

MAX_NAME_LEN = 256  # Register's draft model name and tokenizer fingerprint
MAX_DEVICE_SESSIONS = 1 << 16
# A drafter refused while the cache's Redis recovers (or before a verifier registered the target)
# is asked to come back after this long instead of backing off for seconds.
RETRY_AFTER_MS = 500
SHUTTING_DOWN = "the cache is shutting down"  # UNAVAILABLE: the drafter attaches again


class DraftCacheService(pb_grpc.DraftCacheServicer):
    def __init__(self, store: RedisSessionStore, window: int = 16, chunk: int = 4,
                 poll_ms: int = 1000, credentials: DeviceCredentials | None = None,
                 metrics: CacheMetrics | None = None):
        """``credentials``: per-device tokens; None: drafters name their device themselves.
        ``metrics``: where to count attaches and chunks (None: not counted)."""
        self.store, self.window, self.chunk, self.poll_ms = store, window, chunk, poll_ms
        self.heartbeat_s = heartbeat_interval_s()  # Heartbeats it sends each Attach stream
        self.credentials = credentials
        self.registering = RegisterWait()  # each Attach stream's wait for its Register
        # the chunks' checks and stores (``metrics`` is its: a caller may set it later)
        self.intake = ChunkIntake(store, window, credentials is not None, metrics)
        self._lock = threading.Lock()
        # device -> generation of its current Attach stream; an entry lives as long as the
        # stream. Generations come from one counter, so a stream never mistakes a later one
        # for itself.
        self._generation: dict[str, int] = {}
        self._peer: dict[str, str] = {}  # device -> the address of its current stream
        self._context: dict[str, grpc.ServicerContext] = {}  # device -> its current stream's
        self._generations = itertools.count(1)
        self._stopping = threading.Event()
        # each open Attach stream's stop event, and its call
        self._streams: dict[threading.Event, grpc.ServicerContext] = {}
        self._streams_done = threading.Condition()
        # every attached drafter's inbox, read by one thread (``inbox_reader``)
        self._inboxes = InboxReader(store, poll_ms, self._event_message, self._is_current,
                                    self._stopping)

    @property
    def metrics(self) -> CacheMetrics | None:
        return self.intake.metrics

    @metrics.setter
    def metrics(self, metrics: CacheMetrics | None) -> None:
        self.intake.metrics = metrics

    def stop(self, wait_s: float = 5.0) -> None:
        """End every Attach stream (its drafter is told UNAVAILABLE and attaches again with
        backoff) and wait up to ``wait_s`` for their handlers to finish, so that each drafter is
        marked gone while the cache's Redis is still open: a handler left running past the
        Redis's close would retry its last command for seconds, holding the process's exit."""
        self._stopping.set()
        with self._streams_done:
            for ended in self._streams:
                ended.set()
            # a handler sees its stop within its outbox's poll (0.5 s)
            if self._streams_done.wait_for(lambda: not self._streams, timeout=min(1.0, wait_s)):
                return
            stuck = list(self._streams.values())
        for context in stuck:  # blocked sending to a drafter that does not read: cancelled
            context.cancel()
        with self._streams_done:
            self._streams_done.wait_for(lambda: not self._streams, timeout=wait_s)

    # -- who is calling ---------------------------------------------------------------------------
    def _token_device(self, context) -> str:
        """With credentials: the device the caller's token belongs to (else the call is
        aborted UNAUTHENTICATED)."""
        assert self.credentials is not None  # callers check for credentials first
        device = self.credentials.device_from_metadata(context.invocation_metadata())
        if device is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "DraftCache calls need a device token (metadata "
                          "'authorization: Bearer <the device's token>')")
            raise AssertionError("unreachable: context.abort raises")
        return device

    # -- chunks ---------------------------------------------------------------------------------
    def _vocab(self) -> int:
        return int(self.store.target().get("vocab_size", 1 << 31))

    def PushDraft(self, request, context):
        named = dict(context.invocation_metadata()).get(DEVICE_METADATA, "")
        try:
            if self.credentials is not None:
                device = self._token_device(context)
                if named and named != device:
                    raise ChunkRefused(grpc.StatusCode.PERMISSION_DENIED,
                                       f"this token belongs to device {device!r}, "
                                       f"not {shown(named)}")
            else:
                device = named
                if device:
                    try:
                        check_device_id(device)
                    except ConfigError as e:
                        raise ChunkRefused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
            return self.intake.push_one(device, request, self._vocab)
        except ChunkRefused as e:
            self.intake.refused(e)
            context.abort(e.code, str(e))
        except redis.RedisError as e:  # the cache is up, its Redis is not: try again later
            log.warning("storing a pushed chunk failed: %s", e)
            self._refuse_for_now(context, f"the cache's Redis failed: {e}")

    def FleetTable(self, request, context):
        """The fleet-wide Cacheback table's entries changed since ``request.since``."""
        fleet = self.store.fleet
        if fleet is None:
            return pb.FleetTableReply()
        if request.since < 0 or request.limit < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "since and limit must be >= 0")
        try:
            piece = fleet.pull(request.since, request.limit or 2048)
        except redis.RedisError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the cache's Redis: {e}")
        return pb.FleetTableReply(
            entries=[pb.FleetTableEntry(leader=e.leader, followers=e.followers)
                     for e in piece.entries],
            version=piece.version, more=piece.more)

    # -- the attach stream ------------------------------------------------------------------------
    def _check_register(self, reg: pb.Register, context) -> str:
        """The registering device's id, or the call is aborted."""
        try:
            device = check_device_id(reg.device_id)
        except ConfigError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if self.credentials is not None:
            owner = self._token_device(context)
            if owner != device:
                context.abort(grpc.StatusCode.PERMISSION_DENIED,
                              f"this token belongs to device {owner!r}, not {device!r}")
        if len(reg.draft_model) > MAX_NAME_LEN or len(reg.tokenizer_fingerprint) > MAX_NAME_LEN:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"draft_model and tokenizer_fingerprint hold at most {MAX_NAME_LEN} "
                          "characters")
        # shown in the cache's log and ``edgespec status``: no line breaks or terminal codes
        if not (reg.draft_model.isprintable() and reg.tokenizer_fingerprint.isprintable()):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "draft_model and tokenizer_fingerprint hold printable characters only")
        if not 0 <= reg.max_sessions <= MAX_DEVICE_SESSIONS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"max_sessions must be in [0, {MAX_DEVICE_SESSIONS}] (0: no limit)")
        return device

    def Attach(self, request_iterator, context):
        if self._stopping.is_set():  # nothing registered, nothing written: attach elsewhere
            context.abort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
        first = self.registering.first_message(
            request_iterator, context,
            self._token_device(context) if self.credentials is not None else None)
        if first is False:  # over without a Register (none in time, replaced, gone)
            return
        if first is None or not first.HasField("register"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be Register")
        reg = first.register
        device = self._check_register(reg, context)
        try:
            target = self.store.target()
        except redis.RedisError as e:
            self._refuse_for_now(context, f"the cache's Redis is unreachable: {e}")
        if not target:
            self._refuse_for_now(context, "no verifier has registered a target yet")
        if reg.tokenizer_fingerprint and reg.tokenizer_fingerprint != target["fingerprint"]:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"drafter tokenizer {reg.tokenizer_fingerprint} differs from the "
                          f"target's {target['fingerprint']} ({target.get('model', '')})")
        if not context.is_active():  # its client left while it waited (a stale attempt): it
            return  # must not take the device over from a newer stream that is live
        peer = context.peer() or "?"
        with self._lock:
            gen = next(self._generations)
            older = self._generation.get(device)
            self._generation[device] = gen
            before, self._peer[device] = self._peer.get(device), peer
            self._context[device] = context
        if older is not None:
            log.warning("drafter %s attached again (from %s) while its stream from %s is open: "
                        "the newer replaces the older, which is told to stop; if that is not "
                        "one board reconnecting, two boards share the id (give each its own "
                        "--device-id)", device, peer, before)
        try:
            self.store.devices.register(device, {"draft_model": reg.draft_model,
                                                "max_sessions": reg.max_sessions})
        except redis.RedisError as e:
            with self._lock:
                if self._generation.get(device) == gen:
                    del self._generation[device]
                    self._peer.pop(device, None)
                    self._context.pop(device, None)
            self._refuse_for_now(context, f"the cache's Redis is unreachable: {e}")
        log.info("drafter %s attached (%s)", device, reg.draft_model)
        vocab = int(target.get("vocab_size", 1 << 31))
        stop = threading.Event()
        out = DrafterOutbox(device, stop, context.cancel)  # bounded: one that never reads
        lost: list[str] = []  # why the cache ended the stream (its Redis failed or restarted)
        events: Subscription | None = None  # its inbox's reading, once subscribed
        seen_at: float | None = None  # when it was last heard, where it fell silent
        heard: list[float] = []  # when the drafter last sent anything (monotonic), once read
        context.add_callback(stop.set)
        if self.metrics is not None:
            self.metrics.attach(device)
        try:
            with self._streams_done:
                self._streams[stop] = context
                if self._stopping.is_set():
                    stop.set()  # stop() has run: this stream ends at once
            # sent first, before what the threads queue: the registration, then the device's
            # sessions (a list as long as they are, not bounded by the outbox)
            opening = [pb.CacheMessage(registered=pb.Registered(
                target_model=target.get("model", ""), tokenizer_fingerprint=target["fingerprint"],
                window=self.window, chunk=self.chunk, vocab_size=vocab,
                heartbeat_ms=int(self.heartbeat_s * 1000), batches=True))]
            try:
                after = self.store.last_event_id(device)
                for sid in self.store.devices.sessions_of(device):
                    self.store.told_afresh(sid)  # before its snapshot: told of every commit
                    msg = self._assignment(sid)
                    if msg is not None:
                        opening.append(msg)
            except redis.RedisError as e:
                self._refuse_for_now(context, f"the cache's Redis is unreachable: {e}")
            heard.append(time.monotonic())
            threading.Thread(target=self.intake.read_stream, daemon=True, name=f"chunks-{device}",
                             args=(request_iterator, device, vocab, out, stop, lost,
                                   heard)).start()
            events = Subscription(device, gen, after, out, stop, lost)
            self._inboxes.add(events)
            # the drafter's own interval (untrusted: clamped); 0: an older drafter, none sent
            beat_ms = min(max(reg.heartbeat_ms, 0), 600_000)
            silent_s = max(1.0, SILENT_HEARTBEATS * beat_ms / 1000) if beat_ms else 0.0
            beat_at = time.monotonic() + self.heartbeat_s
            yield from opening
            silence = ""  # why the stream ended for the drafter's silence, if it did
            while not stop.is_set():
                now = time.monotonic()
                if silent_s and now - heard[0] > silent_s:
                    silence = (f"heard nothing from drafter {device!r} for "
                               f"{now - heard[0]:.1f} s (it said it sends a heartbeat every "
                               f"{beat_ms / 1000:g} s): detached it")
                    log.warning("%s", silence)
                    # its last sign of life, not this moment, is when it was last seen alive
                    seen_at = time.time() - (now - heard[0])
                    break
                if now >= beat_at:
                    beat_at = now + self.heartbeat_s
                    yield pb.CacheMessage(heartbeat=pb.Heartbeat(sent_unix_ms=int(time.time()
                                                                                  * 1000)))
                try:
                    msg = out.get(timeout=min(0.5, max(0.01, beat_at - now)))
                except queue.Empty:
                    continue
                if msg is None:
                    break
                ended = False
                if reg.batches:  # what else is queued, in one message (none: msg alone)
                    msg, ended = with_queued(msg, out)
                yield msg
                if ended:
                    break
            if lost and not self._stopping.is_set():
                self._refuse_for_now(context, lost[0])
            if self._stopping.is_set():
                context.abort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
            with self._lock:  # replaced by a newer stream that is live (a stale one that
                # took a generation while its client left is no reason to stop this board)
                newer = self._context.get(device) if self._generation.get(device) != gen \
                    else None
                replaced_by = self._peer.get(device) if newer is not None and \
                    newer.is_active() else None
            if replaced_by is not None and not self._stopping.is_set():
                context.abort(grpc.StatusCode.ABORTED, f"{REPLACED_STREAM}: drafter {device!r} "
                                                       f"attached again from {replaced_by}")
            if silence:  # an error, not a clean end: the board (if it lives) says why
                context.abort(grpc.StatusCode.UNAVAILABLE, silence)
        finally:
            stop.set()
            if events is not None:
                self._inboxes.remove(events)
            if self.metrics is not None:
                self.metrics.detach()
            if seen_at is None and heard:  # its stream ended otherwise (closed by the board,
                # or by gRPC's keepalive on a link gone silent): seen when last heard too
                # (never later than now: a paced stream's mark is set ahead, chunk_intake)
                seen_at = time.time() - max(0.0, time.monotonic() - heard[0])
            with self._lock:  # mark_gone under the lock: a newer stream cannot slip in between
                if self._generation.get(device) == gen:
                    del self._generation[device]
                    self._peer.pop(device, None)
                    self._context.pop(device, None)
                    try:
                        self.store.devices.mark_gone(device, seen_at)
                    except (redis.RedisError, OSError, ValueError, AttributeError) as e:
                        # its alive mark expires by itself; ValueError, AttributeError: the
                        # client's socket was closed under it (the cache shutting down: seen in a
                        # soak, and as redis-py reading a connection whose buffer it had dropped)
                        log.warning("drafter %s: cannot mark it gone: %s", device, e)
                    log.info("drafter %s detached (last heard %.1f s before)", device,
                             max(0.0, time.time() - seen_at) if seen_at is not None else 0.0)
            with self._streams_done:
                self._streams.pop(stop, None)
                self._streams_done.notify_all()

    @staticmethod
    def _refuse_for_now(context, why: str) -> None:
        """End an Attach call UNAVAILABLE with a retry hint: the cache is up but cannot serve the
        drafter yet (its Redis is recovering), so the drafter comes back after the hint instead
        of backing off."""
        context.set_trailing_metadata(retry_after_metadata(RETRY_AFTER_MS))
        context.abort(grpc.StatusCode.UNAVAILABLE, why)

    def _is_current(self, device: str, gen: int) -> bool:
        with self._lock:
            return self._generation.get(device) == gen

    def _assignment(self, sid: str) -> pb.CacheMessage | None:
        snap = self.store.snapshot(sid)
        if snap is None:
            return None
        msg = pb.Assignment(session_id=sid, tokens=snap.tokens,
                            sampling=params_to_pb(snap.params), epoch=snap.epoch)
        if snap.output_end is not None:  # unset: not said (the board drafts to its window)
            msg.output_end = snap.output_end
        return pb.CacheMessage(assignment=msg)

    def _event_message(self, ev: InboxEvent | None) -> pb.CacheMessage | None:
        if ev is None:
            return None
        if ev.kind == "assign":
            return self._assignment(ev.session_id)
        if ev.kind == "close":
            return pb.CacheMessage(closed=pb.SessionClosed(session_id=ev.session_id))
        if not ev.fix:
            msg = pb.Commit(session_id=ev.session_id, epoch=ev.epoch, committed_end=ev.end)
        else:
            msg = pb.Commit(session_id=ev.session_id, epoch=ev.epoch, committed_end=ev.end,
                            is_fix=True, fix_position=ev.position, fix_token=ev.token,
                            fix_more=list(ev.more))
        if ev.wanted is not None:  # unset: not said (a board keeps its whole window)
            msg.wanted = ev.wanted
        return pb.CacheMessage(commit=msg)
