"""The Verifier gRPC service: ``Generate`` streams committed tokens, ``Cancel`` stops a session.

Bad requests are refused before any work with INVALID_ARGUMENT (token ids out of range, a prompt
over the context limit, bad sampling parameters, two kinds of prompt at once, a malformed id), a
pinned drafter that is not attached with FAILED_PRECONDITION, a full admission queue with
RESOURCE_EXHAUSTED, an unknown session with NOT_FOUND, a draining or stopping verifier with
UNAVAILABLE (retryable: the SDK resumes the session). A client that goes away, or whose deadline
passes, cancels its session unless another stream follows it.

A request with ``resume_session_id`` continues a session from what the cache holds: the
running one when this verifier runs it, else re-admitted from its committed tokens. A session
the cache lost is re-created by the client: its original request again, with the tokens it
received (``committed_ids``) and ``lost_session_id``; the stream then starts after them. The
first response reports the session's sampling parameters, the seed the verifier chose for
unseeded sampling included, so that a re-created session continues the same draw, and the
kernel set its output is the decoding of (``kernel_set``; ``kernels_differ_from`` > 0: resumed
from a verifier with other kernels, the output's decoding differs from that position).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc

from edgespec import __version__
from edgespec.config import ConfigError
from edgespec.protocol.ids import check_session_id
from edgespec.protocol.lineage import Lineage
from edgespec.protocol.token_logprob import TokenLogprob
from edgespec.models.text_stream import TextStream
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc
from edgespec.wire.convert import (logprobs_to_pb, params_from_pb, params_to_pb,
                                   refusal_metadata, retry_after_metadata, stats_to_pb)

from .admission import Admission, DrafterMissing, GenerationRequest, SessionNotFound
from .metrics import acceptance
from .tickets import QueueFull, ShuttingDown, Ticket, TooSlowForDeadline

log = logging.getLogger("edgespec.verifier")

POLL_S = 0.5  # how often a waiting handler checks that its client is still there
RESUMES_OUTSIDE_CAP = 1  # a session's resumed streams open at once that the stream cap spares


def generation_request(req: pb.GenerateRequest) -> GenerationRequest:
    """The transport-neutral request of a wire one (raises ConfigError on bad parameters)."""
    if req.resume_session_id and req.resume_from < 0:  # a count of tokens the client holds
        raise ConfigError(f"resume_from must be >= 0 (the output tokens the client already "
                          f"holds), got {req.resume_from}")
    if req.prompt_only and req.max_new_tokens:
        raise ConfigError(f"prompt_only asks for no output: leave max_new_tokens unset, got "
                          f"{req.max_new_tokens}")
    if req.prompt_only and req.committed_ids:
        raise ConfigError("prompt_only has no output: a re-created prompt alone holds no "
                          "committed_ids")
    # fields that go with others, refused alone rather than read as something else
    if req.committed_ids and not req.lost_session_id:
        raise ConfigError("committed_ids go with lost_session_id: they are the output a "
                          "client holds of a session the cache lost, re-created from them")
    if (req.kernel_set or req.kernels_differ_from) and not (req.resume_session_id
                                                            or req.lost_session_id):
        raise ConfigError("kernel_set and kernels_differ_from go with resume_session_id or "
                          "lost_session_id: they say which kernels decoded the output a "
                          "client holds of a session it resumes or re-creates")
    if req.resume_from and not req.resume_session_id:
        raise ConfigError("resume_from goes with resume_session_id (the output tokens the "
                          "client already holds of the session it resumes)")
    if req.raw and req.messages:
        raise ConfigError("raw sends a prompt as it is: messages always go through the chat "
                          "template")
    return GenerationRequest(
        prompt=req.prompt if req.HasField("prompt") else None, raw=req.raw,
        messages=[{"role": m.role, "content": m.content} for m in req.messages],
        # a repeated field cannot tell [] from none: the SDK refuses an empty list itself
        prompt_ids=list(req.prompt_ids) or None, max_new_tokens=req.max_new_tokens,
        params=params_from_pb(req.sampling), device_id=req.device_id,
        resume_session_id=req.resume_session_id, verify=req.verify,
        committed=list(req.committed_ids), lost_session_id=req.lost_session_id,
        images=list(req.images), kernel_set=req.kernel_set,
        kernels_differ_from=req.kernels_differ_from,
        logprobs=req.logprobs if req.HasField("logprobs") else None,
        prompt_logprobs=req.prompt_logprobs if req.HasField("prompt_logprobs") else None,
        prompt_only=req.prompt_only)


def resume_count_refused(resume_from: int, ticket: Ticket) -> str | None:
    """Why a resume's ``resume_from`` (the output tokens the client says it holds) is more than
    any client of the session can hold, or None: past the output of a session that ended, or
    past its output limit. (More than the cache holds of a running session is fine: the cache
    may have lost its last second, and the client's count wins.)"""
    limit, out = ticket.request.max_new_tokens, len(ticket.tokens)
    past = (f"the output of {out} tokens it ended with" if ticket.ended and resume_from > out
            else f"its output limit of {limit} tokens" if limit and resume_from > limit
            else None)
    return f"resume_from {resume_from} is past {past}: it counts the output tokens the " \
        "client already holds of the session" if past else None


PROMPT_LOGPROBS_PER_REPLY = 2048  # entries: about 600 KB with 20 alternatives (4 MiB a message)


def prompt_logprobs_replies(sid: str, ticket: Ticket) -> list[pb.GenerateResponse]:
    """The ticket's prompt logprobs (set once its prompt is in) as responses of their own, in
    pieces of at most PROMPT_LOGPROBS_PER_REPLY (one, empty, for a prompt of one token); none
    while they are not set."""
    entries = ticket.prompt_logprobs
    if entries is None:
        return []
    out = []
    for start in range(0, max(1, len(entries)), PROMPT_LOGPROBS_PER_REPLY):
        piece = pb.PromptLogprobs(start=start, entries=logprobs_to_pb(
            entries[start:start + PROMPT_LOGPROBS_PER_REPLY]))
        out.append(pb.GenerateResponse(session_id=sid, prompt_logprobs=piece))
    return out


def response_logprobs(ticket: Ticket, cursor: int, new: list[int]
                      ) -> tuple[list[int], list[TokenLogprob]]:
    """The tokens ``new`` (read at ``cursor``) that the next response sends, and their
    logprobs when the session asked for them: all of them, or, for the tokens of a resumed
    session that an earlier verifier committed (``request.committed``, before the break but
    not received), a response of those tokens alone with none (the SDK gives them None)."""
    if ticket.request.logprobs is None:
        return new, []
    kept_from = len(ticket.request.committed)
    if cursor < kept_from:
        return new[:kept_from - cursor], []
    return new, ticket.logprobs_of(cursor, cursor + len(new))


class VerifierService(pb_grpc.VerifierServicer):
    def __init__(self, admission: Admission, model_name: str = ""):
        self.admission = admission
        self.model_name = model_name
        self.scheduler = admission.scheduler
        self.tokenizer = admission.tokenizer
        self.max_streams = self.scheduler.capacity  # one stream per session it can hold
        self._streams = 0
        self._resuming: dict[str, int] = {}  # session id -> its open streams outside the cap
        self._lock = threading.Lock()
        # what the server's health monitor last found, set by the server that composes this
        # service (None: the scheduler's own verdict alone): whether it serves (its health),
        # and whether the draft cache's Redis answered (else Status does not wait out the
        # client's retries to list the drafters)
        self.serving: Callable[[], bool] | None = None
        self.why_not_serving: Callable[[], str | None] | None = None  # health's reason
        self.cache_reachable: Callable[[], bool] | None = None

    # -- RPCs -------------------------------------------------------------------------------------
    def Generate(self, request, context):
        # A resume continues a session that already counts (its client lost the stream the
        # verifier may not have noticed yet): one a session is never refused. More resumes of
        # one session at once count as new streams, so that a client cannot hold every worker
        # thread by resuming one session over and over; and so does the resume of a session
        # this verifier does not hold (another replica's, one long ended, an id made up: no
        # stream of it counts here), so that made-up ids cannot pass the cap either.
        sid = request.resume_session_id
        held = bool(sid) and self.scheduler.ticket(sid) is not None
        with self._lock:
            outside = held and self._resuming.get(sid, 0) < RESUMES_OUTSIDE_CAP
            full = not outside and self._streams >= self.max_streams
            if outside:
                self._resuming[sid] = self._resuming.get(sid, 0) + 1
            elif not full:
                self._streams += 1
        if full:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"verifier overloaded: {self.max_streams} streams are open")
        try:
            yield from self._generate(request, context)
        finally:
            with self._lock:
                if not outside:
                    self._streams -= 1
                elif self._resuming[sid] > 1:
                    self._resuming[sid] -= 1
                else:
                    del self._resuming[sid]

    def _generate(self, request, context):
        if len(request.committed_ids) > self.admission.max_len:  # before they are copied
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"committed_ids ({len(request.committed_ids)}) exceed the context "
                          f"limit ({self.admission.max_len})")
        try:
            left = context.time_remaining()  # about 2**63 s when the call has no deadline
            ticket = self.admission.admit(generation_request(request),
                                          left if left is not None and left < 1e9 else None)
        except ConfigError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except SessionNotFound as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except DrafterMissing as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except QueueFull as e:
            if e.retry_after_s:
                context.set_trailing_metadata(retry_after_metadata(e.retry_after_s * 1000))
            # a deadline the measured pace cannot meet is not always load: said as it is
            said = "cannot finish within its deadline" if isinstance(e, TooSlowForDeadline) \
                else "verifier overloaded"
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{said}: {e}")
        except ShuttingDown as e:
            # marked, so that the SDK fails a new call at once instead of retrying until its
            # deadline (a draining verifier admits nothing new until it has stopped)
            context.set_trailing_metadata(refusal_metadata("draining"))
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except Exception as e:  # the cache is unreachable, say
            log.warning("admission failed: %r", e)
            context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot admit the request: {e}")
        # The client's own count wins even when the cache holds fewer tokens (Redis lost its
        # last second): the output is deterministic, so the tokens regenerated up to that count
        # are the ones the client has, and it gets no duplicates.
        # A re-created session (the cache lost it) starts after the tokens the client holds.
        cursor = (request.resume_from if request.resume_session_id
                  else len(request.committed_ids))
        with self.admission.follow(ticket):  # refused inside: its claim taken up, and a
            # session no reader follows any more cancelled, as when a reader leaves
            why = resume_count_refused(cursor, ticket) if request.resume_session_id else None
            if why:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
            yield from self._follow(ticket, cursor, request, context)

    def _follow(self, ticket: Ticket, cursor: int, request, context):
        sid = ticket.session_id
        lineage = ticket.request.lineage or Lineage(self.admission.kernels)
        yield pb.GenerateResponse(session_id=sid, device_id=ticket.device or "",
                                  prompt_tokens=len(ticket.request.prompt_ids),
                                  resumed=bool(request.resume_session_id
                                               or request.lost_session_id),
                                  sampling=params_to_pb(ticket.request.params),
                                  kernel_set=lineage.kernels,
                                  kernels_differ_from=lineage.differs_from)
        pieces: list[str] = []
        text = None  # made at the first new tokens, when the ones before the cursor exist
        # this stream's request asked for the prompt's logprobs: sent once, when set (before
        # the session's first token: a resumed stream's earlier tokens may come first)
        prompt_due = request.HasField("prompt_logprobs")
        while True:
            new = ticket.wait(cursor, POLL_S)
            if new:
                if text is None:
                    text = TextStream(self.tokenizer, pieces.append, ticket.tokens[:cursor])
                new, shown = response_logprobs(ticket, cursor, new)
                cursor += len(new)
                text(new)
                if prompt_due:
                    replies = prompt_logprobs_replies(sid, ticket)
                    prompt_due = not replies
                    yield from replies
                yield pb.GenerateResponse(session_id=sid, token_ids=new, text="".join(pieces),
                                          logprobs=logprobs_to_pb(shown))
                pieces.clear()
                continue
            if ticket.result is not None:
                res = ticket.result
                if text is None and cursor:  # resumed after its last tokens: the reader has
                    text = TextStream(self.tokenizer, pieces.append, ticket.tokens[:cursor])
                if text is not None:  # an output that ends mid-character: its last bytes
                    text.flush()
                if prompt_due:
                    yield from prompt_logprobs_replies(sid, ticket)
                # the drafter again (one may have taken the session over since the first
                # response), with prompt_tokens: a client keeps the last response carrying them
                yield pb.GenerateResponse(session_id=sid, finished=True,
                                          finish_reason=res.finish_reason,
                                          stats=stats_to_pb(res.stats), text="".join(pieces),
                                          device_id=ticket.device or "",
                                          prompt_tokens=len(ticket.request.prompt_ids))
                return
            if ticket.error is not None:
                self._abort_for(ticket.error, sid, context)
            if not context.is_active():
                return
            if not self.scheduler.is_alive():
                context.abort(grpc.StatusCode.UNAVAILABLE, "the verifier's scheduler stopped")

    @staticmethod
    def _abort_for(exc: Exception, sid: str, context) -> None:
        if isinstance(exc, ConfigError):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if isinstance(exc, ShuttingDown):
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        log.error("session %s failed: %s", sid, exc)
        context.abort(grpc.StatusCode.UNAVAILABLE, f"session {sid} failed: {exc}")

    def Status(self, request, context):
        sched, metrics = self.scheduler, self.scheduler.metrics
        active, queued = sched.load()
        drafters = []
        devices = []
        if self.cache_reachable is None or self.cache_reachable():
            try:
                devices = self.admission.store.devices.listing()
            except Exception as e:  # the cache is unreachable: report what this process knows
                log.warning("status: cannot read the drafters: %s", e)
        why = sched.unhealthy_reason  # read once: the scheduler's, else health's
        if why is None and self.serving is not None and not self.serving():
            why = (self.why_not_serving() if self.why_not_serving is not None else None) or \
                "health says NOT_SERVING"
        healthy = why is None
        links = sched.engine.lateness.snapshot()
        for d in devices:
            counts = metrics.device_draft_counts(d.device_id) if metrics else (0, 0, 0)
            rate, length = acceptance(*counts)
            link = links.get(d.device_id)
            drafters.append(pb.DrafterStatus(
                device_id=d.device_id, draft_model=d.draft_model, attached=d.attached,
                sessions=d.sessions, max_sessions=d.max_sessions, acceptance_rate=rate,
                mean_acceptance_length=length, last_seen_s=d.last_seen_s,
                late=bool(link and link.late), drafts_missed=link.missed if link else 0,
                steps_unwaited=link.unwaited if link else 0,
                session_steps=link.session_steps if link else 0,
                ready_drafts=link.ready_drafts if link else 0,
                verified_drafts=link.verified_drafts if link else 0,
                finished_drafts=counts[0], finished_draft_tokens=counts[1],
                finished_accepted_tokens=counts[2]))
        return pb.StatusResponse(
            model=self.model_name, version=__version__, drafters=drafters,
            active_sessions=active, queued_sessions=queued, free_kv_slots=sched.engine.free_slots,
            kv_slots=sched.engine.cfg.max_sessions, healthy=healthy, unhealthy_reason=why or "",
            dtype=str(sched.engine.target.dtype).removeprefix("torch."),
            tokens_per_s_last_minute=metrics.tokens_per_s_last_minute() if metrics else 0.0,
            head=head_status(sched.engine.head, metrics),
            runner=runner_status(sched.engine.target), cost=server_cost(metrics))

    def Cancel(self, request, context):
        try:
            sid = check_session_id(request.session_id)
        except ConfigError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not self.scheduler.cancel(sid):
            context.abort(grpc.StatusCode.NOT_FOUND, f"no running session {sid!r}")
        return pb.CancelResponse(cancelled=True)


