"""The verifier's OpenAI-compatible HTTP API (Starlette routes under FastAPI, served by uvicorn).

``POST /v1/completions`` (prompt as text or token ids, no chat template) and
``POST /v1/chat/completions`` (messages through the chat template), both with ``stream: true``
(Server-Sent Events ending with ``data: [DONE]``; ``stream_options.include_usage`` adds a last
chunk with usage); ``GET /v1/models``; ``GET /health`` (200 when ready, 503 while loading,
draining or unhealthy); ``GET /metrics`` (Prometheus). Every generation goes through the same
``Admission`` as the gRPC service, so it is validated the same way and lossless unless the
verifier was started in a lossy mode (``--verify loose`` or ``--verify pad:DIR``). Each response
carries the request's speculative-decoding figures in an ``edgespec`` field: ``lossless`` (false
for a session verified in a lossy mode), ``verify`` (the mode) and ``lenient_tokens`` among
them.

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for malformed
JSON, bad parameters or a prompt over the context limit, 401 without the bearer token (when the
server has one), 404 for an unknown model or route (a route of /v1 asked for without it, as a
client whose base_url lacks /v1 does, gets a hint saying so), 413 for a request body over
``max_request_bytes`` (refused before it is read whole: ``body_limit``), 429 when the verifier
is overloaded, 503 while it drains. A client that disconnects mid-stream cancels its session;
one that disconnects before its request body arrived whole is logged (INFO) and left, no error.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from bisect import bisect_left
from dataclasses import dataclass
from typing import Callable

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from edgespec.config import ConfigError, EmptyPrompt, is_lossy
from edgespec.protocol.contract import StoreUnavailable
from edgespec.models.text_stream import TextStream

from .admission import Admission, DrafterMissing, SessionNotFound
from .api_errors import missing_v1_hint
from .body_limit import BODY_TIMEOUT_S, MIN_BYTES, BodyLimit
from .logprob_shapes import ChoiceLogprobs, LogprobShapes
from .openai_params import ApiError, error_response, parse_request
from .tickets import QueueFull, ShuttingDown, Ticket


# the status logged for a request whose client left before it was read whole (nginx's "client
# closed request"; no client receives it)
CLIENT_CLOSED = 499
log = logging.getLogger("edgespec.http")


@dataclass
class ServingState:
    """What the app serves from; the server fills ``admission`` and ``model_name`` once the
    model is loaded (until then /health answers 503 and the API "loading")."""

    registry: CollectorRegistry
    healthy: Callable[[], bool]  # the server's last health verdict (cheap: no I/O)
    admission: Admission | None = None
    model_name: str = ""
    shapes: LogprobShapes | None = None  # the logprobs' shapes, made once for the tokenizer


def make_app(state: ServingState, token: str | None = None,
             max_request_bytes: int = MIN_BYTES,
             body_timeout_s: float | None = BODY_TIMEOUT_S) -> FastAPI:
    app = FastAPI(title="edgespec", docs_url=None, redoc_url=None, openapi_url=None)
    # 413 before a body is read whole, 408 for one that does not come whole in time
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes, timeout_s=body_timeout_s)
    expected = token.encode() if token else None
    created = int(time.time())
    _add_error_handlers(app)

    def check_auth(request: Request) -> None:
        if expected is None:
            return
        # the scheme is case-insensitive (RFC 9110: "Bearer", "bearer"), the key is not
        scheme, _, got = request.headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(got.strip().encode(), expected):
            raise ApiError(401, "missing or wrong API key (header 'Authorization: Bearer ...')",
                           "authentication_error", code="invalid_api_key")

    def ready() -> Admission:
        if state.admission is None:
            raise ApiError(503, "the model is still loading", "service_unavailable",
                           code="loading")
        return state.admission

    @app.api_route("/health", methods=["GET", "HEAD"])  # a load balancer's probe may be HEAD
    async def health():  # the monitor's last verdict: never waits behind anything
        ok = state.admission is not None and state.healthy()
        return Response(status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
        return {"id": state.model_name, "object": "model", "created": created,
                "owned_by": "edgespec"}

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        ready()
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        check_auth(request)
        ready()
        if model_id != state.model_name:
            raise ApiError(404, f"the model '{model_id[:80]}' does not exist",
                           "invalid_request_error", "model", "model_not_found")
        return model_card()

    async def generate(request: Request, chat: bool):
        check_auth(request)
        admission, model_name = ready(), state.model_name
        try:
            body = await request.json()
        except ClientDisconnect:  # gone before its body came whole: no one to answer, no session
            log.info("a client of %s disconnected before its request body arrived whole",
                     request.url.path)
            return Response(status_code=CLIENT_CLOSED)
        except (ValueError, RecursionError):  # bad JSON, bad UTF-8, absurd nesting
            raise ApiError(400, "the request body is not valid JSON", "invalid_request_error")
        params = parse_request(body, chat, model_name)
        ticket = await _admit(admission, params, chat)
        if params.generation.logprobs is not None and state.shapes is None:
            state.shapes = LogprobShapes(admission.tokenizer)
        run = _Run(admission, ticket, params, chat, model_name, state.shapes)
        if params.stream:  # a client gone before the stream's first read: cancelled after
            return StreamingResponse(run.sse(), media_type="text/event-stream",
                                     background=BackgroundTask(run.cancel_if_never_read))
        return await run.whole(request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error body: ours (ApiError), the framework's (a 404 with a hint
    where /v1 is missing) and anything unexpected (500, logged)."""

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return error_response(exc.status, str(exc), exc.kind, exc.param, exc.code, exc.retry,
                              exc.close)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        hint = missing_v1_hint(request) if exc.status_code == 404 else None
        return error_response(exc.status_code, hint or str(exc.detail), kind)

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):
        log.exception("HTTP request failed")
        return error_response(500, f"internal error: {type(exc).__name__}", "server_error")


