"""The request size limit of the HTTP front (--max-message-mb, the gRPC server's too): a body over it is
413 — refused from its Content-Length before a byte is read, or, sent chunked, as soon as it passes the limit
(nothing more is buffered)."""
from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from scheduler.http import errors


class BodyLimit:
    """ASGI middleware: at most max_bytes of request body."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _message(self) -> str:
        return (f"the request body is over this server's limit of {self.max_bytes // (1024 * 1024)} MiB "
                "(--max-message-mb)")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await errors.response(413, self._message(), None, "resource_exhausted")(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # An HTTPException passes through FastAPI's body reading (other errors become its 400)
                    # to the app's handler, which answers with the OpenAI error body.
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, limited, send)
