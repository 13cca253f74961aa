"""The one decision both servers' gRPC interceptors and the HTTP front make per call: who is calling (a
bearer token from --auth-token-file) and whether that token's scope covers what the call needs. Failures are
domain errors, so the shared status table (tandem/status_map.py) picks UNAUTHENTICATED / PERMISSION_DENIED and
the HTTP front its 401 / 403. Messages never repeat the token presented."""
from __future__ import annotations

import contextvars

from tandem.errors import PermissionDenied, Unauthenticated
from tandem.security.tokens import Principal, Scope, TokenFile

# The caller of the request being served (None with tokens off). Set by the interceptor / the HTTP middleware
# in the task that runs the handler, read by what keeps per-token accounts (scheduler/token_limits.py).
CURRENT_PRINCIPAL: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("principal", default=None)
_HOW = "send the header `authorization: Bearer <token>` (the OpenAI client's api_key)"


def bearer(value: str | bytes | None) -> str | None:
    """The token of an `authorization: Bearer <token>` value (the scheme in any case), else None."""
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class Authenticator:
    """tokens None: authentication is off and every call is allowed (principal None)."""

    def __init__(self, tokens: TokenFile | None) -> None:
        self.tokens = tokens

    @property
    def on(self) -> bool:
        return self.tokens is not None

    def check(self, authorization: str | bytes | None, needed: Scope, what: str) -> Principal | None:
        """The caller's principal when its token may do `what` (an RPC or route name, for the message);
        Unauthenticated when the token is missing or unknown, PermissionDenied when its scope is too low."""
        if self.tokens is None:
            return None
        token = bearer(authorization)
        if token is None:
            raise Unauthenticated(f"this server needs a token: {_HOW}")
        principal = self.tokens.lookup(token)
        if principal is None:
            raise Unauthenticated("the token is not valid here (unknown, or no longer in the server's token file)")
        if principal.scope < needed:
            raise PermissionDenied(f"{what} needs a token with scope {needed.name.lower()}; this token has scope "
                                   f"{principal.scope.name.lower()}")
        return principal
