"""The client SDK: ``Client`` (blocking) and ``AsyncClient`` (asyncio) for the verifier.

    client = edgespec.Client("127.0.0.1:50051")
    out = client.generate("Summarize: ...", max_new_tokens=64)
    out.text, out.token_ids, out.stats
    for piece in client.stream("Tell me a story"):
        print(piece.text, end="")

A prompt is one user message through the model's chat template (``raw=True`` sends it as is,
``messages=[...]`` sends a conversation, ``prompt_ids=[...]`` sends token ids). ``images=[...]``
(file paths, bytes of image files, or PIL images) go with a prompt or messages to a
vision-language target, one per ``<image>`` mark in the text, else all before it; a text-only
target refuses them. ``device_id`` pins the session to one drafter. ``verify="loose"`` asks for
FLy's lossy verification, ``"pad"`` for PAD's (each refused with ``InvalidRequest`` unless the
verifier was started in that mode: ``--verify loose``, ``--verify pad:DIR``), ``verify="exact"``
insists on lossless verification; ``result.lossless`` (and ``stats["lossless"]``) says which the
session got. A client's first call waits for a server that is not up yet, within its deadline
(two minutes without one, ten once its port is open and it loads its model), logging once what
it waits for, then fails with ``Unavailable`` saying why ("nothing is listening at ADDR (waited
120 s)"); a TLS mismatch or a port that is not an edgespec server's fails it at once
(``edgespec.wire.reachability``). ``timeout`` is a deadline in seconds for the whole call: a
server that is restarting is waited for within it, and a stream that breaks (the verifier
restarted) is resumed by session id within it, token-identically; a session the verifier's cache
lost meanwhile (a resume answered NOT_FOUND) is re-created from the prompt and the tokens
already received, and goes on as target-only decoding would (``result.seed``: the session's
sampling seed, the verifier's choice when none was given). Failures raise subclasses of
``EdgespecError`` named after their gRPC status.

The client makes its own gRPC channel (``client.channel``) with edgespec's message limits and a
reconnect backoff of 0.2 s up to 2 s (``edgespec.wire.convert.CHANNEL_OPTIONS``), and keepalive
pings (10 s of silence, 5 s to answer: ``edgespec.wire.keepalive``), so a connection that went
silent mid-call is noticed and the call resumed on a new one. To tune it,
pass ``channel_options``, ``(name, value)`` pairs of gRPC channel arguments, rather than
replacing the channel: they are applied after edgespec's own, so one with the same name
replaces edgespec's value::

    edgespec.Client("10.0.0.5:50051", channel_options=[
        ("grpc.keepalive_time_ms", 20_000),        # ping after 20 s of silence, not 10
        ("grpc.max_reconnect_backoff_ms", 10_000),  # back off up to 10 s, not 2 s
        ("grpc.primary_user_agent", "my-app/1.2")])
"""

from __future__ import annotations

import asyncio
import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from .config import VERIFY_MODES, ConfigError, EmptyPrompt, SamplingParams
from .models.images import check_image_bytes, image_bytes
from .protocol.lineage import Lineage, joined
from .wire.reachability import ConnectWatch, unreachable_reason_aio
from .v1 import edgespec_pb2 as pb
from .v1 import edgespec_pb2_grpc as pb_grpc
from .wire.convert import (REFUSAL_METADATA, auth_metadata, make_channel, params_to_pb,
                           retry_after_s, stats_from_pb, trailing_value)


