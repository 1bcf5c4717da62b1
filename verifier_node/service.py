"""The Verifier gRPC service: ``Generate`` streams committed tokens, ``Cancel`` stops a session.

Bad requests are refused before any work with INVALID_ARGUMENT (token ids out of range, a prompt
over the context limit, bad sampling parameters, two kinds of prompt at once, a malformed id), a
pinned drafter that is not attached with FAILED_PRECONDITION, a full admission queue with
RESOURCE_EXHAUSTED, an unknown session with NOT_FOUND, a draining or stopping verifier with
UNAVAILABLE (retryable: the SDK resumes the session). A client that goes away, or whose deadline
passes, cancels its session unless another stream follows it.

A request with ``resume_session_id`` continues a session from what the cache holds: the
running one when this verifier runs it, else re-admitted from its committed tokens.
"""

from __future__ import annotations

import logging
import threading

import grpc

from edgespec.config import ConfigError
from edgespec.engine import Request
from edgespec.ids import check_device_id, check_session_id, shown
from edgespec.models import encode_prompt
from edgespec.text_stream import TextStream
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc
from edgespec.wire import params_from_pb, stats_to_pb

from .scheduler import Overloaded, Scheduler, ShuttingDown, Ticket

log = logging.getLogger("edgespec.verifier")

# A prompt longer than this many characters per context token cannot fit: refused before the
# tokenizer spends seconds on it.
MAX_CHARS_PER_TOKEN = 64
POLL_S = 0.5  # how often a waiting handler checks that its client is still there


