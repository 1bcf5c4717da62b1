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
reconnect backoff of 0.2 s up to 2 s (``edgespec.wire.channels.CHANNEL_OPTIONS``), and keepalive
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
import time
from collections.abc import Sequence
from typing import Any

import grpc

from .config import ConfigError
from .sdk.errors import (Cancelled, DeadlineExceeded, EdgespecError, InvalidRequest, NotFound,
                         Overloaded, PreconditionFailed, Unauthenticated, Unavailable, translate)
from .sdk.request import build_request, check_client_args, check_session_id, check_timeout
from .sdk.stream import Collector, GenerateResult, Resumer, StreamPiece
from .v1 import edgespec_pb2 as pb
from .v1 import edgespec_pb2_grpc as pb_grpc
from .wire.convert import auth_metadata, message_as_dict
from .wire.channels import make_channel
from .wire.reachability import STARTING_WAIT_S, ConnectWatch, unreachable_reason_aio

__all__ = ["AsyncClient", "Cancelled", "Client", "DeadlineExceeded", "EdgespecError",
           "GenerateResult", "InvalidRequest", "NotFound", "Overloaded", "PreconditionFailed",
           "StreamPiece", "Unauthenticated", "Unavailable", "build_request"]


def client_channel(*args, **kwargs):
    """``make_channel``'s channel; its refusals (a TLS file that cannot be read) as the SDK's
    ``InvalidRequest``, an ``EdgespecError`` as every error the SDK raises."""
    try:
        return make_channel(*args, **kwargs)
    except ConfigError as e:
        raise InvalidRequest(str(e)) from None


class Client:
    """``max_resumes``: how often a broken stream is resumed (0: never). ``tls_cert`` and
    ``tls_key``: a client certificate for a server that requires one (``--tls-client-ca``).
    ``channel_options``: gRPC channel arguments, applied after edgespec's own (see the module
    docstring)."""

    def __init__(self, address: str = "127.0.0.1:50051", token: str | None = None,
                 tls_ca: str | None = None, tls: bool = False, timeout: float | None = None,
                 max_resumes: int = 8, tls_cert: str | None = None, tls_key: str | None = None,
                 channel_options: Sequence[tuple[str, Any]] = ()):
        options = check_client_args(address, token, max_resumes, channel_options)  # first
        self.channel = client_channel(address, tls_ca, tls, client_cert=tls_cert,
                                      client_key=tls_key, options=options)
        self._watch = ConnectWatch(self.channel, address, tls=bool(tls or tls_ca or tls_cert))
        self._reached = False  # the channel connected once: calls wait for restarts after
        self.stub = pb_grpc.VerifierStub(self.channel)
        self.metadata = auth_metadata(token)
        self.timeout = check_timeout(timeout, "the client's timeout")
        self.max_resumes = max_resumes
        self.last_session_id: str | None = None
        self.last_resumes = 0
        self.last_seed: int | None = None  # the last stream's sampling seed, once reported
        self.closed = False

    def close(self) -> None:
        self.closed = True
        self._watch.close()  # a first contact's wait and grpc's poller end before the channel
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _first_contact(self, timeout: float | None) -> None:
        """Before the first call, wait for a server that is not up yet, and fail (Unavailable)
        with words where the wait ends or what answers is not this channel's server (see
        edgespec.wire.reachability)."""
        check_open(self)
        if self._reached:
            return
        reason = self._watch.unreachable_reason(timeout)
        if reason is not None:
            raise Unavailable(f"UNAVAILABLE: {reason}")
        self._reached = True

    def _responses(self, res: Resumer):
        """The stream's responses, resumed across breaks. ``wait_for_ready``: a server that is
        restarting is waited for, up to the deadline."""
        self._first_contact(res.time_left())
        while True:
            if res.resumes and res.time_left() is None:  # no deadline: a restart is waited
                # for as a first contact waits for a server loading its model, then given up
                why = self._watch.unreachable_reason(STARTING_WAIT_S)
                if why is not None:
                    raise res.server_gone(why)
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
        coll = Collector(Resumer.of_call(self, timeout, prompt=prompt, **kw))
        for r in self._responses(coll.res):
            piece = coll.add(r)
            if piece is not None:
                yield piece

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 **kw) -> GenerateResult:
        coll = Collector(Resumer.of_call(self, timeout, prompt=prompt, **kw))
        for r in self._responses(coll.res):
            coll.add(r)
        return coll.result()

    def cancel(self, session_id: str) -> bool:
        check_session_id(session_id)
        self._first_contact(self.timeout or 10)
        try:
            return self.stub.Cancel(pb.CancelRequest(session_id=session_id),
                                    timeout=self.timeout or 10, metadata=self.metadata).cancelled
        except grpc.RpcError as e:
            raise translate(e) from None

    def status(self) -> dict:
        """What the verifier and its drafters are doing now (the ``Status`` RPC) as a dict of
        Python values (every field, by its proto name; counters as ints)."""
        self._first_contact(self.timeout or 10)
        try:
            res = self.stub.Status(pb.StatusRequest(), timeout=self.timeout or 10,
                                   metadata=self.metadata, wait_for_ready=True)
        except grpc.RpcError as e:
            raise translate(e) from None
        return message_as_dict(res)