class EdgespecError(Exception):
    code = None

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidRequest(EdgespecError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(EdgespecError):
    code = grpc.StatusCode.NOT_FOUND


class PreconditionFailed(EdgespecError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Overloaded(EdgespecError):
    """Refused at once: the verifier is full, or would not finish the call within its deadline
    at its measured pace. ``retry_after_s``: when the server suggests trying again (None: not
    said)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    retry_after_s: float | None = None


class Unauthenticated(EdgespecError):
    code = grpc.StatusCode.UNAUTHENTICATED


class DeadlineExceeded(EdgespecError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(EdgespecError):
    code = grpc.StatusCode.CANCELLED


class Unavailable(EdgespecError):
    code = grpc.StatusCode.UNAVAILABLE


_BY_CODE = {c.code: c for c in (InvalidRequest, NotFound, PreconditionFailed, Overloaded,
                                Unauthenticated, DeadlineExceeded, Cancelled, Unavailable)}


def _translate(e: grpc.RpcError) -> EdgespecError:
    cls = _BY_CODE.get(e.code(), EdgespecError)
    err = cls(f"{e.code().name}: {e.details()}", e.code())
    if isinstance(err, Overloaded):
        err.retry_after_s = retry_after_s(e)
    return err


@dataclass
class StreamPiece:
    """Tokens committed since the previous piece. The last piece of a stream has no tokens and
    carries ``finish_reason`` and ``stats``."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stats: dict | None = None
    kernel_set: str = ""  # on the last piece: as ``GenerateResult``'s
    kernels_differ_from: int = 0


@dataclass
class GenerateResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    session_id: str
    device_id: str
    prompt_tokens: int
    stats: dict = field(default_factory=dict)
    resumed: int = 0  # how many times the stream was resumed after a break
    seed: int | None = None  # the session's sampling seed (the verifier's choice if none given)
    # the verifier's kernel set fingerprint (what the output is target-only decoding on) and,
    # when > 0, the output position from which another kernel set decoded it (the stream was
    # resumed on a replica with other kernels; see docs/failure-model.md)
    kernel_set: str = ""
    kernels_differ_from: int = 0

    @property
    def lossless(self) -> bool:
        """False when the session was verified loosely: the text may differ from the target's."""
        return self.stats.get("lossless", True)


def _wire_int(x, what: str) -> int:
    """``x`` as the int the wire carries: a whole number in [0, 2^31) (an int, or anything usable
    as an index: NumPy's, a one-element tensor's), not a bool; else InvalidRequest naming
    ``what`` it is."""
    try:
        if not isinstance(x, bool) and 0 <= (value := operator.index(x)) < 1 << 31:
            return value
    except TypeError:
        pass
    raise InvalidRequest(f"{what}, got {str(x)[:20]!r}: whole numbers in [0, 2^31)")


def _check_messages(messages) -> None:
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or \
                not isinstance(m.get("content"), str):
            raise InvalidRequest("each message is a dict with a 'role' and a 'content', both "
                                 "strings")


def build_request(prompt=None, *, messages=None, prompt_ids=None, raw=False, max_new_tokens=0,
                  temperature=0.0, top_k=0, top_p=1.0, seed=None, device_id=None,
                  verify=None, images=None) -> pb.GenerateRequest:
    """Validate locally (raises InvalidRequest) and build the wire request. An empty
    ``prompt`` is sent (through the chat template it is an empty message; raw, the verifier
    refuses its zero tokens); empty ``prompt_ids`` or ``messages`` cannot travel (the wire does
    not tell them from none) and are refused here."""
    given = sum(x is not None for x in (prompt, messages, prompt_ids))
    if given != 1:
        raise InvalidRequest("give exactly one of prompt, messages, prompt_ids")
    if prompt_ids is not None and len(prompt_ids) == 0:
        raise InvalidRequest(EmptyPrompt.MESSAGE)
    if messages is not None and len(messages) == 0:
        raise InvalidRequest("messages is empty: give at least one message")
    try:
        params = SamplingParams(temperature, top_k, top_p, seed)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    if verify not in (None, "") + VERIFY_MODES:
        raise InvalidRequest("verify must be 'exact', 'loose' or 'pad', got "
                             f"{str(verify)[:20]!r}")
    # what the wire cannot carry: InvalidRequest here, not protobuf's ValueError
    limit = 0 if max_new_tokens is None else _wire_int(  # unset: the server's default
        max_new_tokens, "max_new_tokens (0: the server's default)")
    if messages is not None:
        _check_messages(messages)
    ids = None if prompt_ids is None else [_wire_int(t, "prompt_ids holds a token id")
                                           for t in prompt_ids]
    req = pb.GenerateRequest(raw=raw, max_new_tokens=limit,
                             sampling=params_to_pb(params), device_id=device_id or "",
                             verify=verify or "")
    if prompt is not None:  # "" too: the field has presence
        req.prompt = prompt
    if messages is not None:
        req.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"])
                            for m in messages)
    if ids is not None:
        req.prompt_ids.extend(ids)
    if images:
        if prompt_ids is not None:
            raise InvalidRequest("images go with a prompt or messages, not token ids (the "
                                 "verifier's processor places their tokens)")
        try:
            data = [image_bytes(i) for i in images]
            check_image_bytes(data)
        except ConfigError as e:
            raise InvalidRequest(str(e)) from None
        req.images.extend(data)
    return req


class _Resumer:
    """Keeps what a stream needs to be resumed: its session id and how many tokens arrived.

    A stream that breaks with UNAVAILABLE (the verifier died or restarted, it drained, the link
    dropped) is resumed by session id, up to ``max_resumes`` times within the call's deadline;
    the verifier sends only the tokens after those already received, so the caller sees one
    unbroken stream. Before a session id is known, nothing was admitted: the request is sent
    again as it was. A resume answered NOT_FOUND (the cache lost the session: a Redis without
    persistence restarted with the verifier) re-creates the session: the request again, with
    the tokens received as ``committed_ids`` and the seed the verifier reported."""

    def __init__(self, req: pb.GenerateRequest, timeout: float | None, max_resumes: int):
        self.req, self.max_resumes = req, max_resumes
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.session_id: str | None = None
        self.tokens: list[int] = []  # every output token received
        self.seed: int | None = req.sampling.seed if req.sampling.has_seed else None
        self.resumes = 0
        self.last_error: str | None = None  # the last refusal or break, for a deadline's words
        self.recreating = False  # the cache lost the session: send the request again
        self._first = True  # the next response is a stream's first
        self.lineage: Lineage | None = None  # the kernel sets the output was decoded on

    @classmethod
    def of_call(cls, client, timeout: float | None, **kw) -> "_Resumer":
        """A call's resumer, with ``client``'s defaults (its timeout, its resumes)."""
        return cls(build_request(**kw), timeout or client.timeout, client.max_resumes)

    @property
    def received(self) -> int:
        return len(self.tokens)

    def next_request(self) -> pb.GenerateRequest:
        self._first = True
        if self.session_id is None:
            return self.req
        if self.recreating:
            return self.recreate_request()
        return self._with_lineage(pb.GenerateRequest(resume_session_id=self.session_id,
                                                     resume_from=self.received))

    def _with_lineage(self, req: pb.GenerateRequest) -> pb.GenerateRequest:
        """``req`` with the kernel sets the output so far was decoded on (a router prefers a
        replica of the same set; a re-created session carries them on)."""
        if self.lineage is not None:
            req.kernel_set = self.lineage.kernels
            req.kernels_differ_from = self.lineage.differs_from
        return req

    def recreate_request(self) -> pb.GenerateRequest:
        req = pb.GenerateRequest()
        req.CopyFrom(self.req)
        req.committed_ids.extend(self.tokens)
        req.lost_session_id = self.session_id or ""
        if self.seed is not None:
            req.sampling.has_seed, req.sampling.seed = True, self.seed
        return self._with_lineage(req)

    def time_left(self) -> float | None:
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            if self.session_id is None:
                why = "before the verifier took the request"
            else:
                why = f"while resuming session {self.session_id}"
            last = f" (last answer: {self.last_error})" if self.last_error else ""
            raise DeadlineExceeded(f"DEADLINE_EXCEEDED: the deadline passed {why}{last}",
                                   grpc.StatusCode.DEADLINE_EXCEEDED)
        return left

    def seen(self, r: pb.GenerateResponse) -> None:
        if self._first:
            self._first = False
            if self.recreating and not r.resumed:  # a verifier that predates re-creation
                raise NotFound(f"NOT_FOUND: the verifier lost session {self.session_id} and "
                               "cannot re-create it", grpc.StatusCode.NOT_FOUND)
            self.recreating = False
            if r.sampling.has_seed:
                self.seed = r.sampling.seed
            if r.kernel_set:
                self.lineage = joined(self.lineage, Lineage(r.kernel_set, r.kernels_differ_from),
                                      self.received)
        if r.session_id:
            self.session_id = r.session_id
        self.tokens.extend(r.token_ids)

    def retry_after(self, e: grpc.RpcError) -> float:
        """Seconds to wait before resuming; raises the error (as an EdgespecError) to give up.
        A new session refused by a draining verifier fails at once: it would be refused until
        that verifier has stopped."""
        self.last_error = f"{e.code().name}: {e.details()}"
        if self.session_id is None and trailing_value(e, REFUSAL_METADATA) == "draining":
            raise Unavailable(f"UNAVAILABLE: {e.details()}", e.code()) from None
        resumable = e.code() in RESUMABLE or (  # a resume that found the server full
            self.session_id is not None and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED)
        lost = (self.session_id is not None and not self.recreating
                and e.code() == grpc.StatusCode.NOT_FOUND)  # a resume the cache cannot serve
        if not (resumable or lost) or self.resumes >= self.max_resumes:
            raise _translate(e) from None
        self.resumes += 1
        if lost:
            self.recreating = True
            return 0.0
        wait = min(2.0, 0.1 * 2 ** self.resumes)
        left = self.time_left()  # raises DeadlineExceeded once the deadline has passed
        return wait if left is None else min(wait, left)


RESUMABLE = {grpc.StatusCode.UNAVAILABLE}


class _Collector:
    """A call's output, put together from the responses of its streams (``res``: their
    resumer, which knows the resumes and the kernel sets)."""

    def __init__(self, res: _Resumer):
        self.res = res
        self.text: list[str] = []
        self.ids: list[int] = []
        self.meta = pb.GenerateResponse()
        self.final: pb.GenerateResponse | None = None
        self.seed: int | None = None

    def add(self, r: pb.GenerateResponse) -> StreamPiece | None:
        if r.device_id or r.prompt_tokens:
            self.meta = r
        if r.sampling.has_seed:
            self.seed = r.sampling.seed
        if r.finished:
            self.final = r
            lineage = self.res.lineage or Lineage()
            return StreamPiece([], "", r.finish_reason, stats_from_pb(r.stats),
                               lineage.kernels, lineage.differs_from)
        if r.token_ids:
            self.ids.extend(r.token_ids)
            self.text.append(r.text)
            return StreamPiece(list(r.token_ids), r.text)
        return None

    def result(self) -> GenerateResult:
        if self.final is None:
            raise EdgespecError("the stream ended without a final response")
        lineage = self.res.lineage or Lineage()
        return GenerateResult("".join(self.text), self.ids, self.final.finish_reason,
                              self.final.session_id, self.meta.device_id,
                              self.meta.prompt_tokens, stats_from_pb(self.final.stats),
                              self.res.resumes, self.seed, lineage.kernels,
                              lineage.differs_from)


class Client:
    """``max_resumes``: how often a broken stream is resumed (0: never). ``tls_cert`` and
    ``tls_key``: a client certificate for a server that requires one (``--tls-client-ca``).
    ``channel_options``: gRPC channel arguments, applied after edgespec's own (see the module
    docstring)."""

    def __init__(self, address: str = "127.0.0.1:50051", token: str | None = None,
                 tls_ca: str | None = None, tls: bool = False, timeout: float | None = None,
                 max_resumes: int = 8, tls_cert: str | None = None, tls_key: str | None = None,
                 channel_options: Sequence[tuple[str, Any]] = ()):
        self.channel = make_channel(address, tls_ca, tls, client_cert=tls_cert,
                                    client_key=tls_key, options=channel_options)
        self._watch = ConnectWatch(self.channel, address, tls=bool(tls or tls_ca or tls_cert))
        self._reached = False  # the channel connected once: calls wait for restarts after
        self.stub = pb_grpc.VerifierStub(self.channel)
        self.metadata = auth_metadata(token)
        self.timeout = timeout
        self.max_resumes = max_resumes
        self.last_session_id: str | None = None
        self.last_resumes = 0
        self.last_seed: int | None = None  # the last stream's sampling seed, once reported

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _first_contact(self, timeout: float | None) -> None:
        """Before the first call, wait for a server that is not up yet, and fail (Unavailable)
        with words where the wait ends or what answers is not this channel's server (see
        edgespec.wire.reachability)."""
        if self._reached:
            return
        reason = self._watch.unreachable_reason(timeout)
        if reason is not None:
            raise Unavailable(f"UNAVAILABLE: {reason}")
        self._reached = True

    def _responses(self, res: _Resumer):
        """The stream's responses, resumed across breaks. ``wait_for_ready``: a server that is
        restarting is waited for, up to the deadline."""
        self._first_contact(res.time_left())
        while True:
            call = self.stub.Generate(res.next_request(), timeout=res.time_left(),
                                      metadata=self.metadata, wait_for_ready=True)
            try:
                for r in call:
                    res.seen(r)
                    self.last_session_id = res.session_id
                    self.last_resumes = res.resumes
                    self.last_seed = res.seed
                    yield r
                return
            except grpc.RpcError as e:
                time.sleep(res.retry_after(e))
            finally:
                call.cancel()  # a caller that stops reading ends its session on the server

    def stream(self, prompt: str | None = None, *, timeout: float | None = None, **kw):
        """Yield ``StreamPiece``s as tokens are committed; the last one carries the finish
        reason and stats."""
        coll = _Collector(_Resumer.of_call(self, timeout, prompt=prompt, **kw))
        for r in self._responses(coll.res):
            piece = coll.add(r)
            if piece is not None:
                yield piece

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 **kw) -> GenerateResult:
        coll = _Collector(_Resumer.of_call(self, timeout, prompt=prompt, **kw))
        for r in self._responses(coll.res):
            coll.add(r)
        return coll.result()

    def cancel(self, session_id: str) -> bool:
        self._first_contact(self.timeout or 10)
        try:
            return self.stub.Cancel(pb.CancelRequest(session_id=session_id),
                                    timeout=self.timeout or 10, metadata=self.metadata).cancelled
        except grpc.RpcError as e:
            raise _translate(e) from None

    def status(self) -> dict:
        """What the verifier and its drafters are doing now (the ``Status`` RPC) as a dict."""
        from google.protobuf.json_format import MessageToDict

        self._first_contact(self.timeout or 10)
        try:
            res = self.stub.Status(pb.StatusRequest(), timeout=self.timeout or 10,
                                   metadata=self.metadata, wait_for_ready=True)
        except grpc.RpcError as e:
            raise _translate(e) from None
        return MessageToDict(res, preserving_proto_field_name=True,
                             always_print_fields_with_no_presence=True)


