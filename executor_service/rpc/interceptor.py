"""One server interceptor: maps domain errors to gRPC status codes, refuses request bytes that are not a valid
message with INVALID_ARGUMENT on every method (tandem/request_decoding.py), and times every RPC."""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import grpc

from executor_service.metrics.op_stats import RpcMetrics
from tandem.errors import TandemError
from tandem.loggable import loggable
from tandem.request_decoding import UndecodableNotes, decoding_sync
from tandem.status_map import status_for

log = logging.getLogger("tandem.executor")
_OUR_PACKAGE = "tandem.executor.v1"


class ErrorMappingInterceptor(grpc.ServerInterceptor):
    def __init__(self, metrics: RpcMetrics) -> None:
        self._metrics = metrics
        self._notes = UndecodableNotes(log)

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return handler
        return decoding_sync(self._mapped(handler, handler_call_details), handler_call_details.method, self._notes)

    def _mapped(self, handler: grpc.RpcMethodHandler, handler_call_details: grpc.HandlerCallDetails) -> Any:
        method = handler_call_details.method.rsplit("/", 1)[-1]
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            def wrapped(request: Any, context: grpc.ServicerContext) -> Any:
                start = time.perf_counter()
                try:
                    return inner(request, context)
                except Exception as exc:
                    self._abort(method, exc, context)
                finally:
                    self._metrics.add(method, time.perf_counter() - start)

            return grpc.unary_unary_rpc_method_handler(wrapped, request_deserializer=handler.request_deserializer,
                                                       response_serializer=handler.response_serializer)
        if handler.unary_stream is not None and handler_call_details.method.startswith(f"/{_OUR_PACKAGE}."):
            inner_stream = handler.unary_stream  # our server streams (KV events); health's Watch passes through

            def streamed(request: Any, context: grpc.ServicerContext) -> Any:
                try:
                    yield from inner_stream(request, context)
                except Exception as exc:
                    self._abort(method, exc, context)

            return grpc.unary_stream_rpc_method_handler(streamed, request_deserializer=handler.request_deserializer,
                                                        response_serializer=handler.response_serializer)
        return handler  # health, reflection pass through untouched

    @staticmethod
    def _abort(method: str, exc: Exception, context: grpc.ServicerContext) -> None:
        if isinstance(exc, TandemError):
            code = status_for(exc)
            log.info("%s -> %s: %s", method, code.name, loggable(str(exc)))  # may quote what the client sent
            context.abort(code, str(exc))
        log.exception("%s failed", method)  # a bug, not the caller's fault: log it whole, keep serving
        context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}; see the executor log")