def check_open(client) -> None:
    """A closed client's calls: InvalidRequest at once (its channel would raise gRPC's own
    errors, or a first call wait out its timeout)."""
    if client.closed:
        raise InvalidRequest("this client is closed: make a new one")


class AsyncClient:
    """The asyncio twin of ``Client`` (grpc.aio), resuming broken streams the same way."""

    def __init__(self, address: str = "127.0.0.1:50051", token: str | None = None,
                 tls_ca: str | None = None, tls: bool = False, timeout: float | None = None,
                 max_resumes: int = 8, tls_cert: str | None = None, tls_key: str | None = None,
                 channel_options: Sequence[tuple[str, Any]] = ()):
        options = check_client_args(address, token, max_resumes, channel_options)  # first
        timeout = check_timeout(timeout, "the client's timeout")
        self.channel = client_channel(address, tls_ca, tls, aio=True, client_cert=tls_cert,
                                      client_key=tls_key, options=options)
        self.address = address
        self._tls = bool(tls or tls_ca or tls_cert)
        self._reached = False
        self.stub = pb_grpc.VerifierStub(self.channel)
        self.metadata = auth_metadata(token)
        self.timeout = timeout
        self.max_resumes = max_resumes
        self.last_session_id: str | None = None  # as ``Client``'s: the last stream's, once known
        self.last_resumes = 0
        self.last_seed: int | None = None
        self.closed = False

    async def close(self) -> None:
        self.closed = True
        await self.channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _first_contact(self, timeout: float | None) -> None:
        check_open(self)
        if self._reached:
            return
        reason = await unreachable_reason_aio(self.channel, self.address, timeout, self._tls)
        if reason is not None:
            raise Unavailable(f"UNAVAILABLE: {reason}")
        self._reached = True

    async def _responses(self, res: Resumer):
        await self._first_contact(res.time_left())
        while True:
            if res.resumes and res.time_left() is None:  # as Client's
                why = await unreachable_reason_aio(self.channel, self.address, STARTING_WAIT_S,
                                                   self._tls)
                if why is not None:
                    raise res.server_gone(why)
            call = self.stub.Generate(res.next_request(), timeout=res.time_left(),
                                      metadata=self.metadata, wait_for_ready=True)
            try:
                async for r in call:
                    res.seen(r)
                    self.last_session_id = res.session_id
                    self.last_resumes = res.resumes
                    self.last_seed = res.seed
                    yield r
                return
            except grpc.RpcError as e:
                await asyncio.sleep(res.retry_after(e))
            finally:
                call.cancel()

    async def stream(self, prompt: str | None = None, *, timeout: float | None = None, **kw):
        coll = Collector(Resumer.of_call(self, timeout, prompt=prompt, **kw))
        async for r in self._responses(coll.res):
            piece = coll.add(r)
            if piece is not None:
                yield piece

    async def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                       **kw) -> GenerateResult:
        coll = Collector(Resumer.of_call(self, timeout, prompt=prompt, **kw))
        async for r in self._responses(coll.res):
            coll.add(r)
        return coll.result()

    async def cancel(self, session_id: str) -> bool:
        check_session_id(session_id)
        await self._first_contact(self.timeout or 10)
        try:
            res = await self.stub.Cancel(pb.CancelRequest(session_id=session_id),
                                         timeout=self.timeout or 10, metadata=self.metadata)
        except grpc.RpcError as e:
            raise translate(e) from None
        return res.cancelled
