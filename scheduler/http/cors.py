"""CORS on the HTTP front (--allowed-origins): starlette's middleware, whose refused preflight (plain text
"Disallowed CORS origin") answers with OpenAI's error body instead, like every other error of the front."""
from __future__ import annotations

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response

from scheduler.http import errors


class Cors(CORSMiddleware):
    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        refused = errors.response(400, f"{bytes(response.body).decode()}: this server allows cross-origin calls "
                                       "only from the origins of --allowed-origins, with GET or POST")
        for name in ("vary", "access-control-allow-methods", "access-control-max-age"):
            if name in response.headers:
                refused.headers[name] = response.headers[name]
        return refused
