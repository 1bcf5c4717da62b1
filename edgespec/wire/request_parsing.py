"""Malformed requests are the caller's fault: INVALID_ARGUMENT, never INTERNAL.

grpc's server deserializes a request before any handler runs, and answers any deserializer
failure (a truncated protobuf, invalid UTF-8 in a string field) with INTERNAL "Exception
deserializing request!". ``add_servicer`` registers a servicer through its generated
``add_..._to_server`` helper, but with every method taking the raw request bytes and parsing
them itself, so a message that does not parse ends the call with INVALID_ARGUMENT and a
message naming the method and what was wrong. Streamed requests are parsed one by one as the
servicer reads them.

    add_servicer(pb_grpc.add_VerifierServicer_to_server, service, server)
"""

from __future__ import annotations

import grpc


class MalformedRequest(grpc.RpcError):
    """Raised from a request iterator whose next message does not parse, after the call's
    status was set to INVALID_ARGUMENT. A grpc.RpcError, as a cancelled stream's iterator
    raises: servicers that treat that as "the caller went away" stop reading quietly."""


def add_servicer(add_to_server, servicer, server: grpc.Server) -> None:
    """``add_to_server(servicer, server)`` (a generated helper), with every method's request
    parsed by ``parsing_handler``."""
    add_to_server(servicer, _ParsingServer(server))


def parsing_handler(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` taking raw bytes and parsing them with its own deserializer; a request
    that does not parse aborts the call with INVALID_ARGUMENT."""
    parse = handler.request_deserializer
    if parse is None:
        return handler
    inner = _behaviour(handler)
    if handler.request_streaming:
        def behaviour(raw_requests, context):
            return inner(_parsed_stream(raw_requests, parse, method, context), context)
    else:
        def behaviour(raw_request, context):
            return inner(_parsed(raw_request, parse, method, context), context)
    make = {(False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}
    return make[(handler.request_streaming, handler.response_streaming)](
        behaviour, request_deserializer=None,
        response_serializer=handler.response_serializer)


def _behaviour(handler: grpc.RpcMethodHandler):
    if handler.request_streaming:
        return handler.stream_stream if handler.response_streaming else handler.stream_unary
    return handler.unary_stream if handler.response_streaming else handler.unary_unary


def _malformed(method: str, error: Exception) -> str:
    return (f"malformed request to {method}: {error} (a truncated or corrupt protobuf, or "
            "invalid UTF-8 in a string field)")


def _parsed(raw: bytes, parse, method: str, context):
    try:
        return parse(raw)
    except Exception as e:  # whatever the parser raises, the bytes were the caller's
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, _malformed(method, e))


def _parsed_stream(raw_requests, parse, method: str, context):
    for raw in raw_requests:
        try:
            request = parse(raw)
        except Exception as e:
            _abort_from_any_thread(context, _malformed(method, e))
        yield request


def _abort_from_any_thread(context, message: str) -> None:
    """Fail the call with INVALID_ARGUMENT from wherever the stream is read (servicers may
    read it on a thread of their own), then raise MalformedRequest to the reader."""
    try:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
    except Exception:  # abort() marks the call aborted, then raises a bare Exception
        pass
    raise MalformedRequest(message)


class _ParsingServer:
    """What the generated ``add_..._to_server`` helpers call on a server, wrapping the
    handlers they register."""

    def __init__(self, server: grpc.Server):
        self._server = server

    def add_generic_rpc_handlers(self, generic_handlers) -> None:
        self._server.add_generic_rpc_handlers(tuple(_ParsingGenericHandler(h)
                                                    for h in generic_handlers))

    def add_registered_method_handlers(self, service: str, method_handlers: dict) -> None:
        self._server.add_registered_method_handlers(service, {
            name: parsing_handler(f"/{service}/{name}", h)
            for name, h in method_handlers.items()})


class _ParsingGenericHandler(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler):
        self._inner = inner

    def service(self, handler_call_details):
        handler = self._inner.service(handler_call_details)
        if handler is None:
            return None
        return parsing_handler(handler_call_details.method, handler)
