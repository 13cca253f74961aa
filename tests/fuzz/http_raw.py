"""Raw HTTP/1.1 for the hardening and fuzz tests: bytes on a socket (garbage, trickled headers, a chosen source
address), a response read back whole, and the check that an error body is OpenAI's."""
from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

ERROR_KEYS = {"message", "type", "param", "code"}
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "invalid_request_error", 405: "invalid_request_error", 408: "invalid_request_error",
         413: "invalid_request_error", 429: "rate_limit_error", 503: "server_error"}


@dataclass
class Raw:
    status: int | None  # None: the server closed without a response
    headers: dict[str, str]
    body: bytes


def address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname, parts.port


def connect(url: str, source: str | None = None, timeout: float = 30.0) -> socket.socket:
    """A TCP connection to the server of `url`, from loopback address `source` (e.g. 127.0.0.2) if given."""
    return socket.create_connection(address(url), timeout=timeout,
                                    source_address=(source, 0) if source else None)


def read_response(sock: socket.socket) -> Raw:
    """One response (Content-Length bodies; or up to the close), or status None if the server closed first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return Raw(None, {}, data)
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", -1))
    while length < 0 or len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return Raw(int(lines[0].split()[1]), headers, body)


def exchange(url: str, raw: bytes, source: str | None = None, timeout: float = 30.0) -> Raw:
    """Sends `raw` on a new connection and reads the answer."""
    with connect(url, source, timeout) as sock:
        sock.sendall(raw)
        return read_response(sock)


def request_bytes(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    head = {"host": "x", "content-type": "application/json", "content-length": str(len(body)), **(headers or {})}
    return (f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items()) + "\r\n").encode() \
        + body


def openai_error(status: int, body: bytes | str | dict) -> dict:
    """The `error` object of an OpenAI error body, checked: the four keys, the status's type, a message, a code
    (never null); `param` a string or null."""
    payload = body if isinstance(body, dict) else json.loads(body)
    assert set(payload) == {"error"}, payload
    err = payload["error"]
    assert set(err) == ERROR_KEYS, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["code"], str) and err["code"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["type"] == TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"), (status, err)
    return err
