"""The client SDK: ``Client`` (blocking) and ``AsyncClient`` (asyncio) for the verifier.

    client = edgespec.Client("127.0.0.1:50051")
    out = client.generate("Summarize: ...", max_new_tokens=64)
    out.text, out.token_ids, out.stats
    for piece in client.stream("Tell me a story"):
        print(piece.text, end="")

A prompt is one user message through the model's chat template (``raw=True`` sends it as is,
``messages=[...]`` sends a conversation, ``prompt_ids=[...]`` sends token ids). ``device_id`` pins
the session to one drafter. ``timeout`` is a deadline in seconds for the whole call. Failures
raise subclasses of ``EdgespecError`` named after their gRPC status.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from .config import SamplingParams
from .v1 import edgespec_pb2 as pb
from .v1 import edgespec_pb2_grpc as pb_grpc
from .wire import auth_metadata, make_channel, params_to_pb, stats_from_pb


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
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


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
    return cls(f"{e.code().name}: {e.details()}", e.code())


@dataclass
class StreamPiece:
    token_ids: list[int]
    text: str


@dataclass
class GenerateResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    session_id: str
    device_id: str
    prompt_tokens: int
    stats: dict = field(default_factory=dict)


def build_request(prompt=None, *, messages=None, prompt_ids=None, raw=False, max_new_tokens=0,
                  temperature=0.0, top_k=0, top_p=1.0, seed=None, device_id=None
                  ) -> pb.GenerateRequest:
    """Validate locally (raises InvalidRequest) and build the wire request."""
    given = sum(x is not None for x in (prompt, messages, prompt_ids))
    if given != 1:
        raise InvalidRequest("give exactly one of prompt, messages, prompt_ids")
    try:
        params = SamplingParams(temperature, top_k, top_p, seed)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    req = pb.GenerateRequest(prompt=prompt or "", raw=raw, max_new_tokens=max_new_tokens,
                             sampling=params_to_pb(params), device_id=device_id or "")
    if messages is not None:
        req.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"])
                            for m in messages)
    if prompt_ids is not None:
        req.prompt_ids.extend(int(t) for t in prompt_ids)
    return req


class _Collector:
    def __init__(self):
        self.text, self.ids = [], []
        self.meta = pb.GenerateResponse()
        self.final = None

    def add(self, r: pb.GenerateResponse) -> StreamPiece | None:
        if r.device_id or r.prompt_tokens:
            self.meta = r
        if r.finished:
            self.final = r
        if r.token_ids:
            self.ids.extend(r.token_ids)
            self.text.append(r.text)
            return StreamPiece(list(r.token_ids), r.text)
        return None

    def result(self) -> GenerateResult:
        if self.final is None:
            raise EdgespecError("the stream ended without a final response")
        return GenerateResult("".join(self.text), self.ids, self.final.finish_reason,
                              self.final.session_id, self.meta.device_id,
                              self.meta.prompt_tokens, stats_from_pb(self.final.stats))


class Client:
    def __init__(self, address: str = "127.0.0.1:50051", token: str | None = None,
                 tls_ca: str | None = None, tls: bool = False, timeout: float | None = None):
        self.channel = make_channel(address, tls_ca, tls)
        self.stub = pb_grpc.VerifierStub(self.channel)
        self.metadata = auth_metadata(token)
        self.timeout = timeout
        self.last_session_id: str | None = None

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _responses(self, req, timeout):
        call = self.stub.Generate(req, timeout=timeout or self.timeout, metadata=self.metadata)
        try:
            for r in call:
                if r.session_id:
                    self.last_session_id = r.session_id
                yield r
        except grpc.RpcError as e:
            raise _translate(e) from None

    def stream(self, prompt: str | None = None, *, timeout: float | None = None, **kw):
        """Yield ``StreamPiece``s as tokens are committed."""
        coll = _Collector()
        for r in self._responses(build_request(prompt, **kw), timeout):
            piece = coll.add(r)
            if piece is not None:
                yield piece

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 **kw) -> GenerateResult:
        coll = _Collector()
        for r in self._responses(build_request(prompt, **kw), timeout):
            coll.add(r)
        return coll.result()

    def cancel(self, session_id: str) -> bool:
        try:
            return self.stub.Cancel(pb.CancelRequest(session_id=session_id),
                                    timeout=self.timeout or 10, metadata=self.metadata).cancelled
        except grpc.RpcError as e:
            raise _translate(e) from None


class AsyncClient:
    """The asyncio twin of ``Client`` (grpc.aio)."""

    def __init__(self, address: str = "127.0.0.1:50051", token: str | None = None,
                 tls_ca: str | None = None, tls: bool = False, timeout: float | None = None):
        self.channel = make_channel(address, tls_ca, tls, aio=True)
        self.stub = pb_grpc.VerifierStub(self.channel)
        self.metadata = auth_metadata(token)
        self.timeout = timeout

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def stream(self, prompt: str | None = None, *, timeout: float | None = None, **kw):
        coll = _Collector()
        call = self.stub.Generate(build_request(prompt, **kw), timeout=timeout or self.timeout,
                                  metadata=self.metadata)
        try:
            async for r in call:
                piece = coll.add(r)
                if piece is not None:
                    yield piece
        except grpc.RpcError as e:
            raise _translate(e) from None

    async def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                       **kw) -> GenerateResult:
        coll = _Collector()
        call = self.stub.Generate(build_request(prompt, **kw), timeout=timeout or self.timeout,
                                  metadata=self.metadata)
        try:
            async for r in call:
                coll.add(r)
        except grpc.RpcError as e:
            raise _translate(e) from None
        return coll.result()

    async def cancel(self, session_id: str) -> bool:
        try:
            res = await self.stub.Cancel(pb.CancelRequest(session_id=session_id),
                                         timeout=self.timeout or 10, metadata=self.metadata)
        except grpc.RpcError as e:
            raise _translate(e) from None
        return res.cancelled
