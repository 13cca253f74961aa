"""Bearer tokens on the HTTP front (--auth-token-file), as an ASGI middleware in front of every route: the
`Authorization: Bearer <token>` header (what OpenAI clients send for their api_key) is checked by the same
Authenticator as gRPC calls. Missing or unknown: 401 (with `WWW-Authenticate: Bearer`); a scope too low:
403; both with OpenAI's error body. /health stays open for probes unless --auth-health; /metrics (the
operator's view of every client's traffic) needs an admin token; everything else a user token. The caller is
put in CURRENT_PRINCIPAL for the route (per-token limits)."""
from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from scheduler.http import errors
from tandem.errors import TandemError
from tandem.security.auth import CURRENT_PRINCIPAL, Authenticator
from tandem.security.tokens import Scope as TokenScope

OPEN_PATHS = frozenset({"/health"})
ADMIN_PATHS = frozenset({"/metrics"})


def scope_of(path: str) -> TokenScope:
    return TokenScope.ADMIN if path in ADMIN_PATHS else TokenScope.USER


class TokenAuth:
    def __init__(self, app: ASGIApp, authenticator: Authenticator, auth_health: bool = False) -> None:
        self.app = app
        self._auth = authenticator
        self._auth_health = auth_health

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not self._auth.on or (path in OPEN_PATHS and not self._auth_health):
            await self.app(scope, receive, send)
            return
        authorization = dict(scope.get("headers") or []).get(b"authorization")
        try:
            # Set in the task that serves this request (uvicorn runs each request in its own task).
            CURRENT_PRINCIPAL.set(self._auth.check(authorization, scope_of(path), path))
        except TandemError as exc:
            status, body = errors.of_exception(exc)
            response = errors.response(status, body["error"]["message"], None, body["error"]["code"])
            if status == 401:
                response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