def server_cost(metrics) -> pb.ServerCost:
    """The server's cost since it started, for the Status RPC (empty without metrics)."""
    if metrics is None:
        return pb.ServerCost()
    cost = metrics.server_cost()
    return pb.ServerCost(**{**cost, "cpu_s": cost["cpu_s"] or 0.0})


def runner_status(runner) -> pb.RunnerStatus:
    """How the target runner runs its steps, for the Status RPC."""
    out = pb.RunnerStatus(device=str(runner.device), kernels=runner.kernels,
                          attention=getattr(runner, "attention", None) or "",
                          kernel_set=runner.kernel_set.fingerprint,
                          kernel_set_description=runner.kernel_set.describe())
    if runner.graphs is not None:
        g = runner.graphs.state()
        out.graph_buckets, out.graphs_captured = g.buckets, g.captured
        out.graphs_capture_s, out.graphs_failed = g.capture_s, g.failed or ""
        out.graph_replays = g.replays
    return out


def head_status(head, metrics) -> pb.HeadStatus:
    """The verifier's draft head for the Status RPC (empty without one)."""
    if head is None:
        return pb.HeadStatus()
    drafted, accepted = metrics.head_totals() if metrics else (0, 0)
    learner = head.learner
    return pb.HeadStatus(kind=head.head.cfg.kind, source=head.source, version=head.version,
                         held_out_tokens_per_step=head.held_out, draft_tokens=drafted,
                         accepted_tokens=accepted, learning=learner is not None,
                         buffered_tokens=learner.buffered_tokens if learner else 0)
