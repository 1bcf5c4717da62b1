"""gRPC plumbing every role shares: conversions to and from the wire messages, the metadata
of refusals and retries, and the authentication interceptor (servers and channels, TLS
included: ``channels.py``).

Authentication: tokens travel as ``authorization: Bearer <token>`` metadata. A shared token
guards every call but health checks; per-device tokens (the cache's ``--device-tokens``) admit
drafters to DraftCache methods only, as the device they name. See ``TokenAuthInterceptor``.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor

from ..config import ConfigError, SamplingParams
from ..protocol.request_stats import Stats
from ..v1 import edgespec_pb2 as pb
from ..protocol.token_logprob import TokenLogprob

AUTH_ENV = "EDGESPEC_AUTH_TOKEN"
MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # larger messages are refused with RESOURCE_EXHAUSTED
# trailing metadata saying why a call was refused, where the status code alone cannot:
# "draining" (UNAVAILABLE: the verifier is shutting down and admits nothing new)
REFUSAL_METADATA = "x-edgespec-refusal"
# how the cache ends a drafter's Attach stream that a newer one of the same device id replaced
# (ABORTED, the details beginning so): the drafter that reads it stops
REPLACED_STREAM = "replaced by a newer attach"
HEALTH_PREFIX = "/grpc.health.v1.Health/"


# -- conversions ------------------------------------------------------------------------------
def params_to_pb(p: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                             has_seed=p.seed is not None, seed=p.seed or 0,
                             presence_penalty=p.presence_penalty,
                             frequency_penalty=p.frequency_penalty,
                             logit_bias=dict(p.logit_bias))


def params_from_pb(m: pb.SamplingParams) -> SamplingParams:
    """Raises ConfigError on out-of-range values (NaN included). top_p 0 is proto3's unset."""
    top_p = 1.0 if m.top_p == 0 else m.top_p
    return SamplingParams(temperature=m.temperature, top_k=m.top_k, top_p=top_p,
                          seed=m.seed if m.has_seed else None,
                          presence_penalty=m.presence_penalty,
                          frequency_penalty=m.frequency_penalty,
                          logit_bias=tuple(m.logit_bias.items()))


def logprobs_to_pb(entries: Sequence[TokenLogprob]) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=e.token, logprob=e.logprob,
                            top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in e.top])
            for e in entries]


def logprobs_from_pb(entries) -> list[TokenLogprob]:
    """``GenerateResponse.logprobs`` as ``TokenLogprob``s (float32's values, as sent)."""
    return [TokenLogprob(e.token_id, e.logprob, tuple((t.token_id, t.logprob) for t in e.top))
            for e in entries]


def stats_to_pb(s: Stats) -> pb.Stats:
    return pb.Stats(steps=s.steps, num_drafts=s.num_drafts, drafted=s.draft_tokens,
                    accepted=s.accepted_tokens, acceptance_rate=s.acceptance_rate,
                    mean_acceptance_length=s.mean_acceptance_length,
                    tokens_per_s=s.tokens_per_s, prefill_s=s.prefill_s, elapsed_s=s.elapsed_s,
                    tokens=s.tokens, accepted_per_pos=s.accepted_per_pos, take_s=s.take_s,
                    forward_s=s.forward_s, commit_s=s.commit_s, lossy=s.lossy,
                    branch_tokens=s.branch_tokens, head_tokens=s.head_tokens,
                    head_accepted=s.head_accepted, stacks=s.stacks, verify=s.verify,
                    lenient_tokens=s.lenient_tokens, fill_tokens=s.fill_tokens,
                    fill_accepted=s.fill_accepted, fill_drafts=s.fill_drafts,
                    drafter_drafts=s.drafter_drafts, drafter_tokens=s.drafter_tokens,
                    drafter_accepted=s.drafter_accepted)


