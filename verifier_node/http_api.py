"""The verifier's OpenAI-compatible HTTP API (Starlette routes under FastAPI, served by uvicorn).

``POST /v1/completions`` (prompt as text or token ids, no chat template) and
``POST /v1/chat/completions`` (messages through the chat template), both with ``stream: true``
(Server-Sent Events ending with ``data: [DONE]``; ``stream_options.include_usage`` adds a last
chunk with usage); ``GET /v1/models``; ``GET /health`` (200 when ready, 503 while loading,
draining or unhealthy); ``GET /metrics`` (Prometheus). Every generation goes through the same
``Admission`` as the gRPC service, so it is validated the same way and lossless unless the
verifier was started in a lossy mode (``--verify loose`` or ``--verify pad:DIR``). A request
for ``n`` choices is a session a choice (``http_choice``). Each response carries the request's
speculative-decoding figures in an ``edgespec`` field (a list, one a choice, where ``n`` > 1):
``lossless`` (false for a session verified in a lossy mode), ``verify`` (the mode) and
``lenient_tokens`` among them.

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for malformed
JSON, bad parameters or a prompt over the context limit, 401 without the bearer token (when the
server has one), 404 for an unknown model or route (a route of /v1 asked for without it, as a
client whose base_url lacks /v1 does, gets a hint saying so), 413 for a request body over
``max_request_bytes`` (refused before it is read whole: ``body_limit``), 429 when the verifier
is overloaded, 503 while it loads (with ``Retry-After: 5``) or drains. A client that
disconnects mid-stream cancels its session; one that disconnects before its request body
arrived whole is logged (INFO) and left, no error.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import weakref
from dataclasses import dataclass, replace
from typing import Callable, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from edgespec.config import ConfigError, EmptyPrompt, LossyModeOff
from edgespec.protocol.contract import StoreUnavailable
from edgespec.verify.keyed_noise import seed_after

from .admission import (VISION_ENCODES, Admission, DrafterMissing, GenerationRequest,
                        SessionNotFound)
from .api_errors import missing_v1_hint
from .body_limit import BODY_TIMEOUT_S, MIN_BYTES, BodyLimit
from .http_choice import CLIENT_CLOSED, ChoiceRun, echo_texts, stream_choices, whole_choices
from .logprob_shapes import LogprobShapes
from .openai_params import MAX_PROMPTS, ApiError, error_response, parse_request
from .tickets import QueueFull, ShuttingDown, Ticket


log = logging.getLogger("edgespec.http")
T = TypeVar("T")
# each event loop's turns of image decoding (``_image_turns``)
_IMAGE_TURNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# the Retry-After of a request sent while the model loads: OpenAI's SDKs try a request three
# times, so their third try comes ~10 s after the first (a small model's load on a CPU), where
# their own back-off gives up after about two
LOADING_RETRY_S = 5.0
# the Retry-After of a request refused for room (429): a slot frees as a session ends, which a
# client cannot see; a second is about OpenAI's SDKs' own first back-off, and a client that
# does not back off by itself (curl's --retry, a proxy) reads it
OVERLOADED_RETRY_S = 1.0


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
    choices_lock = asyncio.Lock()  # requests of several choices admitted one at a time
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
                           code="loading", retry_after_s=LOADING_RETRY_S)
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
            raw = await request.body()
        except ClientDisconnect:  # gone before its body came whole: no one to answer, no session
            log.info("a client of %s disconnected before its request body arrived whole",
                     request.url.path)
            return Response(status_code=CLIENT_CLOSED)
        # parsed and read off the event loop: a body of millions of values (within the body
        # limit) took seconds, every other client's stream and /health stalled meanwhile
        params = await anyio.to_thread.run_sync(_parsed_request, raw, chat, model_name,
                                                most_values(admission.max_len))
        tickets = await _admit_choices(admission, params, chat, choices_lock)
        if params.generation.logprobs is not None and state.shapes is None:
            state.shapes = LogprobShapes(admission.tokenizer)
        echoes: list = [None] * len(tickets)
        if params.echo and not chat:  # the prompts' texts, off the event loop
            try:
                echoes = await anyio.to_thread.run_sync(
                    echo_texts, admission.tokenizer, [t.request.prompt_ids for t in tickets])
            except BaseException:  # no response will follow these sessions: they end here
                for t in tickets:
                    admission.scheduler.cancel(t.session_id)
                raise
        runs = [ChoiceRun(admission, t, params, chat, model_name, state.shapes, i,
                          prompt_index=i // params.n, echo=echo)
                for i, (t, echo) in enumerate(zip(tickets, echoes))]
        for run in runs[1:]:  # one response: the first choice's id and time
            run.id, run.created = runs[0].id, runs[0].created
        if params.stream:  # a client gone before the stream's first read: cancelled after
            return StreamingResponse(
                stream_choices(runs, params.include_usage), media_type="text/event-stream",
                background=BackgroundTask(_cancel_never_read, runs))
        return await whole_choices(runs, request)

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
                              exc.close, exc.retry_after_s)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        hint = missing_v1_hint(request) if exc.status_code == 404 else None
        return error_response(exc.status_code, hint or str(exc.detail), kind)

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):
        log.exception("HTTP request failed")
        return error_response(500, f"internal error: {type(exc).__name__}", "server_error")


async def _admit_choices(admission: Admission, params, chat: bool, lock: asyncio.Lock
                         ) -> list[Ticket]:
    """A ticket a choice (``n``) of each prompt (a completions batch: the prompts' choices in
    order), choice i's seed the request's plus i (a request without one: each its own).
    Several choices are admitted one request at a time (``lock``), and only
    where the scheduler has room for all of them (429 otherwise, nothing admitted; 400 for more
    than it ever holds); one refused all the same (a single choice's request came between),
    those admitted before it are cancelled and the ApiError that says why raised."""
    total = params.n * len(params.generations)
    if total == 1:
        return [await _admit(admission, params.generation, chat)]
    prompts = params.generations
    scheduler = admission.scheduler
    what = f"n = {params.n} choices" if not params.batch else \
        f"{len(params.generations)} prompts x n = {params.n} choices"

    def no_room() -> ApiError:  # asked before the prompts' work, and again under the lock
        return ApiError(429, f"the verifier is overloaded: no room for {what}",
                        "rate_limit_error", code="overloaded", retry_after_s=OVERLOADED_RETRY_S)

    if total > scheduler.capacity:
        raise ApiError(400, f"{what} is more sessions than this verifier holds "
                            f"({scheduler.capacity}: running and waiting)",
                       "invalid_request_error", "n" if not params.batch else "prompt")
    if scheduler.room() < total:
        raise no_room()
    if params.batch:  # every prompt checked before any is admitted
        prompts = await anyio.to_thread.run_sync(_encoded_batch, admission, prompts)
    elif prompts[0].prompt_ids is None:  # n choices of one prompt: encoded (images decoded) once
        prompts = [replace(prompts[0], encoded=await _admitted(admission.prompt_ids,
                                                               prompts[0], chat))]
    async with lock:
        if scheduler.room() < total:
            raise no_room()
        tickets: list[Ticket] = []
        try:
            for prompt in prompts:  # OpenAI's order: a prompt's choices together
                for i in range(params.n):
                    g = prompt
                    if i and g.params.seed is not None:
                        g = replace(g, params=replace(g.params,
                                                      seed=seed_after(g.params.seed, i)))
                    tickets.append(await _admit(admission, g, chat))
        except BaseException:
            for t in tickets:
                scheduler.cancel(t.session_id)
            raise
    return tickets


def most_values(max_context: int) -> int:
    """The most separators (commas and colons) a request body may hold: those of a batch of
    ``MAX_PROMPTS`` prompts of token ids filling the context, and room for the rest. Parsing
    JSON holds the interpreter's lock however many values it makes: a 20 MB body of 7 million
    empty lists stalled every stream and /health 2 s, in a worker thread as on the loop."""
    return MAX_PROMPTS * max_context + (1 << 16)


def _parsed_request(raw: bytes, chat: bool, model_name: str, max_values: int):
    """A request body's ``parse_request``; the 400 of a body that is not JSON, the 413 of one
    of more values than any request needs (counted before it is parsed: a few ms)."""
    values = raw.count(b",") + raw.count(b":")
    if values > max_values:
        raise ApiError(413, f"the request body holds {values} JSON separators: a request needs "
                            f"at most {max_values} here ({MAX_PROMPTS} prompts of token ids "
                            "filling the context)", "invalid_request_error",
                       code="request_too_large")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # bad JSON, bad UTF-8, absurd nesting
        raise ApiError(400, "the request body is not valid JSON", "invalid_request_error")
    return parse_request(body, chat, model_name)


def _encoded_batch(admission: Admission, prompts: list) -> list:
    """A batch's prompts as token ids, each checked as admission checks a new session's
    (``Admission.checked_prompt``) before any is admitted: a 400 naming the prompt refused,
    and no session started for the others."""
    out = []
    for k, g in enumerate(prompts):
        try:
            ids = admission.checked_prompt(g)
        except ConfigError as e:
            raise _refused(e, "prompt", f"prompt[{k}]: ") from None
        out.append(replace(g, prompt=None, prompt_ids=ids, raw=False))
    return out


def _refused(e: ConfigError, param: str | None, prefix: str = "") -> ApiError:
    """The 400 of a request admission refused (``context_length_exceeded`` where the context
    limit is why)."""
    code = "context_length_exceeded" if "context limit" in str(e) else None
    return ApiError(400, prefix + str(e), "invalid_request_error", param, code)


def _cancel_never_read(runs: list[ChoiceRun]) -> None:
    for run in runs:
        run.cancel_if_never_read()


async def _admit(admission: Admission, generation, chat: bool) -> Ticket:
    """The request admitted (its ticket), or the ApiError that says why not."""
    return await _admitted(admission.admit, generation, chat)


def _image_turns() -> asyncio.Semaphore:
    """This event loop's turns of image decoding (``VISION_ENCODES`` at once): a request with
    images waits for one here, on the loop, not in a worker thread (the worker threads every
    request needs, 40, were held by image requests waiting for their two turns)."""
    loop = asyncio.get_running_loop()
    turns = _IMAGE_TURNS.get(loop)
    if turns is None:
        turns = _IMAGE_TURNS[loop] = asyncio.Semaphore(VISION_ENCODES)
    return turns


async def _admitted(call: Callable[[GenerationRequest], T], generation: GenerationRequest,
                    chat: bool) -> T:
    """``call(generation)``, an admission's step, in a worker thread (a request with images
    to decode once it has its turn, ``_image_turns``); the ApiError that says why it refused
    the request."""
    try:
        if generation.images and generation.encoded is None:
            async with _image_turns():
                return await anyio.to_thread.run_sync(call, generation)
        return await anyio.to_thread.run_sync(call, generation)
    except EmptyPrompt as e:
        raise ApiError(400, str(e), "invalid_request_error",
                       "messages" if chat else "prompt") from None
    except LossyModeOff as e:  # a lossy mode not served here
        raise _refused(e, "verify") from None
    except ConfigError as e:
        # its tokens or its length alone (a limit too large for the prompt names neither)
        about = str(e).startswith(("prompt token ids", "prompt (", "the prompt")) and \
            "max_new_tokens" not in str(e)
        param = ("messages" if chat else "prompt") if about else \
            "logit_bias" if str(e).startswith("logit_bias") else None  # its ids past the vocab
        raise _refused(e, param) from None
    except (SessionNotFound, DrafterMissing) as e:
        raise ApiError(400, str(e), "invalid_request_error") from None
    except QueueFull as e:
        raise ApiError(429, f"the verifier is overloaded: {e}", "rate_limit_error",
                       code="overloaded", retry_after_s=OVERLOADED_RETRY_S) from None
    except ShuttingDown as e:
        raise ApiError(503, str(e), "service_unavailable") from None
    except (StoreUnavailable, OSError) as e:
        raise ApiError(503, f"the draft cache is unreachable: {e}",
                       "service_unavailable") from None
