"""Errors of the HTTP front as OpenAI clients expect them: a JSON body {"error": {"message", "type", "param",
"code"}} with an HTTP status. tandem/status_map.py picks the gRPC status of a domain error (the one place that
decides); HTTP_STATUS_OF below only translates it, so a request fails the same way over HTTP and gRPC.
`code` is the gRPC status name in lower case ("invalid_argument", "resource_exhausted", ...), or
"model_not_found" for a `model` this server does not serve.
"""
from __future__ import annotations

import logging
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from tandem.errors import AdapterNotFound, InvalidRequest, TandemError
from tandem.loggable import loggable
from tandem.status_map import status_for

log = logging.getLogger("tandem.scheduler")

HTTP_STATUS_OF: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,  # prompt + max_tokens past the model's length: OpenAI answers 400
    grpc.StatusCode.FAILED_PRECONDITION: 400,  # e.g. chat messages for a model without a chat template
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_TYPE_OF = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


class BadParameter(InvalidRequest):
    """A request field this server refuses (unsupported, or a value the proto cannot carry); names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def error_type(status: int) -> str:
    if status in _TYPE_OF:
        return _TYPE_OF[status]
    return "server_error" if status >= 500 else "invalid_request_error"


def body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(body(status, message, param, code), status_code=status)


def of_exception(exc: Exception) -> tuple[int, dict[str, Any]]:
    """(HTTP status, error body) of an exception raised while serving a request (also used for the error
    event that ends a stream already under way)."""
    if not isinstance(exc, TandemError):  # a bug, not the caller's fault: log it whole
        log.error("HTTP request failed", exc_info=exc)
        return 500, body(500, "internal error; see the scheduler log", code="internal")
    code = status_for(exc)
    status = HTTP_STATUS_OF.get(code, 500)
    log.info("HTTP -> %d %s: %s", status, code.name, loggable(str(exc)))
    name = "model_not_found" if isinstance(exc, AdapterNotFound) else code.name.lower()
    return status, body(status, str(exc), getattr(exc, "param", None), name)


def validation_param(loc: tuple[Any, ...]) -> str | None:
    """`messages.0.content` from pydantic's ('body', 'messages', 0, 'content', 'str'): the field path, without
    the union-member tags pydantic adds ('str', 'list[constrained-int]', ...)."""
    parts = []
    for p in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(p, int):
            parts.append(str(p))
        elif isinstance(p, str) and p.isidentifier() and p not in _TYPE_TAGS:
            parts.append(p)
        else:
            break
    return ".".join(parts) or None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def install(app: FastAPI) -> None:
    """Every error the app returns gets the OpenAI body: domain errors, validation errors (400, not FastAPI's
    422), unknown routes and methods, and bugs (500)."""

    @app.exception_handler(TandemError)
    async def _domain(request: Request, exc: TandemError) -> JSONResponse:
        status, content = of_exception(exc)
        return JSONResponse(content, status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request body"}
        if first.get("type") == "json_invalid":  # its loc is a character position, not a field
            return response(400, f"the body is not valid JSON: {first['msg']}", None, "invalid_argument")
        param = validation_param(tuple(first.get("loc", ())))
        message = f"{param}: {first['msg']}" if param else f"invalid request body: {first['msg']}"
        return response(400, message, param, "invalid_argument")

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "resource_exhausted"}.get(exc.status_code)
        return response(exc.status_code, str(exc.detail), None, code)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        status, content = of_exception(exc)
        return JSONResponse(content, status_code=status)