def stats_from_pb(m: pb.Stats) -> dict:
    return {"steps": m.steps, "num_drafts": m.num_drafts, "drafted": m.drafted,
            "accepted": m.accepted, "acceptance_rate": m.acceptance_rate,
            "mean_acceptance_length": m.mean_acceptance_length, "tokens_per_s": m.tokens_per_s,
            "prefill_s": m.prefill_s, "elapsed_s": m.elapsed_s, "tokens": m.tokens,
            "accepted_per_pos": list(m.accepted_per_pos), "take_s": m.take_s,
            "forward_s": m.forward_s, "commit_s": m.commit_s, "lossless": not m.lossy,
            "branch_tokens": m.branch_tokens, "head_tokens": m.head_tokens,
            "head_accepted": m.head_accepted, "stacks": dict(m.stacks),
            "verify": m.verify or ("loose" if m.lossy else "exact"),
            "lenient_tokens": m.lenient_tokens, "fill_tokens": m.fill_tokens,
            "fill_accepted": m.fill_accepted, "fill_drafts": m.fill_drafts,
            "drafter_drafts": m.drafter_drafts, "drafter_tokens": m.drafter_tokens,
            "drafter_accepted": m.drafter_accepted}


# -- retry hints --------------------------------------------------------------------------------
# A live server that refuses for now (the cache while its Redis recovers) says when to come
# back in this trailing metadata key (milliseconds); a caller honours it instead of its own
# backoff, which is meant for a server that does not answer at all.
RETRY_AFTER_MD = "retry-after-ms"


# protobuf's JSON mapping writes these as strings (JavaScript's numbers lose 64-bit integers)
_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}


