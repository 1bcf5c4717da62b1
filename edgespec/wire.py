"""gRPC plumbing every role shares: conversions to and from the wire messages, the shared-token
authentication interceptor, TLS credentials, and channel/server construction.

Authentication: when a token is configured, every call except health checks must carry the
metadata ``authorization: Bearer <token>``; others are refused with UNAUTHENTICATED.
"""

from __future__ import annotations

import hmac
import os
import socket
from concurrent import futures

import grpc

from .config import ConfigError, SamplingParams
from .metrics import Stats
from .sampling import SparseQ
from .v1 import edgespec_pb2 as pb

AUTH_ENV = "EDGESPEC_AUTH_TOKEN"
MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # larger messages are refused with RESOURCE_EXHAUSTED
HEALTH_PREFIX = "/grpc.health.v1.Health/"


# -- conversions ------------------------------------------------------------------------------
def params_to_pb(p: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                             has_seed=p.seed is not None, seed=p.seed or 0)


def params_from_pb(m: pb.SamplingParams) -> SamplingParams:
    """Raises ConfigError on out-of-range values."""
    top_p = m.top_p if m.top_p > 0 else 1.0
    return SamplingParams(temperature=m.temperature, top_k=m.top_k, top_p=top_p,
                          seed=m.seed if m.has_seed else None)


def q_to_pb(q: list[SparseQ] | None) -> list[pb.SparseQ]:
    return [pb.SparseQ(ids=x.ids, probs=x.probs) for x in q or []]


def q_from_pb(qs) -> list[SparseQ] | None:
    if not qs:
        return None
    return [SparseQ(list(x.ids), [float(p) for p in x.probs]) for x in qs]


def stats_to_pb(s: Stats) -> pb.Stats:
    return pb.Stats(steps=s.steps, num_drafts=s.num_drafts, drafted=s.draft_tokens,
                    accepted=s.accepted_tokens, acceptance_rate=s.acceptance_rate,
                    mean_acceptance_length=s.mean_acceptance_length,
                    tokens_per_s=s.tokens_per_s, prefill_s=s.prefill_s, elapsed_s=s.elapsed_s,
                    tokens=s.tokens, accepted_per_pos=s.accepted_per_pos, take_s=s.take_s,
                    forward_s=s.forward_s, commit_s=s.commit_s)


def stats_from_pb(m: pb.Stats) -> dict:
    return {"steps": m.steps, "num_drafts": m.num_drafts, "drafted": m.drafted,
            "accepted": m.accepted, "acceptance_rate": m.acceptance_rate,
            "mean_acceptance_length": m.mean_acceptance_length, "tokens_per_s": m.tokens_per_s,
            "prefill_s": m.prefill_s, "elapsed_s": m.elapsed_s, "tokens": m.tokens,
            "accepted_per_pos": list(m.accepted_per_pos), "take_s": m.take_s,
            "forward_s": m.forward_s, "commit_s": m.commit_s}


# -- authentication -----------------------------------------------------------------------------
def resolve_token(token: str | None) -> str | None:
    return token or os.environ.get(AUTH_ENV) or None


def auth_metadata(token: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")] if token else []


class TokenAuthInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong auth token (metadata 'authorization: Bearer ...')")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.stream_stream_rpc_method_handler(
            lambda it, ctx: deny(None, ctx))
        self._deny_unary_stream = grpc.unary_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation, details):
        if details.method.startswith(HEALTH_PREFIX):
            return continuation(details)
        got = dict(details.invocation_metadata).get("authorization", "")
        if hmac.compare_digest(got.encode(), self._expected):
            return continuation(details)
        handler = continuation(details)
        if handler is None:
            return None
        if handler.request_streaming:
            return self._deny_stream
        if handler.response_streaming:
            return self._deny_unary_stream
        return self._deny_unary


# -- servers and channels -----------------------------------------------------------------------
def make_server(max_workers: int, token: str | None) -> grpc.Server:
    interceptors = [TokenAuthInterceptor(token)] if token else []
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        interceptors=interceptors,
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.so_reuseport", 0)])


def bind(server: grpc.Server, address: str, tls_cert: str | None = None,
         tls_key: str | None = None) -> int:
    """Listen on ``address``; TLS when a certificate and key are given. Returns the port."""
    if bool(tls_cert) != bool(tls_key):
        raise ConfigError("TLS needs both --tls-cert and --tls-key")
    if tls_cert:
        creds = grpc.ssl_server_credentials([(_read(tls_key), _read(tls_cert))])
        port = server.add_secure_port(address, creds)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise ConfigError(f"cannot listen on {address}")
    return port


def make_channel(address: str, tls_ca: str | None = None, tls: bool = False,
                 aio: bool = False):
    """A client channel (``aio``: a grpc.aio one) with edgespec's message limits; TLS when
    ``tls`` or a CA certificate to trust is given."""
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
    mod = grpc.aio if aio else grpc
    if tls or tls_ca:
        creds = grpc.ssl_channel_credentials(_read(tls_ca) if tls_ca else None)
        return mod.secure_channel(address, creds, options=options)
    return mod.insecure_channel(address, options=options)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
