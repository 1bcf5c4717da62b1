"""The HTTP API's errors in OpenAI's shape: ``ApiError`` (raised anywhere a request is read) and
``error_response``, the body ``{"error": {"message", "type", "param", "code"}}`` it becomes;
``missing_v1_hint``, what a 404's message tells a client whose base URL lacks ``/v1``.

The body is written with non-ASCII characters escaped: an error's message may quote the request
(an unknown parameter, role or model name), and JSON lets a request hold a lone surrogate
(``"\\ud800"``), which has no UTF-8 encoding; written as it is, the error itself would fail and
the client get a 500 for a request that deserved a 4xx."""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse


class AsciiJSONResponse(JSONResponse):
    """A JSON response whose body escapes every non-ASCII character (``\\uXXXX``)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False,
                          separators=(",", ":")).encode("ascii")


class ApiError(Exception):
    """``retry``: False where sending the request again would undo what ended it (a session an
    operator cancelled): the response says ``x-should-retry: false``, which OpenAI's SDKs obey
    (they retry a 5xx otherwise). ``retry_after_s``: when to send it again, said in a
    ``Retry-After`` header (whole seconds, rounded up), which OpenAI's SDKs wait for (up to a
    minute) before their retry; None: not said (they back off by themselves)."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None,
                 code: str | None = None, retry: bool = True,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code
        self.retry, self.retry_after_s = retry, retry_after_s
        self.close = False  # True: the response closes the connection (its request unread)


def error_response(status: int, message: str, kind: str, param: str | None = None,
                   code: str | None = None, retry: bool = True,
                   close: bool = False, retry_after_s: float | None = None) -> JSONResponse:
    """OpenAI's error body (``retry`` False: with ``x-should-retry: false``; ``close``: with
    ``connection: close``, so the server closes the connection once it is sent;
    ``retry_after_s``: with ``Retry-After``, in whole seconds, at least 1)."""
    headers = {} if retry else {"x-should-retry": "false"}
    if retry and retry_after_s is not None and retry_after_s > 0:
        headers["retry-after"] = str(max(1, math.ceil(retry_after_s)))
    if close:
        headers["connection"] = "close"
    return AsciiJSONResponse({"error": {"message": message, "type": kind, "param": param,
                                        "code": code}}, status_code=status,
                             headers=headers or None)


# the API's paths that a client whose base_url lacks /v1 asks for without it
V1_PATHS = ("/chat/completions", "/completions", "/models")


def missing_v1_hint(request: Request) -> str | None:
    """For a path that exists under /v1 (POST /chat/completions from a client whose base_url
    lacks /v1), what to change; None for any other path."""
    path = request.url.path.rstrip("/")
    if path not in V1_PATHS and not path.startswith("/models/"):
        return None
    base = str(request.base_url).rstrip("/")
    return (f"no route {path}: did you mean /v1{path}? set the client's base_url to "
            f"{base}/v1")
