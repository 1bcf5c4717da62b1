"""One client endpoint in front of several verifier replicas that share one draft cache.

A replica is an ordinary verifier (``edgespec verifier``) with its own KV slots; the router
implements the same ``Verifier`` service and forwards each call:

- ``Generate`` goes to the healthy replica with the fewest sessions this router has in flight on
  it (ties: the first). A replica that refuses before the first response (UNAVAILABLE: down or
  draining; RESOURCE_EXHAUSTED: full) is skipped and the next is tried. A stream that breaks
  midway is reported to the client as is: the SDK resumes it by session id. A resume goes first
  to the replica the session ran on (it may still hold it, e.g. after a client's link broke),
  else to a replica with the session's kernel set (``edgespec.runner.kernel_set``: the
  fingerprint its first response reported, or the request's ``kernel_set``), which continues
  it as its first replica would, else to any replica, since the session's committed tokens live
  in Redis (that replica reports from which position its decoding differs).
- ``Cancel`` is sent to every replica (only the one running the session knows it).
- ``Status`` merges the replicas' answers: slots and sessions summed, the fleet's drafters once
  each, with what each replica saw of a drafter (its steps, drafts missed, ready and verified)
  summed, late when any replica judges it so, its acceptance over all the replicas' finished
  sessions together.

Health: a monitor thread checks every replica's health each second, and reads a replica's
kernel set fingerprint (``Status``) when it turns healthy and every ``KERNELS_EVERY_S``; the
router is SERVING while at least one replica is.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from edgespec.wire.request_parsing import add_servicer
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc
from edgespec.wire.convert import auth_metadata, resolve_token
from edgespec.wire.channels import bind, make_channel, make_server

from .metrics import acceptance

log = logging.getLogger("edgespec.router")

MAX_REMEMBERED = 100_000  # sessions whose replica the router remembers for resumes
SKIP_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
VERIFIER_SERVICE = "edgespec.v1.Verifier"
KERNELS_EVERY_S = 30.0  # how often a healthy replica's kernel set is read again


class _Replica:
    def __init__(self, address: str):
        self.address = address
        self.channel = make_channel(address)
        self.stub = pb_grpc.VerifierStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.active = 0  # Generate streams this router has open on it
        self.healthy = False
        self.kernel_set = ""  # its runner's fingerprint, as its Status last said ("": unread)
        self.kernel_set_read = 0.0  # when (monotonic)


class VerifierRouter(pb_grpc.VerifierServicer):
    def __init__(self, listen: str, replicas: list[str], token: str | None = None,
                 max_streams: int = 1024):
        if not replicas:
            raise ValueError("a router needs at least one replica")
        self.token = resolve_token(token)
        self.metadata = auth_metadata(self.token)
        self._replicas = [_Replica(a) for a in replicas]
        # session id -> (the replica it ran on, the kernel set its first response reported)
        self._homes: OrderedDict[str, tuple[int, str]] = OrderedDict()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        # Generate streams capped below the pool (refused at once beyond): health checks,
        # Cancel and Status always find a thread
        self.server = make_server(max_streams + 16, self.token,
                                  {f"/{VERIFIER_SERVICE}/Generate": max_streams})
        add_servicer(pb_grpc.add_VerifierServicer_to_server, self, self.server)
        self.health = health.HealthServicer()
        add_servicer(health_pb2_grpc.add_HealthServicer_to_server, self.health, self.server)
        self.port = bind(self.server, listen)

    @property
    def replicas(self) -> list[str]:
        return [r.address for r in self._replicas]

    def healthy(self) -> bool:
        return any(r.healthy for r in self._replicas)

    def start(self) -> "VerifierRouter":
        self._check_health()
        self.server.start()
        threading.Thread(target=self._monitor, daemon=True, name="router-health").start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self.server.stop(grace=2.0).wait(5)
        for r in self._replicas:
            r.channel.close()

    # -- health ---------------------------------------------------------------------------------
    def _check_health(self) -> None:
        for r in self._replicas:
            was = r.healthy
            try:
                res = r.health.Check(health_pb2.HealthCheckRequest(service=VERIFIER_SERVICE),
                                     timeout=1.0, metadata=self.metadata)
                r.healthy = res.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                r.healthy = False
            if r.healthy and (not was or time.monotonic() - r.kernel_set_read > KERNELS_EVERY_S):
                self._read_kernel_set(r)
        status = (health_pb2.HealthCheckResponse.SERVING if self.healthy()
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", VERIFIER_SERVICE):
            self.health.set(name, status)

    def _read_kernel_set(self, r: _Replica) -> None:
        """The replica's kernel set fingerprint, from its Status (kept as was if it fails)."""
        try:
            s = r.stub.Status(pb.StatusRequest(), timeout=2.0, metadata=self.metadata)
        except grpc.RpcError as e:
            log.info("replica %s: cannot read its kernel set (%s)", r.address, e.code().name)
            return
        if r.kernel_set and s.runner.kernel_set != r.kernel_set:
            log.warning("replica %s now serves kernel set %s (was %s)", r.address,
                        s.runner.kernel_set, r.kernel_set)
        r.kernel_set, r.kernel_set_read = s.runner.kernel_set, time.monotonic()

    def _monitor(self) -> None:
        while not self._stopping.wait(1.0):
            self._check_health()

    # -- routing --------------------------------------------------------------------------------
    def _acquire(self, tried: set[int], prefer: int | None, kernels: str = "") -> int | None:
        """Pick the replica for the next try and count the stream on it, in one step: the
        preferred one if healthy and untried, else healthy ones, those of the kernel set
        ``kernels`` first (when given), by fewest active streams, then the others (a health
        check may lag)."""
        with self._lock:
            left = [i for i in range(len(self._replicas)) if i not in tried]
            if not left:
                return None
            if prefer in left and self._replicas[prefer].healthy:
                pick = prefer
            else:
                reps = self._replicas
                pick = min(left, key=lambda i: (not reps[i].healthy,
                                                bool(kernels) and reps[i].kernel_set != kernels,
                                                reps[i].active, i))
            self._replicas[pick].active += 1
            return pick

    def _remember(self, session_id: str, replica: int, kernels: str) -> None:
        with self._lock:
            self._homes[session_id] = (replica, kernels)
            self._homes.move_to_end(session_id)
            while len(self._homes) > MAX_REMEMBERED:
                self._homes.popitem(last=False)

    def Generate(self, request, context):
        # a resume goes first where the session ran (that replica may still hold it), else
        # where its kernel set serves
        with self._lock:
            prefer, kernels = self._homes.get(request.resume_session_id, (None, ""))
        kernels = kernels or request.kernel_set
        tried: set[int] = set()
        last: grpc.RpcError | None = None
        while (i := self._acquire(tried, prefer, kernels)) is not None:
            tried.add(i)
            replica = self._replicas[i]
            try:
                call = replica.stub.Generate(request, timeout=_deadline(context),
                                             metadata=self.metadata)
                context.add_callback(call.cancel)  # the client left: so does the session
                first = True
                try:
                    for response in call:
                        if first:  # the set the session began on, as the SDK holds it
                            self._remember(response.session_id, i, response.kernel_set)
                            first = False
                        yield response
                    return
                except grpc.RpcError as e:
                    if first and e.code() in SKIP_CODES and context.is_active():
                        last = e
                        log.info("replica %s refused (%s); trying the next", replica.address,
                                 e.code().name)
                        continue
                    _abort_as(context, e)
            finally:
                with self._lock:
                    replica.active -= 1
        if last is not None:
            _abort_as(context, last)
        context.abort(grpc.StatusCode.UNAVAILABLE, "no verifier replica is available")

    def Cancel(self, request, context):
        found = answered = False
        for r in self._replicas:
            try:
                found |= r.stub.Cancel(request, timeout=5.0, metadata=self.metadata).cancelled
                answered = True
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    context.abort(e.code(), e.details() or "")
                answered |= e.code() == grpc.StatusCode.NOT_FOUND
        if not answered:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no verifier replica answers")
        if not found:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no running session "
                                                     f"{request.session_id[:40]!r}")
        return pb.CancelResponse(cancelled=True)

    def Status(self, request, context):
        merged = pb.StatusResponse()
        answered: list[pb.StatusResponse] = []
        reasons: list[str] = []  # each replica's that does not serve, or does not answer
        drafters: list[pb.DrafterStatus] = []
        for r in self._replicas:
            try:
                s = r.stub.Status(request, timeout=5.0, metadata=self.metadata)
            except grpc.RpcError as e:
                reasons.append(f"{r.address}: does not answer ({e.code().name})")
                continue
            if not s.healthy:
                reasons.append(f"{r.address}: {s.unhealthy_reason or 'no reason given'}")
            answered.append(s)
            drafters.extend(s.drafters)
            merged.active_sessions += s.active_sessions
            merged.queued_sessions += s.queued_sessions
            merged.free_kv_slots += s.free_kv_slots
            merged.kv_slots += s.kv_slots
            merged.tokens_per_s_last_minute += s.tokens_per_s_last_minute
            for field in ("cpu_s", "committed_tokens", "forwards", "draft_tokens",
                          "accepted_tokens"):
                setattr(merged.cost, field, getattr(merged.cost, field) + getattr(s.cost, field))
            merged.healthy |= s.healthy
        if not answered:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no verifier replica answers")
        if not merged.healthy:  # each replica's reason, as it gave it
            merged.unhealthy_reason = "no replica serves: " + "; ".join(reasons)
        describe_replicas(merged, answered)
        merged.drafters.extend(merged_drafters(drafters))
        return merged