class VerifierService(pb_grpc.VerifierServicer):
    def __init__(self, scheduler: Scheduler, store, tokenizer, vocab_size: int,
                 default_max_new_tokens: int = 128, max_streams: int = 72):
        self.scheduler, self.store, self.tokenizer = scheduler, store, tokenizer
        self.vocab_size = vocab_size
        self.default_max_new = default_max_new_tokens
        self.max_streams = max_streams
        self.max_len = scheduler.engine.target.max_len
        self._streams = 0
        self._lock = threading.Lock()

    # -- request checks -------------------------------------------------------------------------
    def _prompt_ids(self, req: pb.GenerateRequest) -> list[int]:
        given = [bool(req.prompt), bool(req.messages), bool(req.prompt_ids)]
        if sum(given) != 1:
            raise ConfigError("give exactly one of prompt, messages, prompt_ids")
        if req.prompt_ids:
            if len(req.prompt_ids) > self.max_len:
                raise ConfigError(f"the prompt ({len(req.prompt_ids)} tokens) exceeds the "
                                  f"context limit ({self.max_len})")
            if any(not 0 <= t < self.vocab_size for t in req.prompt_ids):
                raise ConfigError(f"prompt token ids must be in [0, {self.vocab_size})")
            return list(req.prompt_ids)
        chars = len(req.prompt) + sum(len(m.content) + len(m.role) for m in req.messages)
        if chars > MAX_CHARS_PER_TOKEN * self.max_len:
            raise ConfigError(f"the prompt ({chars} characters) exceeds the context limit "
                              f"({self.max_len} tokens)")
        if req.messages:
            msgs = [{"role": m.role, "content": m.content} for m in req.messages]
            return encode_prompt(self.tokenizer, messages=msgs)
        return encode_prompt(self.tokenizer, req.prompt, raw=req.raw)

    def _new_ticket(self, req: pb.GenerateRequest) -> Ticket:
        ids = self._prompt_ids(req)
        params = params_from_pb(req.sampling)
        if req.max_new_tokens < 0:
            raise ConfigError("max_new_tokens must be >= 0 (0: the server's default)")
        device = check_device_id(req.device_id) if req.device_id else None
        if device and not self.store.is_alive(device):
            raise _Refused(grpc.StatusCode.FAILED_PRECONDITION,
                           f"drafter {device!r} is not attached")
        request = Request(ids, req.max_new_tokens or self.default_max_new, params)
        if device is None:
            picked = self.store.pick_device()
            return Ticket(request, picked, reserved=picked is not None)
        return Ticket(request, device)

    def _resume_ticket(self, req: pb.GenerateRequest) -> Ticket:
        sid = check_session_id(req.resume_session_id)
        if req.prompt or req.messages or req.prompt_ids:
            raise ConfigError("a resumed session takes its prompt from the cache: send none")
        running = self.scheduler.ticket(sid)
        if running is not None:
            return running
        rec = self.store.load(sid)
        if rec is None:
            raise _Refused(grpc.StatusCode.NOT_FOUND, f"no session {shown(sid)} in the cache "
                                                      "(it finished long ago or expired)")
        if rec.finish_reason in ("stop", "length"):
            from edgespec.engine import Result
            from edgespec.metrics import Stats

            done = Ticket(Request(rec.prompt, rec.max_new_tokens, rec.params,
                                  committed=rec.committed), rec.device, session_id=sid)
            done.finish(Result(rec.committed, Stats(tokens=len(rec.committed)),
                               rec.finish_reason))
            return done
        device = rec.device if rec.device and self.store.is_alive(rec.device) else None
        request = Request(rec.prompt, rec.max_new_tokens, rec.params, committed=rec.committed)
        if device is None:
            picked = self.store.pick_device()
            return Ticket(request, picked, reserved=picked is not None, session_id=sid)
        return Ticket(request, device, session_id=sid)

    def _admit(self, req: pb.GenerateRequest) -> Ticket:
        ticket = self._resume_ticket(req) if req.resume_session_id else self._new_ticket(req)
        if ticket.ended:
            return ticket
        try:
            return self.scheduler.submit(ticket)
        except BaseException:
            if ticket.reserved:
                self.store.release_pick(ticket.device)
            raise

    # -- RPCs -------------------------------------------------------------------------------------
    def Generate(self, request, context):
        with self._lock:
            full = self._streams >= self.max_streams
            if not full:
                self._streams += 1
        if full:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"verifier overloaded: {self.max_streams} streams are open")
        try:
            yield from self._generate(request, context)
        finally:
            with self._lock:
                self._streams -= 1

    def _generate(self, request, context):
        try:
            ticket = self._admit(request)
        except ConfigError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except _Refused as e:
            context.abort(e.code, str(e))
        except Overloaded as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"verifier overloaded: {e}")
        except ShuttingDown as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except Exception as e:  # the cache is unreachable, say
            log.warning("admission failed: %r", e)
            context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot admit the request: {e}")
        sid = ticket.session_id
        # The client's own count wins even when the cache holds fewer tokens (Redis lost its
        # last second): the output is deterministic, so the tokens regenerated up to that count
        # are the ones the client has, and it gets no duplicates.
        cursor = max(0, request.resume_from) if request.resume_session_id else 0
        with ticket.cond:
            ticket.followers += 1
        try:
            yield from self._follow(ticket, cursor, request, context)
        finally:
            with ticket.cond:
                ticket.followers -= 1
                orphaned = ticket.followers == 0 and not ticket.ended
            if orphaned:  # the client gave up (deadline, disconnect): free its slot
                self.scheduler.cancel(sid)

    def _follow(self, ticket: Ticket, cursor: int, request, context):
        sid = ticket.session_id
        yield pb.GenerateResponse(session_id=sid, device_id=ticket.device or "",
                                  prompt_tokens=len(ticket.request.prompt_ids),
                                  resumed=bool(request.resume_session_id))
        pieces: list[str] = []
        text = None  # made at the first new tokens, when the ones before the cursor exist
        while True:
            new = ticket.wait(cursor, POLL_S)
            if new:
                if text is None:
                    text = TextStream(self.tokenizer, pieces.append, ticket.tokens[:cursor])
                cursor += len(new)
                text(new)
                yield pb.GenerateResponse(session_id=sid, token_ids=new, text="".join(pieces))
                pieces.clear()
                continue
            if ticket.result is not None:
                res = ticket.result
                yield pb.GenerateResponse(session_id=sid, finished=True,
                                          finish_reason=res.finish_reason,
                                          stats=stats_to_pb(res.stats))
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

    def Cancel(self, request, context):
        try:
            sid = check_session_id(request.session_id)
        except ConfigError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not self.scheduler.cancel(sid):
            context.abort(grpc.StatusCode.NOT_FOUND, f"no running session {sid!r}")
        return pb.CancelResponse(cancelled=True)


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
