"""The HTTP API's errors in OpenAI's shape: ``ApiError`` (raised anywhere a request is read) and
``error_response``, the body ``{"error": {"message", "type", "param", "code"}}`` it becomes."""

from __future__ import annotations

from starlette.responses import JSONResponse


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code


def error_response(status: int, message: str, kind: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    """OpenAI's error body."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status_code=status)
