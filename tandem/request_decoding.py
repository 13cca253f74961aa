"""Request bytes that are not a valid message: INVALID_ARGUMENT with a plain message, never the status gRPC
gives a deserializer that raises (the asyncio server's UNKNOWN "Unexpected <class '...DecodeError'>" with a
traceback per call; the thread-pool server's INTERNAL "Exception deserializing request!").

Both servers' error-mapping interceptors hand every method handler through `decoding_sync` / `decoding_aio`:
the handler's deserializer is replaced by one that never raises (it returns an `Undecodable` instead of the
message), and the behaviour refuses an `Undecodable` before it runs — for request streams, when the bad message
is read. An interceptor outside (tokens) sees the `Undecodable` as the request and still decides first. Each
server notes undecodable requests in its log at most once a minute per method, with a count."""
from __future__ import annotations

import inspect
import logging
import threading
import time
from typing import Any, Callable

import grpc

from tandem.errors import InvalidRequest

NOTE_EVERY_S = 60.0


class Undecodable:
    """What the deserializer returns instead of raising: the bytes are not a valid `type_name` message."""

    __slots__ = ("type_name", "reason")

    def __init__(self, type_name: str, reason: str) -> None:
        self.type_name = type_name
        self.reason = reason

    def error(self) -> InvalidRequest:
        return InvalidRequest(f"the request is not a valid {self.type_name} message: {self.reason}")


def _type_name(deserializer: Callable) -> str:
    """`tandem.generate.v1.GenerateRequest` for a generated message's FromString, else a neutral name."""
    owner = getattr(deserializer, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    return getattr(descriptor, "full_name", None) or "protobuf"


def _reason(exc: Exception) -> str:
    """The decoder's own words without class names: "Error parsing message with type 'X': Wire format was
    corrupt" -> "wire format was corrupt"."""
    text = str(exc).rsplit("': ", 1)[-1].strip() if "': " in str(exc) else ""
    if not text or len(text) > 200 or "<" in text or "/" in text:
        return "its bytes are not a valid protobuf encoding"
    return text[0].lower() + text[1:]


def safe_deserializer(deserializer: Callable | None) -> Callable | None:
    if deserializer is None:
        return None
    type_name = _type_name(deserializer)

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError, bad UTF-8 in a string field, ...: the caller's bytes
            return Undecodable(type_name, _reason(exc))

    return deserialize


class UndecodableNotes:
    """The log line for undecodable requests: the first per method, then at most one per NOTE_EVERY_S with the
    number seen since (a client, or an attacker, sending garbage in a loop does not flood the log)."""

    def __init__(self, log: logging.Logger, every_s: float = NOTE_EVERY_S) -> None:
        self._log = log
        self._every_s = every_s
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._since: dict[str, int] = {}

    def note(self, method: str, bad: Undecodable) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(method)
            self._since[method] = self._since.get(method, 0) + 1
            if last is not None and now - last < self._every_s:
                return
            count, self._since[method] = self._since[method], 0
            self._last[method] = now
        more = f" ({count} since the last note)" if last is not None else ""
        self._log.warning("%s -> INVALID_ARGUMENT: undecodable request bytes%s: %s; further ones are noted at "
                          "most once a minute", method, more, bad.reason)


def _kw(handler: grpc.RpcMethodHandler) -> dict:
    return dict(request_deserializer=safe_deserializer(handler.request_deserializer),
                response_serializer=handler.response_serializer)


def decoding_sync(handler: grpc.RpcMethodHandler, method: str, notes: UndecodableNotes) -> grpc.RpcMethodHandler:
    """For grpc.server: the same handler, refusing undecodable requests with INVALID_ARGUMENT."""
    def refuse(request: Any, context: grpc.ServicerContext) -> None:
        if isinstance(request, Undecodable):
            notes.note(method, request)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request.error()))

    def checked(requests, context):
        for request in requests:
            refuse(request, context)
            yield request

    if handler.unary_unary is not None:
        inner = handler.unary_unary

        def unary(request, context):
            refuse(request, context)
            return inner(request, context)
        return grpc.unary_unary_rpc_method_handler(unary, **_kw(handler))
    if handler.unary_stream is not None:
        inner_stream = handler.unary_stream

        def stream(request, context):
            refuse(request, context)
            yield from inner_stream(request, context)
        return grpc.unary_stream_rpc_method_handler(stream, **_kw(handler))
    if handler.stream_unary is not None:
        inner_su = handler.stream_unary
        return grpc.stream_unary_rpc_method_handler(lambda it, ctx: inner_su(checked(it, ctx), ctx), **_kw(handler))
    inner_ss = handler.stream_stream
    return grpc.stream_stream_rpc_method_handler(lambda it, ctx: inner_ss(checked(it, ctx), ctx), **_kw(handler))


def decoding_aio(handler: grpc.RpcMethodHandler, method: str, notes: UndecodableNotes) -> grpc.RpcMethodHandler:
    """For grpc.aio.server: the same handler (an async generator stays one, a coroutine that writes with
    context.write stays a coroutine), refusing undecodable requests with INVALID_ARGUMENT."""
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        if isinstance(request, Undecodable):
            notes.note(method, request)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request.error()))

    async def checked(requests, context):
        async for request in requests:
            await refuse(request, context)
            yield request

    def wrap(inner: Callable, request_streams: bool) -> Callable:
        async def first(request, context):
            if request_streams:
                return checked(request, context)
            await refuse(request, context)
            return request

        if inspect.isasyncgenfunction(inner):
            async def generator(request, context):
                async for message in inner(await first(request, context), context):
                    yield message
            return generator

        async def coroutine(request, context):
            result = inner(await first(request, context), context)
            return await result if inspect.isawaitable(result) else result
        return coroutine

    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary, False), **_kw(handler))
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream, False), **_kw(handler))
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary, True), **_kw(handler))
    return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream, True), **_kw(handler))
