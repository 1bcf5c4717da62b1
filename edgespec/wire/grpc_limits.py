"""A cap on concurrently open streams per gRPC method, refusing the excess at once.

The sync gRPC server runs each open stream on a worker thread. Without a cap, streams beyond
the pool wait inside gRPC with no answer, and so do health checks queued behind them: an
orchestrator would declare a merely busy server dead. With a cap below the pool size, the excess
gets RESOURCE_EXHAUSTED immediately and the rest of the pool stays free for unary calls.
"""

from __future__ import annotations

import threading

import grpc


class StreamLimitInterceptor(grpc.ServerInterceptor):
    def __init__(self, limits: dict[str, int]):
        """``limits``: full method name (``/package.Service/Method``) -> most open streams."""
        self.limits = dict(limits)
        self.open = {m: 0 for m in limits}
        self._lock = threading.Lock()

    def _enter(self, method: str) -> bool:
        with self._lock:
            if self.open[method] >= self.limits[method]:
                return False
            self.open[method] += 1
            return True

    def _leave(self, method: str) -> None:
        with self._lock:
            self.open[method] -= 1

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        method = details.method
        if handler is None or method not in self.limits or not handler.response_streaming:
            return handler
        limit = self.limits[method]

        def limited(request_or_iterator, context):
            if not self._enter(method):
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"server busy: {limit} {method} streams are open")
            try:
                behaviour = (handler.stream_stream if handler.request_streaming
                             else handler.unary_stream)
                yield from behaviour(request_or_iterator, context)
            finally:
                self._leave(method)

        make = (grpc.stream_stream_rpc_method_handler if handler.request_streaming
                else grpc.unary_stream_rpc_method_handler)
        return make(limited, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)
