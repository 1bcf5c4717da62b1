"""A cap on the size of the HTTP API's request bodies, enforced before a body is read whole, and
a deadline for a body to arrive.

``BodyLimit`` is a small ASGI middleware. A request that declares a ``Content-Length`` over the
cap is answered 413 at once, its body unread; one without it (``Transfer-Encoding: chunked``)
has its body counted as the app reads it and is answered 413 as soon as the count passes the
cap, so no more than the cap and one chunk is ever held. uvicorn discards the rest of such a
body, and the connection and the server go on serving. A request with both a
``Transfer-Encoding`` and a ``Content-Length`` is answered 400 with ``connection: close``, its
body unread: what follows it on the connection depends on which length a reader believes (the
RFC's sign of request smuggling), so nothing after it is served.

The default cap (``default_max_request_bytes``) fits the longest prompt the verifier admits
(``MAX_CHARS_PER_TOKEN`` characters per context token) with every character JSON-escaped at
its longest, plus 4 MiB for the rest of the request; ``--max-request-bytes`` sets another.

A body that has not arrived whole ``timeout_s`` after its request's headers (a client that
trickles it, or declares more than it sends and stays: each such connection would otherwise be
held, and its handler waiting, for as long as the client likes) is answered 408 with
``connection: close``, and uvicorn closes the connection once it is sent, its body unread. The
deadline covers the body only: a streamed response and a handler's wait for its client's
disconnect go on as long as they run. The default (``BODY_TIMEOUT_S``) lets the largest default
body arrive at about 150 KB/s; ``--request-body-timeout`` sets another, 0 none.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .admission import MAX_CHARS_PER_TOKEN
from .openai_params import ApiError, error_response

MIN_BYTES = 4 << 20  # the room beside the prompt, and the cap of an app given none
JSON_BYTES_PER_CHAR = 6  # the most JSON spends on one character: \uXXXX
BODY_TIMEOUT_S = 60.0  # a request's body arrives whole within this of its headers


def default_max_request_bytes(max_context: int) -> int:
    """The cap for a verifier of ``max_context`` tokens: its longest admissible prompt, escaped
    at its longest, plus 4 MiB."""
    return MAX_CHARS_PER_TOKEN * JSON_BYTES_PER_CHAR * max_context + MIN_BYTES


class BodyTooLarge(ApiError):
    def __init__(self, max_bytes: int):
        super().__init__(413, f"the request body is over {max_bytes} bytes, this server's "
                              "limit (--max-request-bytes)", "invalid_request_error",
                         code="request_too_large")


class BothLengths(ApiError):
    def __init__(self) -> None:
        super().__init__(400, "the request has both Transfer-Encoding and Content-Length: "
                              "send one (RFC 9112 6.1: a proxy that reads the other would see "
                              "other requests on the connection)", "invalid_request_error",
                         code="ambiguous_length")
        self.close = True  # the RFC's "MUST close the connection after responding"


class BodyTimedOut(ApiError):
    def __init__(self, timeout_s: float):
        super().__init__(408, f"the request body did not arrive whole within {timeout_s:g} s of "
                              "its headers, this server's limit (--request-body-timeout)",
                         "invalid_request_error", code="request_timeout")
        # answered with ``connection: close``: kept alive, a client trickling the rest would
        # still hold the connection (uvicorn's keep-alive wait ends at the next byte)
        self.close = True


def declared_length(scope: Scope) -> int | None:
    """The request's Content-Length, or None when it has none (a chunked body)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:  # the HTTP server refuses a malformed one before us
                return None
    return None


def has_both_lengths(scope: Scope) -> bool:
    """Whether the request has both a Transfer-Encoding and a Content-Length (uvicorn's HTTP
    parser reads the chunks and goes on serving the connection after them)."""
    names = {name for name, _ in scope["headers"]}
    return b"transfer-encoding" in names and b"content-length" in names


class BodyLimit:
    """``max_bytes``: the largest body; ``timeout_s``: the time a body has to arrive whole after
    its headers (None or 0: no limit)."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float | None = None):
        if max_bytes < 1:
            raise ValueError(f"the request body limit must be >= 1 byte, got {max_bytes}")
        if timeout_s is not None and timeout_s < 0:
            raise ValueError(f"the request body timeout must be >= 0 s, got {timeout_s}")
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s or None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if has_both_lengths(scope):  # its body unread: the connection is closed after
            both = BothLengths()
            await error_response(both.status, str(both), both.kind, code=both.code,
                                 close=both.close)(scope, receive, send)
            return
        declared = declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            e = BodyTooLarge(self.max_bytes)
            await error_response(e.status, str(e), e.kind, code=e.code)(scope, receive, send)
            return
        await self.app(scope, self._counted(receive), send)

    def _counted(self, receive: Receive) -> Receive:
        """``receive`` that raises BodyTooLarge (answered 413 by the app's ApiError handler)
        once the body read so far passes the cap, and BodyTimedOut (408) when the body's next
        part has not come by the deadline."""
        seen, whole = 0, False
        clock = asyncio.get_running_loop().time
        deadline = None if self.timeout_s is None else clock() + self.timeout_s

        async def counted() -> Message:
            nonlocal seen, whole
            if whole or deadline is None:  # after the body: a disconnect, whenever it comes
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, deadline - clock()))
                except asyncio.TimeoutError:
                    raise BodyTimedOut(self.timeout_s or 0.0) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
                whole = not message.get("more_body", False)
            return message

        return counted
