"""A cap on the size of the HTTP API's request bodies, enforced before a body is read whole.

``BodyLimit`` is a small ASGI middleware. A request that declares a ``Content-Length`` over the
cap is answered 413 at once, its body unread; one without it (``Transfer-Encoding: chunked``)
has its body counted as the app reads it and is answered 413 as soon as the count passes the
cap, so no more than the cap and one chunk is ever held. uvicorn discards the rest of such a
body, and the connection and the server go on serving.

The default cap (``default_max_request_bytes``) fits the longest prompt the verifier admits
(``MAX_CHARS_PER_TOKEN`` characters per context token) with every character JSON-escaped at
its longest, plus 4 MiB for the rest of the request; ``--max-request-bytes`` sets another.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .admission import MAX_CHARS_PER_TOKEN
from .openai_params import ApiError, error_response

MIN_BYTES = 4 << 20  # the room beside the prompt, and the cap of an app given none
JSON_BYTES_PER_CHAR = 6  # the most JSON spends on one character: \uXXXX


def default_max_request_bytes(max_context: int) -> int:
    """The cap for a verifier of ``max_context`` tokens: its longest admissible prompt, escaped
    at its longest, plus 4 MiB."""
    return MAX_CHARS_PER_TOKEN * JSON_BYTES_PER_CHAR * max_context + MIN_BYTES


class BodyTooLarge(ApiError):
    def __init__(self, max_bytes: int):
        super().__init__(413, f"the request body is over {max_bytes} bytes, this server's "
                              "limit (--max-request-bytes)", "invalid_request_error",
                         code="request_too_large")


def declared_length(scope: Scope) -> int | None:
    """The request's Content-Length, or None when it has none (a chunked body)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:  # the HTTP server refuses a malformed one before us
                return None
    return None


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"the request body limit must be >= 1 byte, got {max_bytes}")
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            e = BodyTooLarge(self.max_bytes)
            await error_response(e.status, str(e), e.kind, code=e.code)(scope, receive, send)
            return
        await self.app(scope, self._counted(receive), send)

    def _counted(self, receive: Receive) -> Receive:
        """``receive`` that raises BodyTooLarge (answered 413 by the app's ApiError handler)
        once the body read so far passes the cap."""
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        return counted