class AsyncClient:
    """The asyncio twin of ``Client`` (grpc.aio), resuming broken streams the same way."""

    def __init__(self, address: str = "127.0.0.1:50051", token: str | None = None,
                 tls_ca: str | None = None, tls: bool = False, timeout: float | None = None,
                 max_resumes: int = 8, tls_cert: str | None = None, tls_key: str | None = None,
                 channel_options: Sequence[tuple[str, Any]] = ()):
        self.channel = make_channel(address, tls_ca, tls, aio=True, client_cert=tls_cert,
                                    client_key=tls_key, options=channel_options)
        self.address = address
        self._tls = bool(tls or tls_ca or tls_cert)
        self._reached = False
        self.stub = pb_grpc.VerifierStub(self.channel)
        self.metadata = auth_metadata(token)
        self.timeout = timeout
        self.max_resumes = max_resumes

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _first_contact(self, timeout: float | None) -> None:
        if self._reached:
            return
        reason = await unreachable_reason_aio(self.channel, self.address, timeout, self._tls)
        if reason is not None:
            raise Unavailable(f"UNAVAILABLE: {reason}")
        self._reached = True

    async def _responses(self, res: _Resumer):
        await self._first_contact(res.time_left())
        while True:
            call = self.stub.Generate(res.next_request(), timeout=res.time_left(),
                                      metadata=self.metadata, wait_for_ready=True)
            try:
                async for r in call:
                    res.seen(r)
                    yield r
                return
            except grpc.RpcError as e:
                await asyncio.sleep(res.retry_after(e))
            finally:
                call.cancel()

    async def stream(self, prompt: str | None = None, *, timeout: float | None = None, **kw):
        coll = _Collector(_Resumer.of_call(self, timeout, prompt=prompt, **kw))
        async for r in self._responses(coll.res):
            piece = coll.add(r)
            if piece is not None:
                yield piece

    async def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                       **kw) -> GenerateResult:
        coll = _Collector(_Resumer.of_call(self, timeout, prompt=prompt, **kw))
        async for r in self._responses(coll.res):
            coll.add(r)
        return coll.result()

    async def cancel(self, session_id: str) -> bool:
        await self._first_contact(self.timeout or 10)
        try:
            res = await self.stub.Cancel(pb.CancelRequest(session_id=session_id),
                                         timeout=self.timeout or 10, metadata=self.metadata)
        except grpc.RpcError as e:
            raise _translate(e) from None
        return res.cancelled
