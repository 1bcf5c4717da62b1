"""The SDK's errors: ``EdgespecError`` and a subclass per gRPC status a call can end with, and
``translate``, which turns a call's ``grpc.RpcError`` into one of them."""

from __future__ import annotations

import grpc

from ..wire.convert import retry_after_s

__all__ = ["BY_CODE", "Cancelled", "DeadlineExceeded", "EdgespecError", "InvalidRequest",
           "NotFound", "Overloaded", "PreconditionFailed", "Unauthenticated", "Unavailable",
           "translate"]


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


BY_CODE = {c.code: c for c in (InvalidRequest, NotFound, PreconditionFailed, Overloaded,
                                Unauthenticated, DeadlineExceeded, Cancelled, Unavailable)}


def translate(e: grpc.RpcError) -> EdgespecError:
    cls = BY_CODE.get(e.code(), EdgespecError)
    err = cls(f"{e.code().name}: {e.details()}", e.code())
    if isinstance(err, Overloaded):
        err.retry_after_s = retry_after_s(e)
    return err
