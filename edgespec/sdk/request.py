"""A call's wire request, checked here first: what the wire cannot carry, or the verifier
would refuse for its form, is ``InvalidRequest`` before anything is sent."""

from __future__ import annotations

import math
import operator
import struct
from collections.abc import Mapping

from ..config import VERIFY_MODES, ConfigError, EmptyPrompt, SamplingParams
from ..models.images import check_image_bytes, image_bytes
from ..protocol.token_logprob import check_top_logprobs
from ..v1 import edgespec_pb2 as pb
from ..wire.convert import check_token, params_to_pb, unencodable_text
from ..wire.reachability import check_address, split_address
from .errors import InvalidRequest

__all__ = ["build_request", "check_client_args", "check_messages", "check_session_id",
           "check_timeout", "wire_int"]


def wire_text(value: str, what: str) -> str:
    """``value``, once the wire can carry it (``unencodable_text``): protobuf would refuse a
    lone surrogate with a bare UnicodeEncodeError."""
    why = unencodable_text(value, what)
    if why is not None:
        raise InvalidRequest(why)
    return value


def check_client_args(address, token, max_resumes=0, channel_options=()) -> list:
    """A client's settings, before a channel is made: an address gRPC would misread (a scheme,
    no port, a port past 65535, which it takes modulo 65536) or no server listens at (port 0),
    a token gRPC metadata cannot carry (printable ASCII only), a ``max_resumes`` that is not a
    count and ``channel_options`` that are not (name, value) pairs are ``InvalidRequest``.
    Returns the options as a list of pairs (a mapping's items; an iterator read once here)."""
    if not isinstance(address, str):
        raise InvalidRequest(f"address must be a string HOST:PORT, got {type(address).__name__}")
    try:
        check_address(address, "address")
    except ConfigError as e:
        raise InvalidRequest(str(e)) from None
    split = split_address(address)
    if split is not None and split[1] == 0:
        raise InvalidRequest(f"address {address!r}: port 0 is a listener's request for any "
                             "free port; give the port the server listens on")
    if isinstance(max_resumes, bool) or not isinstance(max_resumes, int) or max_resumes < 0:
        raise InvalidRequest(f"max_resumes must be an integer >= 0 (0: never resume), got "
                             f"{max_resumes!r}")
    try:
        pairs = list(channel_options.items() if isinstance(channel_options, Mapping)
                     else channel_options)
    except TypeError:
        pairs = None
    if pairs is None or any(not isinstance(o, (tuple, list)) or len(o) != 2 or
                            not isinstance(o[0], str) for o in pairs):
        raise InvalidRequest("channel_options must be (name, value) pairs of gRPC channel "
                             "arguments, e.g. [(\"grpc.keepalive_time_ms\", 30000)]")
    if token is not None:
        try:
            check_token(token)
        except ConfigError as e:
            raise InvalidRequest(str(e)) from None
    return pairs


def check_session_id(session_id) -> str:
    """A session id to send (``cancel``): a string the wire can carry."""
    if not isinstance(session_id, str):
        raise InvalidRequest(f"session_id must be a string, got {type(session_id).__name__}")
    return wire_text(session_id, "session_id")


def wire_int(x, what: str) -> int:
    """``x`` as the int the wire carries: a whole number in [0, 2^31) (an int, or anything usable
    as an index: NumPy's, a one-element tensor's), not a bool; else InvalidRequest naming
    ``what`` it is."""
    try:
        if not isinstance(x, bool) and 0 <= (value := operator.index(x)) < 1 << 31:
            return value
    except TypeError:
        pass
    raise InvalidRequest(f"{what}, got {str(x)[:20]!r}: whole numbers in [0, 2^31)")


MAX_TIMEOUT_S = 1e8  # ~3 years: gRPC turns a deadline much further off into one passed already


