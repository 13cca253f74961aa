"""Errors of the HTTP front as OpenAI clients expect them: a JSON body {"error": {"message", "type", "param",
"code"}} with an HTTP status. tandem/status_map.py picks the gRPC status of a domain error (the one place that
decides); HTTP_STATUS_OF below only translates it, so a request fails the same way over HTTP and gRPC.
`code` is the gRPC status name in lower case ("invalid_argument", "resource_exhausted", ...), or
"model_not_found" for a `model` this server does not serve; errors that only HTTP has (an unknown route, a
body that does not parse, a timeout reading it) carry the name of the gRPC status of the same meaning
(CODE_OF_HTTP_STATUS), never null.
"""
from __future__ import annotations

import contextvars
import json
import logging
import re
from typing import Any, Callable

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from tandem.errors import AdapterNotFound, InvalidRequest, Overloaded, TandemError
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
    grpc.StatusCode.DATA_LOSS: 500,  # KV that failed its checksum between executors (tandem/errors.py DataLoss)
}
_TYPE_OF = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
# The `code` of an error raised as a bare HTTP status (starlette's HTTPException, the connection guard).
CODE_OF_HTTP_STATUS: dict[int, str] = {
    400: "invalid_argument", 401: "unauthenticated", 403: "permission_denied", 404: "not_found",
    405: "method_not_allowed", 408: "deadline_exceeded", 413: "resource_exhausted", 415: "invalid_argument",
    422: "invalid_argument", 429: "resource_exhausted", 500: "internal", 501: "unimplemented",
    503: "unavailable", 504: "deadline_exceeded",
}


