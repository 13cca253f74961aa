"""One asyncio server interceptor: domain errors -> gRPC status codes (tandem/status_map.py, the
table both servers share), unexpected exceptions -> INTERNAL with the traceback in the log, and request bytes
that are not a valid message -> INVALID_ARGUMENT on every method (tandem/request_decoding.py). GenerateService
calls over --max-concurrent-rpcs are RESOURCE_EXHAUSTED on arrival (tandem/call_limit.py says why here)."""
from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any, AsyncIterator, Callable

import grpc

from tandem.call_limit import CallLimit
from tandem.errors import Overloaded, TandemError
from tandem.loggable import loggable
from tandem.request_decoding import UndecodableNotes, decoding_aio
from tandem.status_map import status_for

log = logging.getLogger("tandem.scheduler")


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, limit: CallLimit | None = None) -> None:
        self._notes = UndecodableNotes(log)
        self._limit = limit

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        return decoding_aio(self._mapped(handler, details), details.method, self._notes)

    def _mapped(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = details.method.rsplit("/", 1)[-1]
        ours = details.method.startswith(_OURS)
        hold = self._limit.hold if self._limit is not None else nullcontext
        if handler.unary_unary is not None and ours:
            inner = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    with hold():
                        return await inner(request, context)
                except Exception as exc:
                    await _abort(context, method, exc)

            return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=handler.request_deserializer,
                                                       response_serializer=handler.response_serializer)
        if handler.unary_stream is not None and ours:
            inner_stream = handler.unary_stream

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                try:
                    with hold():
                        async for message in inner_stream(request, context):
                            yield message
                except Exception as exc:
                    await _abort(context, method, exc)

            return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=handler.request_deserializer,
                                                        response_serializer=handler.response_serializer)
        return handler  # health, reflection: untouched


# GenerateService, and vLLM's engine protocol that smg speaks (scheduler/compat/vllm_engine_servicer.py)
_OURS = ("/tandem.generate.v1.GenerateService/", "/vllm.grpc.engine.VllmEngine/")


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
    if isinstance(exc, grpc.aio.AbortError):  # context.abort() already ran (inside the handler)
        raise exc
    if not isinstance(exc, TandemError):  # a bug, not the caller's fault: log it whole, keep serving
        log.exception("%s failed", method, exc_info=exc)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}; see the scheduler log")
    code = status_for(exc)
    log.info("%s -> %s: %s", method, code.name, loggable(str(exc)))
    await context.abort(code, str(exc), retry_metadata(exc))


def retry_metadata(exc: Exception) -> tuple[tuple[str, str], ...]:
    """The trailing metadata of a refusal for overload: when to retry, as gRPC's own retry reads it
    (`grpc-retry-pushback-ms`, gRFC A6: a client whose retry policy covers RESOURCE_EXHAUSTED waits that long) and
    as HTTP proxies and routers read it (`retry-after`, whole seconds)."""
    if not isinstance(exc, Overloaded):
        return ()
    return (("grpc-retry-pushback-ms", str(exc.retry_after_s * 1000)), ("retry-after", str(exc.retry_after_s)))

