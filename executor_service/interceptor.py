"""One server interceptor: maps domain errors to gRPC status codes and times every RPC."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import grpc

from executor_service.metrics import LatencyStats, LatencySummary
from tandem.status_map import status_for
from tandem.errors import TandemError

log = logging.getLogger("tandem.executor")


class RpcMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats: dict[str, LatencyStats] = {}

    def add(self, method: str, seconds: float) -> None:
        with self._lock:
            self._stats.setdefault(method, LatencyStats()).add(seconds)

    def snapshot(self) -> dict[str, LatencySummary]:
        with self._lock:
            return {k: v.summary() for k, v in self._stats.items()}


class ErrorMappingInterceptor(grpc.ServerInterceptor):
    def __init__(self, metrics: RpcMetrics) -> None:
        self._metrics = metrics

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler  # health, reflection (streams) pass through untouched
        method = handler_call_details.method.rsplit("/", 1)[-1]
        inner = handler.unary_unary

        def wrapped(request: Any, context: grpc.ServicerContext) -> Any:
            start = time.perf_counter()
            try:
                return inner(request, context)
            except TandemError as exc:
                code = status_for(exc)
                log.info("%s -> %s: %s", method, code.name, exc)
                context.abort(code, str(exc))
            except Exception:  # a bug, not the caller's fault: log it whole, keep serving
                log.exception("%s failed", method)
                context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}; see the executor log")
            finally:
                self._metrics.add(method, time.perf_counter() - start)

        return grpc.unary_unary_rpc_method_handler(wrapped, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)