class BadParameter(InvalidRequest):
    """A request field this server refuses (unsupported, or a value the proto cannot carry); names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def error_type(status: int) -> str:
    if status in _TYPE_OF:
        return _TYPE_OF[status]
    return "server_error" if status >= 500 else "invalid_request_error"


def code_of(status: int) -> str:
    return CODE_OF_HTTP_STATUS.get(status, "internal" if status >= 500 else "invalid_argument")


def body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The OpenAI error body; code None: the status's (code_of). Text that is not valid Unicode (a lone
    surrogate quoted back) is escaped: the body must encode as UTF-8 whatever the message holds."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    if param is not None:
        param = param.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code or code_of(status)}}


def raw_response(status: int, reason: str, message: str, code: str | None = None) -> bytes:
    """A whole HTTP/1.1 response with the error body and `Connection: close`, as bytes, for the connection
    guard (scheduler/http/connections.py), which answers below the app."""
    content = json.dumps(body(status, message, None, code)).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(content)}\r\n"
            "connection: close\r\n\r\n").encode() + content


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
    param = getattr(exc, "param", None)
    if param is None and exc.field is not None:  # a check of the generate codec: named as the client sent it
        param = openai_param(exc.field)
    message = exc.in_terms(param) if exc.field is not None and param is not None else str(exc)
    return status, body(status, message, param, name)


# tandem.generate.v1 field paths -> the OpenAI parameter they come from (scheduler/http/convert.py), by prefix;
# what follows the prefix is kept, indexes written as the schema errors write them (`messages.2.content`).
# A route whose names differ (max_completion_tokens, completions' logprobs) says so with named_as().
_OPENAI_PARAMS: dict[str, str] = {
    "stopping.max_new_tokens": "max_tokens", "stopping.min_new_tokens": "min_tokens", "stopping.stop_token_ids":
    "stop_token_ids", "stopping.stop": "stop", "sampling.": "", "messages.messages": "messages",
    "messages.tools": "tools", "text": "prompt", "token_ids": "prompt", "input": "prompt", "constraint": "response_format",
    "top_logprobs": "top_logprobs", "prompt_logprobs": "prompt_logprobs", "cache_salt": "cache_salt",
    "request_id": "request_id",
}
# OpenAI nests a function's fields under `function` (the proto does not): tools.0.name -> tools.0.function.name
_FUNCTION_FIELDS = ((re.compile(r"^tools\.(\d+)\.(name|description|parameters)"), r"tools.\1.function.\2"),
                    (re.compile(r"^messages\.(\d+)\.tool_calls\.(\d+)\.(name|arguments)"),
                     r"messages.\1.tool_calls.\2.function.\3"))
_ROUTE_NAMES: contextvars.ContextVar[tuple[dict[str, str], Callable[[str], str] | None]] = \
    contextvars.ContextVar("openai_param_names", default=({}, None))


def named_as(names: dict[str, str], rename: Callable[[str], str | None] | None = None) -> None:
    """The current request's own names for some fields (`{"stopping.max_new_tokens": "max_completion_tokens"}`),
    and a last renaming of the chat parameter a field maps to, for a route whose body is not a chat request's
    (/v1/responses: `max_completion_tokens` -> `max_output_tokens`): set by a route, before the checks run, for
    its errors."""
    _ROUTE_NAMES.set((names, rename))


def openai_param(field: str) -> str:
    """The OpenAI parameter of a proto field path: `sampling.top_p` -> `top_p`, `stopping.stop[2]` -> `stop.2`,
    `messages.messages[1].content` -> `messages.1.content`."""
    route_names, rename = _ROUTE_NAMES.get()
    names = {**_OPENAI_PARAMS, **route_names}
    prefix = max((p for p in names if field == p or field.startswith(p if p.endswith(".") else (p + "."))
                  or field.startswith(p + "[")), key=len, default="")
    rest = field[len(prefix):] if prefix else field
    name = re.sub(r"\[(\d+)\]", r".\1", (names[prefix] + rest) if prefix else rest).strip(".")
    for pattern, nested in _FUNCTION_FIELDS:
        name = pattern.sub(nested, name, count=1)
    return (rename(name) or name) if rename is not None else name


def retry_headers(exc: Exception) -> dict[str, str]:
    """`Retry-After` (whole seconds, RFC 9110) for a refusal for overload: when a retry is likely to be taken,
    from the measured drain rate (tandem.errors.Overloaded.retry_after_s)."""
    return {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, Overloaded) else {}


def validation_param(loc: tuple[Any, ...]) -> str | None:
    """`messages.0.content.1.text` from pydantic's ('body', 'messages', 0, 'content', 'list[ContentPart]', 1,
    'text'): the field path, without the union-member tags pydantic adds ('str', 'list[constrained-int]',
    'NamedToolChoice', ...); it stops at a dict key (logit_bias's)."""
    parts = []
    for p in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(p, int):
            parts.append(str(p))
        elif not isinstance(p, str):
            break
        elif p in _TYPE_TAGS or "[" in p or p[:1].isupper():  # a union member's tag (fields are snake_case)
            continue
        elif p.isidentifier():
            parts.append(p)
        else:
            break
    return ".".join(parts) or None


def _most_specific(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """Of pydantic's errors (one per union member tried), the one that says most: a value's own error before a
    union member's type mismatch, then the deepest: for prompt [1, 2, 2**40] "prompt.2: ... less than or equal
    to 4294967295", not "prompt.0: Input should be a valid string"."""
    return max(errors, key=lambda e: (not str(e.get("type", "")).endswith("_type"), len(e.get("loc", ()))),
               default={"loc": (), "msg": "invalid request body"})


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _unknown_field(loc: tuple[Any, ...]) -> JSONResponse:
    """400 for a field the API does not have: named (with its path) rather than dropped, so a client that
    relies on it (vLLM's use_beam_search, OpenAI's audio, ...) learns it was not served."""
    where = validation_param(loc[:-1])
    name = str(loc[-1])[:80] if loc else "?"
    param = f"{where}.{name}" if where else name
    return response(400, f"unknown field {param!r}: this server does not serve it (the fields it takes: "
                    "docs/serving.md#openai-compatible-http); remove it from the request", param,
                    "invalid_argument")


def _unreadable(cause: BaseException) -> str:
    """The message of a body FastAPI could not read for a reason other than bad JSON syntax."""
    if isinstance(cause, ValueError) and "digits" in str(cause):  # Python reads integers of <= 4300 digits
        return "the body holds a number with too many digits to read; integers here fit in 64 bits"
    if isinstance(cause, (UnicodeDecodeError, RecursionError)):
        return f"the body is not valid JSON ({type(cause).__name__}): send UTF-8 JSON of reasonable nesting depth"
    return "the body could not be read as JSON: send a JSON object with content-type application/json"


def install(app: FastAPI) -> None:
    """Every error the app returns gets the OpenAI body: domain errors, validation errors (400, not FastAPI's
    422), unknown routes and methods, and bugs (500)."""

    @app.exception_handler(TandemError)
    async def _domain(request: Request, exc: TandemError) -> JSONResponse:
        status, content = of_exception(exc)
        return JSONResponse(content, status_code=status, headers=retry_headers(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = _most_specific(list(exc.errors()))
        loc = tuple(first.get("loc", ()))
        if first.get("type") == "json_invalid":  # its loc is a character position, not a field
            where = f" at character {loc[-1]}" if loc and isinstance(loc[-1], int) else ""
            detail = (first.get("ctx") or {}).get("error") or first["msg"]
            return response(400, f"the body is not valid JSON: {detail}{where}", None, "invalid_argument")
        if loc in (("body",), ()) and first.get("type") in ("model_attributes_type", "dict_type", "missing"):
            return response(400, "the body must be a JSON object, sent with content-type application/json"
                            + ("" if first.get("type") != "missing" else f" ({first['msg']})"), None,
                            "invalid_argument")
        if first.get("type") == "extra_forbidden":
            return _unknown_field(loc)
        param = validation_param(loc)
        message = f"{param}: {first['msg']}" if param else f"invalid request body: {first['msg']}"
        return response(400, message, param, "invalid_argument")

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI could not read the body
            message = _unreadable(exc.__cause__)
        elif exc.status_code in (404, 405) and message in ("Not Found", "Method Not Allowed"):  # routing's
            message = f"{request.method} {request.url.path[:200]}: {message.lower()} (routes: docs/serving.md)"
        return response(exc.status_code, message, None, code_of(exc.status_code))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        status, content = of_exception(exc)
        return JSONResponse(content, status_code=status)
