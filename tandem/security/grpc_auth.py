"""Token checks at the gRPC edge: one interceptor for the executor's thread-pool server, one for the
scheduler's asyncio server, both asking the same Authenticator (auth.py) with the scope a per-service rule
gives. They sit before the error-mapping interceptor and compose with it: a refused call never reaches it.

Health (grpc.health.v1) stays open for probes unless the server was started with --auth-health; reflection,
when on, needs a token like any other call (grpcurl -H 'authorization: Bearer ...' sends it there too). The
rule sees the request, so a method can need a higher scope for some requests only (the executor's ListCaches
of every session). The asyncio one puts the caller in CURRENT_PRINCIPAL for the handler (the scheduler keeps
per-token accounts); the executor's handlers do not need it.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

import grpc

from tandem.errors import TandemError
from tandem.security.auth import CURRENT_PRINCIPAL, Authenticator
from tandem.security.tokens import Principal, Scope
from tandem.status_map import status_for

log = logging.getLogger("tandem.security")
HEALTH_PREFIX = "/grpc.health.v1.Health/"
# (full method name "/package.Service/Method", the request or None for client streams) -> the scope it needs
ScopeRule = Callable[[str, Any], Scope]


def everyone_user(method: str, request: Any) -> Scope:
    """The rule of a service whose every method is the user scope's (the scheduler's GenerateService)."""
    return Scope.USER


def _authorization(metadata) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            return value
    return None


class _Gate:
    """What both interceptors share: whether a method is checked, and the check itself."""

    def __init__(self, authenticator: Authenticator, scope_of: ScopeRule, auth_health: bool) -> None:
        self._auth = authenticator
        self._scope_of = scope_of
        self._auth_health = auth_health

    def checked(self, method: str) -> bool:
        return self._auth.on and (self._auth_health or not method.startswith(HEALTH_PREFIX))

    def check(self, method: str, authorization: str | None, request: Any) -> Principal | None:
        try:
            return self._auth.check(authorization, self._scope_of(method, request), method.rsplit("/", 1)[-1])
        except TandemError as exc:
            log.info("%s refused: %s", method, status_for(exc).name)  # no token, no message (they quote nothing)
            raise


class AuthInterceptor(grpc.ServerInterceptor):
    """For grpc.server (the executor): refuses calls without a token of the needed scope."""

    def __init__(self, authenticator: Authenticator, scope_of: ScopeRule, auth_health: bool = False) -> None:
        self._gate = _Gate(authenticator, scope_of, auth_health)

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or not self._gate.checked(details.method):
            return handler
        method, authorization = details.method, _authorization(details.invocation_metadata)
        gate = self._gate

        def admit(request: Any, context: grpc.ServicerContext) -> None:
            try:
                gate.check(method, authorization, request)
            except TandemError as exc:
                context.abort(status_for(exc), str(exc))

        def unary(inner):
            def call(request, context):
                admit(request, context)
                return inner(request, context)
            return call

        def streaming(inner, request_streams: bool):
            def call(request, context):
                admit(None if request_streams else request, context)
                yield from inner(request, context)
            return call

        def client_streaming(inner):
            def call(request_iterator, context):
                admit(None, context)
                return inner(request_iterator, context)
            return call

        kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **kw)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream, False), **kw)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(client_streaming(handler.stream_unary), **kw)
        return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream, True), **kw)


class AioAuthInterceptor(grpc.aio.ServerInterceptor):
    """For grpc.aio.server (the scheduler). A wrapped handler keeps the kind of the one it wraps: an async
    generator stays one, a coroutine that writes with context.write (health's Watch) stays a coroutine."""

    def __init__(self, authenticator: Authenticator, scope_of: ScopeRule, auth_health: bool = False) -> None:
        self._gate = _Gate(authenticator, scope_of, auth_health)

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or not self._gate.checked(details.method):
            return handler
        method, authorization = details.method, _authorization(details.invocation_metadata)
        gate = self._gate

        async def admit(request: Any, context: grpc.aio.ServicerContext) -> None:
            try:
                # Set in the task that runs the handler, and left set: the task ends with the call.
                CURRENT_PRINCIPAL.set(gate.check(method, authorization, request))
            except TandemError as exc:
                await context.abort(status_for(exc), str(exc))

        def wrap(inner, request_streams: bool):
            if inspect.isasyncgenfunction(inner):
                async def generator(request, context):
                    await admit(None if request_streams else request, context)
                    async for message in inner(request, context):
                        yield message
                return generator

            async def coroutine(request, context):
                await admit(None if request_streams else request, context)
                result = inner(request, context)
                return await result if inspect.isawaitable(result) else result
            return coroutine

        kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary, False), **kw)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream, False), **kw)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary, True), **kw)
        return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream, True), **kw)