async def _admit(admission: Admission, params, chat: bool):
    """The request admitted (its ticket), or the ApiError that says why not."""
    try:
        return await anyio.to_thread.run_sync(admission.admit, params.generation)
    except EmptyPrompt as e:
        raise ApiError(400, str(e), "invalid_request_error",
                       "messages" if chat else "prompt") from None
    except ConfigError as e:
        code = "context_length_exceeded" if "context limit" in str(e) else None
        raise ApiError(400, str(e), "invalid_request_error", code=code) from None
    except (SessionNotFound, DrafterMissing) as e:
        raise ApiError(400, str(e), "invalid_request_error") from None
    except QueueFull as e:
        raise ApiError(429, f"the verifier is overloaded: {e}", "rate_limit_error",
                       code="overloaded") from None
    except ShuttingDown as e:
        raise ApiError(503, str(e), "service_unavailable") from None
    except (StoreUnavailable, OSError) as e:
        raise ApiError(503, f"the draft cache is unreachable: {e}",
                       "service_unavailable") from None


class _Run:
    """One admitted generation turned into OpenAI's response shapes."""

    def __init__(self, admission: Admission, ticket: Ticket, params, chat: bool, model: str,
                 shapes: LogprobShapes | None = None):
        self.admission, self.ticket, self.p, self.chat, self.model = (admission, ticket, params,
                                                                      chat, model)
        self.id = ("chatcmpl-" if chat else "cmpl-") + ticket.session_id
        self.created = int(time.time())
        self.pieces: list[str] = []
        self.text = TextStream(admission.tokenizer, self.pieces.append)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.shown = ""  # text already sent (or decided) before any stop string
        self.starts: list[int] = []  # where each token read begins in the output's text
        self.read = False  # the response began reading the ticket (``_events``)
        # the logprobs asked for, each sent with the chunk its token's text begins in
        self.logprobs = ChoiceLogprobs(shapes, ticket, chat, self.starts) \
            if shapes is not None and ticket.request.logprobs is not None else None

    def cancel_if_never_read(self) -> None:
        """A streamed response whose client left before its first read never followed its
        ticket, so no reader's leaving cancels it: its session would hold a KV slot to its
        end. Run after the response (Starlette's background): cancelled as an orphan then."""
        if not self.read:
            self.admission.scheduler.cancel(self.ticket.session_id, orphaned=True)

    async def _events(self):
        """Yields text increments (held back where a stop string may begin), then returns with
        ``finish_reason`` set. Cancels the session when a stop string ends it."""
        self.read = True
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()
        wake = lambda: loop.call_soon_threadsafe(changed.set)  # noqa: E731
        t = self.ticket
        t.listeners.append(wake)
        cursor, full = 0, ""
        hold = max((len(s) for s in self.p.stop), default=1) - 1
        try:
            with self.admission.follow(t):
                while True:
                    changed.clear()
                    with t.cond:
                        new, result, error = t.tokens[cursor:], t.result, t.error
                    if new:
                        cut = None
                        for tok in new:  # a token at a time: usage stops at the stop string
                            cursor += 1
                            self.starts.append(len(full))
                            self.text([tok])
                            full += "".join(self.pieces)
                            self.pieces.clear()
                            cut = _find_stop(full, self.p.stop)
                            if cut is not None:
                                break
                        self.completion_tokens = cursor
                        if cut is not None:
                            self.finish_reason = "stop"
                            piece, self.shown = full[len(self.shown):cut], full[:cut]
                            yield piece
                            self.admission.scheduler.cancel(t.session_id, reason="stop")
                            while not t.ended:  # for its stats; the cancel ends it promptly
                                changed.clear()
                                if not t.ended:
                                    await changed.wait()
                            return
                        # held back even once the result is in: the flush below may add to
                        # the text a stop string begins in
                        safe = len(full) - hold if error is None else len(full)
                        if safe > len(self.shown):
                            piece, self.shown = full[len(self.shown):safe], full[:safe]
                            yield piece
                        continue
                    if isinstance(error, ShuttingDown):  # the SDK resumes such a session by
                        # id; over HTTP it is sent again, to this server once back or another
                        raise ApiError(503, "generation failed: the verifier is shutting down; "
                                            "send the request again", "server_error")
                    if error is not None:
                        raise ApiError(500, f"generation failed: {error}", "server_error")
                    if result is not None and result.finish_reason not in ("stop", "length"):
                        # cancelled on the server (an operator's Cancel): not a whole answer,
                        # whatever it holds, so not a finish OpenAI's clients would take as one
                        raise ApiError(503, f"the session was {result.finish_reason} on the "
                                       f"server after {cursor} token(s), before it finished",
                                       "server_error", retry=False)
                    if result is not None:
                        self.text.flush()  # an output that ends mid-character: its last bytes
                        full += "".join(self.pieces)
                        self.pieces.clear()
                        cut = _find_stop(full, self.p.stop)  # a stop the flushed text ends
                        end = len(full) if cut is None else cut
                        if end > len(self.shown):
                            piece, self.shown = full[len(self.shown):end], full[:end]
                            yield piece
                        self.finish_reason = result.finish_reason if cut is None else "stop"
                        return
                    await changed.wait()
        finally:
            t.listeners.remove(wake)

    def _usage(self) -> dict:
        prompt = len(self.ticket.request.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens}

    def _stats(self) -> dict:
        res = self.ticket.result
        s = res.stats if res is not None else None
        return {"session_id": self.ticket.session_id, "device": self.ticket.device or None,
                "drafted": s.draft_tokens if s else 0, "accepted": s.accepted_tokens if s else 0,
                "acceptance_rate": round(s.acceptance_rate, 4) if s else 0.0,
                "mean_acceptance_length": round(s.mean_acceptance_length, 4) if s else 1.0,
                "lossless": not (s.lossy if s else is_lossy(self._mode())),
                "verify": s.verify if s else self._mode(),
                "lenient_tokens": s.lenient_tokens if s else 0}

    def _mode(self) -> str:
        return self.ticket.request.verify or self.admission.scheduler.engine.cfg.verify

    def _choice(self, text: str | None, finish: str | None, first: bool = False) -> dict:
        """A streamed chunk's choice, with the logprobs of the tokens whose text begins in it
        (the last chunk: the rest, a stop token's, those past a stop string)."""
        logprobs = None
        if self.logprobs is not None:
            logprobs = self.logprobs.upto(self.completion_tokens if finish is not None
                                          else bisect_left(self.starts, len(self.shown)))
        if self.chat:
            delta = {"role": "assistant", "content": text or ""} if first else \
                ({"content": text} if text else {})
            return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

    def _chunk(self, choices: list, **extra) -> str:
        obj = {"id": self.id, "object": "chat.completion.chunk" if self.chat
               else "text_completion", "created": self.created, "model": self.model,
               "system_fingerprint": self.admission.kernels, "choices": choices, **extra}
        return f"data: {json.dumps(obj)}\n\n"

    async def sse(self):
        try:
            first = True
            async for text in self._events():
                if text or first:
                    yield self._chunk([self._choice(text, None, first)])
                    first = False
            if first:  # no text at all (an end of sequence first): the role is still said
                yield self._chunk([self._choice("", None, True)])
            yield self._chunk([self._choice(None, self.finish_reason)],
                              edgespec=self._stats())
            if self.p.include_usage:
                yield self._chunk([], usage=self._usage())
        except ApiError as e:
            yield f"data: {json.dumps({'error': {'message': str(e), 'type': e.kind}})}\n\n"
        yield "data: [DONE]\n\n"

    async def whole(self, request: Request) -> Response:
        """The whole completion; a client that disconnects meanwhile cancels its session (a
        plain endpoint is not cancelled by the server, so a watcher does it)."""
        async def collect() -> str:
            return "".join([t async for t in self._events()])

        async def left() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(0.25)

        work, watch = asyncio.create_task(collect()), asyncio.create_task(left())
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        watch.cancel()
        if not work.done():  # the client is gone: stop following (the session is cancelled)
            work.cancel()
            try:
                await work
            except asyncio.CancelledError:
                pass
            return Response(status_code=499)
        text = work.result()
        logprobs = self.logprobs.upto(self.completion_tokens) if self.logprobs else None
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": logprobs, "finish_reason": self.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs,
                      "finish_reason": self.finish_reason}
        return JSONResponse({"id": self.id, "object": "chat.completion" if self.chat
                             else "text_completion", "created": self.created,
                             "model": self.model, "system_fingerprint": self.admission.kernels,
                             "choices": [choice],
                             "usage": self._usage(), "edgespec": self._stats()})


def _find_stop(text: str, stops: list[str]) -> int | None:
    """Where the earliest stop string begins in ``text``, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None