def unencodable_text(value: str, what: str) -> str | None:
    """Why ``value`` cannot go on the wire or through a tokenizer, or None: UTF-8 has no lone
    surrogate (``"\\ud800"``, which ``json.loads`` or ``os.fsdecode`` may give). ``what``
    names the text in the answer. The SDK and the HTTP API refuse with it, each its own way."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"{what} holds {value[e.start:e.end]!r} at {e.start}, which UTF-8 cannot carry "
                "(a lone surrogate)")
    return None


def message_as_dict(message: Any) -> dict:
    """A message as Python values (every field, defaults included, by its proto name), 64-bit
    integers as ints: ``MessageToDict`` writes them as strings, as JSON for JavaScript must."""
    from google.protobuf.json_format import MessageToDict

    out = MessageToDict(message, preserving_proto_field_name=True,
                        always_print_fields_with_no_presence=True)
    _ints_in(out, message.DESCRIPTOR)
    return out


def _ints_in(values: dict, descriptor: Any) -> None:
    """``values`` (``MessageToDict``'s, of a message of ``descriptor``) with its 64-bit integer
    fields, nested messages', repeated fields' and maps' included, made ints in place."""
    for field in descriptor.fields:
        if field.name not in values:
            continue
        value = values[field.name]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            entry = field.message_type.fields_by_name["value"]
            for key in value:
                if entry.type in _INT64:
                    value[key] = int(value[key])
                elif entry.message_type is not None:
                    _ints_in(value[key], entry.message_type)
        elif field.type in _INT64:
            values[field.name] = [int(v) for v in value] if isinstance(value, list) \
                else int(value)
        elif field.message_type is not None:
            for item in value if isinstance(value, list) else [value]:
                _ints_in(item, field.message_type)


def retry_after_metadata(ms: int) -> tuple[tuple[str, str], ...]:
    return ((RETRY_AFTER_MD, str(int(ms))),)


def trailing_value(error: grpc.RpcError, key: str) -> str | None:
    """The value a failed call's trailing metadata holds for ``key``, or None (not said, or the
    server was not reached: an error raised without a call behind it has none)."""
    try:
        md = error.trailing_metadata() or ()
    except Exception:
        return None
    return next((value for k, value in md if k == key), None)


def retry_after_s(error: grpc.RpcError) -> float | None:
    """The delay (seconds) a refusal's trailing metadata asks for, or None (no hint: the
    server was not reached, or did not say)."""
    value = trailing_value(error, RETRY_AFTER_MD)
    if value is None:
        return None
    try:
        ms = float(value)
    except (TypeError, ValueError):
        return None
    return ms / 1000 if 0 <= ms < float("inf") else None


def refusal_metadata(why: str) -> tuple[tuple[str, str], ...]:
    """Trailing metadata saying why a call was refused (``REFUSAL_METADATA``)."""
    return ((REFUSAL_METADATA, why),)


# -- authentication -----------------------------------------------------------------------------
def resolve_token(token: str | None,
                  what: str = "--auth-token (or $EDGESPEC_AUTH_TOKEN)") -> str | None:
    """The token given, else $EDGESPEC_AUTH_TOKEN's, else None (an empty one is none); one no
    header can carry is refused (``check_token``, naming ``what``)."""
    resolved = token or os.environ.get(AUTH_ENV) or None
    if resolved is not None:
        check_token(resolved, what)
    return resolved


def check_token(token, what: str = "token") -> None:
    """A token an ``authorization`` header can carry (non-empty printable ASCII), else a
    ConfigError naming ``what``: gRPC refuses any other on every call, which a client that
    retries would read as an outage and retry for ever."""
    if not isinstance(token, str) or not token or not all(" " <= c <= "~" for c in token):
        raise ConfigError(f"{what} must be a non-empty string of printable ASCII characters "
                          "(what a gRPC header carries)")


def auth_metadata(token: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")] if token else []


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Who may call what, from the ``authorization: Bearer <token>`` metadata.

    ``token``: the shared token (None: none). ``device_tokens``: per-device credentials (an
    object with ``device_for(token) -> device id | None``, as
    ``cache_service.credentials.DeviceCredentials``; None: none). Health checks are always open.

    - DraftCache methods: with device tokens configured, only a device token is accepted (the
      cache then derives the device from it); the shared token is PERMISSION_DENIED there, since
      it names no device. Without device tokens, the shared token as before.
    - Every other method (the Verifier service): the shared token when one is configured, else
      open; a device token is PERMISSION_DENIED (it is good for drafting only).
    - A missing or unknown token where one is needed: UNAUTHENTICATED.
    """

    CACHE_PREFIX = "/edgespec.v1.DraftCache/"

    def __init__(self, token: str | None, device_tokens=None):
        self._expected = f"Bearer {token}".encode() if token else None
        self._devices = device_tokens
        if token and device_tokens is not None and device_tokens.device_for(token):
            raise ConfigError("the shared auth token is also a device's token: give each "
                              "device a token of its own")
        self._deny = {
            grpc.StatusCode.UNAUTHENTICATED: self._denier(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong auth token (metadata 'authorization: Bearer ...')"),
            grpc.StatusCode.PERMISSION_DENIED: self._denier(
                grpc.StatusCode.PERMISSION_DENIED,
                "this token is not good for this service: drafters use their device token "
                "for DraftCache, clients the shared token for the rest"),
        }

    def _verdict(self, method: str, got: str) -> grpc.StatusCode | None:
        """None: let the call through; else the code to refuse it with."""
        if method.startswith(HEALTH_PREFIX):
            return None
        shared = self._expected is not None and hmac.compare_digest(
            got.encode("utf-8", "surrogatepass"), self._expected)
        device = None
        if self._devices is not None and got.startswith("Bearer "):
            device = self._devices.device_for(got[len("Bearer "):])
        if method.startswith(self.CACHE_PREFIX) and self._devices is not None:
            if device:
                return None
            return grpc.StatusCode.PERMISSION_DENIED if shared else grpc.StatusCode.UNAUTHENTICATED
        if device:
            return grpc.StatusCode.PERMISSION_DENIED
        if shared or self._expected is None:
            return None
        return grpc.StatusCode.UNAUTHENTICATED

    def intercept_service(self, continuation, details):
        got = dict(details.invocation_metadata or ()).get("authorization", "")
        code = self._verdict(details.method, got if isinstance(got, str) else "")
        if code is None:
            return continuation(details)
        handler = continuation(details)
        if handler is None:
            return None
        return self._deny[code][(handler.request_streaming, handler.response_streaming)]

    @staticmethod
    def _denier(code: grpc.StatusCode, message: str) -> dict:
        """Handlers of every streaming kind that refuse a call with ``code``."""

        def deny(request, context):
            context.abort(code, message)

        return {(False, False): grpc.unary_unary_rpc_method_handler(deny),
                (False, True): grpc.unary_stream_rpc_method_handler(deny),
                (True, False): grpc.stream_unary_rpc_method_handler(deny),
                (True, True): grpc.stream_stream_rpc_method_handler(deny)}