def describe_replicas(merged: pb.StatusResponse, answered: list[pb.StatusResponse]) -> None:
    """The model, dtype and runner ``merged`` reports: those of the replicas that serve (of
    those that answered where none does), the first's; where they decode on more than one
    kernel set (a resume is routed by it), the runner's description names each."""
    serving = [s for s in answered if s.healthy] or answered
    first = serving[0]
    merged.model, merged.version, merged.dtype = first.model, first.version, first.dtype
    merged.runner.CopyFrom(first.runner)
    sets = {s.runner.kernel_set: s for s in serving if s.runner.kernel_set}
    if len(sets) > 1:
        merged.runner.kernel_set_description = (
            f"the serving replicas decode on {len(sets)} kernel sets: " + "; ".join(
                f"{fp[:8]} ({s.dtype}): {s.runner.kernel_set_description}"
                for fp, s in sets.items()))


# what each replica counts of a drafter's links to it, summed over the replicas
LINK_COUNTS = ("drafts_missed", "steps_unwaited", "session_steps", "ready_drafts",
               "verified_drafts")
# what each replica's acceptance figures come from (its finished sessions), pooled
FINISHED_COUNTS = ("finished_drafts", "finished_draft_tokens", "finished_accepted_tokens")


def merged_drafters(reports: list[pb.DrafterStatus]) -> list[pb.DrafterStatus]:
    """The replicas' reports of the fleet's drafters, one per device in the order first seen:
    the cache's facts (attached, sessions, last seen) as the first report says them (the
    replicas share the cache), the replicas' counts summed, late when any replica judges it
    so, the acceptance rate and length of the drafts of all their finished sessions together
    (replicas that predate those counts: their figures weighted by drafts verified)."""
    by_device: dict[str, list[pb.DrafterStatus]] = {}
    for d in reports:
        by_device.setdefault(d.device_id, []).append(d)
    out = []
    for seen in by_device.values():
        d = pb.DrafterStatus()
        d.CopyFrom(seen[0])
        for field in LINK_COUNTS:
            setattr(d, field, sum(getattr(x, field) for x in seen))
        d.late = any(x.late for x in seen)
        if any(x.finished_drafts for x in seen) or not any(x.acceptance_rate for x in seen):
            for field in FINISHED_COUNTS:
                setattr(d, field, sum(getattr(x, field) for x in seen))
            d.acceptance_rate, d.mean_acceptance_length = acceptance(
                d.finished_drafts, d.finished_draft_tokens, d.finished_accepted_tokens)
        else:  # replicas that predate the counts: their figures weighted by drafts verified
            weights = [x.verified_drafts for x in seen] if d.verified_drafts else [1] * len(seen)
            total = sum(weights)
            d.acceptance_rate = sum(w * x.acceptance_rate for w, x in zip(weights, seen)) / total
            d.mean_acceptance_length = sum(w * x.mean_acceptance_length
                                           for w, x in zip(weights, seen)) / total
        out.append(d)
    return out


def _deadline(context) -> float | None:
    """The caller's time left, None without a deadline (gRPC reports ~2**63 s then)."""
    left = context.time_remaining()
    return None if left is None or left > 1e9 else left


def _abort_as(context, error: grpc.RpcError) -> None:
    """End the call as the replica ended it: its code, message and trailing metadata (a
    refusal's ``retry-after-ms`` and why it refused, which the SDK reads)."""
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    if trailing:
        context.set_trailing_metadata(tuple((k, v) for k, v in trailing))
    context.abort(error.code(), error.details() or "")