def check_timeout(timeout, what: str = "timeout") -> float | None:
    """A call's or client's ``timeout`` in seconds: None or 0 (none of its own: the client's, or
    no deadline), else a number > 0, capped at ``MAX_TIMEOUT_S``; InvalidRequest otherwise."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise InvalidRequest(f"{what} must be seconds (a number), got "
                             f"{type(timeout).__name__}")
    if timeout == 0:
        return None
    if not timeout > 0:  # NaN too
        raise InvalidRequest(f"{what} must be > 0 seconds (or 0/None: none), got {timeout!r}")
    return min(float(timeout), MAX_TIMEOUT_S)


def check_messages(messages) -> None:
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or \
                not isinstance(m.get("content"), str):
            raise InvalidRequest("each message is a dict with a 'role' and a 'content', both "
                                 "strings")
        wire_text(m["role"], f"messages[{i}]['role']")
        wire_text(m["content"], f"messages[{i}]['content']")
        # the wire carries a message's role and content alone: a key besides them (OpenAI's
        # 'name', say) would be dropped on the way, and the prompt be other than the caller's
        extra = sorted(str(k)[:40] for k, v in m.items()
                       if k not in ("role", "content") and v is not None)
        if extra:
            raise InvalidRequest(f"messages[{i}] holds {', '.join(map(repr, extra))}: a "
                                 "message carries a 'role' and a 'content' alone")


def check_wire_float(name: str, value: float) -> None:
    """The wire carries ``temperature`` and ``top_p`` as 32-bit floats (0 there is greedy /
    unset): a value that does not stay positive and finite in one would be served as another
    request (greedy, no top-p filter, or refused as infinite), so it is refused here."""
    if value <= 0:
        return
    try:
        carried = struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        carried = math.inf
    if not 0 < carried < math.inf:
        raise InvalidRequest(f"{name} {value!r} does not survive the wire's 32-bit float (it "
                             f"would arrive as {carried!r}): use one between 1.4e-45 and "
                             f"3.4e38")


def build_request(prompt=None, *, messages=None, prompt_ids=None, raw=False, max_new_tokens=0,
                  temperature=0.0, top_k=0, top_p=1.0, seed=None, device_id=None,
                  verify=None, images=None, logprobs=None, presence_penalty=0.0,
                  frequency_penalty=0.0, logit_bias=None, prompt_logprobs=None,
                  prompt_only=False) -> pb.GenerateRequest:
    """Validate locally (raises InvalidRequest) and build the wire request. An empty
    ``prompt`` is sent (through the chat template it is an empty message; raw, the verifier
    refuses its zero tokens); empty ``prompt_ids`` or ``messages`` cannot travel (the wire does
    not tell them from none) and are refused here."""
    given = sum(x is not None for x in (prompt, messages, prompt_ids))
    if given != 1:
        raise InvalidRequest("give exactly one of prompt, messages, prompt_ids")
    for name, value, kind, what in (("prompt", prompt, str, "a string"),
                                    ("device_id", device_id, str, "a string"),
                                    ("raw", raw, bool, "True or False"),
                                    ("prompt_only", prompt_only, bool, "True or False")):
        if value is not None and not isinstance(value, kind):
            raise InvalidRequest(f"{name} must be {what}, got {type(value).__name__}")
    for name, value, what in (("prompt_ids", prompt_ids, "a list of ids (or an array)"),
                              ("messages", messages, "a list of dicts")):
        if value is not None and (not hasattr(value, "__len__") or
                                  isinstance(value, (str, bytes, dict))):
            raise InvalidRequest(f"{name} must be {what}, got {type(value).__name__}")
    if prompt_ids is not None and len(prompt_ids) == 0:
        raise InvalidRequest(EmptyPrompt.MESSAGE)
    if messages is not None and len(messages) == 0:
        raise InvalidRequest("messages is empty: give at least one message")
    if raw and messages is not None:  # (token ids are sent as they are either way)
        raise InvalidRequest("raw=True sends a prompt string as is, without the chat template: "
                             "messages always go through the template")
    for name, value in (("prompt", prompt), ("device_id", device_id)):
        if value is not None:
            wire_text(value, name)
    if images is not None and (isinstance(images, (str, bytes, dict)) or
                               not hasattr(images, "__iter__")):
        raise InvalidRequest(f"images must be a list (of paths, bytes or PIL images), got "
                             f"{type(images).__name__}")
    try:
        params = SamplingParams(temperature, top_k, top_p, seed, presence_penalty,
                                frequency_penalty, () if logit_bias is None else logit_bias)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    for name, value in (("temperature", params.temperature), ("top_p", params.top_p)):
        check_wire_float(name, value)
    try:
        check_top_logprobs(logprobs)
        check_top_logprobs(prompt_logprobs, "prompt_logprobs")
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    if verify not in (None, "") + VERIFY_MODES:
        raise InvalidRequest("verify must be 'exact', 'loose' or 'pad', got "
                             f"{str(verify)[:20]!r}")
    # what the wire cannot carry: InvalidRequest here, not protobuf's ValueError
    limit = 0 if max_new_tokens is None else wire_int(  # unset: the server's default
        max_new_tokens, "max_new_tokens (0: the server's default)")
    if prompt_only and (limit or images):
        raise InvalidRequest("prompt_only scores a text prompt without output: leave "
                             "max_new_tokens and images out")
    if messages is not None:
        check_messages(messages)
    ids = None if prompt_ids is None else [wire_int(t, "prompt_ids holds a token id")
                                           for t in prompt_ids]
    req = pb.GenerateRequest(raw=raw, max_new_tokens=limit,
                             sampling=params_to_pb(params), device_id=device_id or "",
                             verify=verify or "", prompt_only=prompt_only)
    if prompt is not None:  # "" too: the field has presence
        req.prompt = prompt
    if logprobs is not None:  # 0 too: the token's own logprob
        req.logprobs = logprobs
    if prompt_logprobs is not None:
        req.prompt_logprobs = prompt_logprobs
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
