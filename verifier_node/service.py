"""The Verifier gRPC service: ``Generate`` streams committed tokens, ``Cancel`` stops a session.

Bad requests are refused before any work with INVALID_ARGUMENT (token ids out of range, a prompt
over the context limit, bad sampling parameters), a pinned drafter that is not attached with
FAILED_PRECONDITION, a full admission queue with RESOURCE_EXHAUSTED, an unknown session with
NOT_FOUND. A client that goes away or whose deadline passes cancels its session.
"""

from __future__ import annotations

import logging

import grpc

from edgespec.config import ConfigError
from edgespec.engine import Request
from edgespec.local import TextStream
from edgespec.models import encode_prompt
from edgespec.v1 import edgespec_pb2 as pb
from edgespec.v1 import edgespec_pb2_grpc as pb_grpc
from edgespec.wire import params_from_pb, stats_to_pb

from .scheduler import Overloaded, Scheduler, Ticket

log = logging.getLogger("edgespec.verifier")


class VerifierService(pb_grpc.VerifierServicer):
    def __init__(self, scheduler: Scheduler, store, tokenizer, vocab_size: int,
                 default_max_new_tokens: int = 128):
        self.scheduler, self.store, self.tokenizer = scheduler, store, tokenizer
        self.vocab_size = vocab_size
        self.default_max_new = default_max_new_tokens
        self.open: dict[str, Ticket] = {}

    def _prompt_ids(self, req: pb.GenerateRequest) -> list[int]:
        if req.prompt_ids:
            ids = list(req.prompt_ids)
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise ConfigError(f"prompt token ids must be in [0, {self.vocab_size})")
            return ids
        if req.messages:
            msgs = [{"role": m.role, "content": m.content} for m in req.messages]
            return encode_prompt(self.tokenizer, messages=msgs)
        if not req.prompt:
            raise ConfigError("give prompt, messages or prompt_ids")
        return encode_prompt(self.tokenizer, req.prompt, raw=req.raw)

    def Generate(self, request, context):
        try:
            ids = self._prompt_ids(request)
            params = params_from_pb(request.sampling)
            if request.max_new_tokens < 0:
                raise ConfigError("max_new_tokens must be >= 0 (0: the server's default)")
            device = request.device_id or None
            if device and not self.store.is_alive(device):
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"drafter {device!r} is not attached")
            reserved = device is None
            if reserved:
                device = self.store.pick_device()
            ticket = Ticket(Request(ids, request.max_new_tokens or self.default_max_new, params),
                            device, reserved and device is not None)
            try:
                self.scheduler.submit(ticket)
            except BaseException:
                if ticket.reserved:
                    self.store.release_pick(device)
                raise
        except ConfigError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Overloaded as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"verifier overloaded: {e}")
        sid = ticket.session_id
        self.open[sid] = ticket
        context.add_callback(lambda: self.scheduler.cancel(sid))
        try:
            yield pb.GenerateResponse(session_id=sid, device_id=device or "",
                                      prompt_tokens=len(ids))
            pieces: list[str] = []
            text = TextStream(self.tokenizer, pieces.append)
            while True:
                kind, value = ticket.events.get()
                if kind == "tokens":
                    text(value)
                    yield pb.GenerateResponse(session_id=sid, token_ids=value,
                                              text="".join(pieces))
                    pieces.clear()
                elif kind == "done":
                    yield pb.GenerateResponse(session_id=sid, finished=True,
                                              finish_reason=value.finish_reason,
                                              stats=stats_to_pb(value.stats))
                    return
                else:
                    if isinstance(value, ConfigError):
                        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(value))
                    log.error("session %s failed: %r", sid, value)
                    context.abort(grpc.StatusCode.INTERNAL, f"generation failed: {value}")
        finally:
            self.open.pop(sid, None)

    def Cancel(self, request, context):
        if request.session_id not in self.open:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no running session {request.session_id!r}")
        self.scheduler.cancel(request.session_id)
        return pb.CancelResponse(cancelled=True)
