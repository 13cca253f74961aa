"""Bearer tokens and their scopes, from a file the operator edits (--auth-token-file):

    # one token per line, then optionally its scope (user, the default, or admin)
    9f2c...e1  admin
    41b7...0c  user
    77de...9a

Blank lines and `#` comments are ignored. Tokens are compared in constant time (hmac.compare_digest, against
every token: the time does not say which one nearly matched). The file is read again when it changes (looked
at no more than once per second, and at once after SIGHUP); a file that no longer parses is refused with a log
line and the tokens read before stay in force, so a typo never opens the server nor locks everyone out.
"""
from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from tandem.security.file_watch import CHECK_INTERVAL_S, FileWatch

log = logging.getLogger("tandem.security")
MIN_TOKEN_CHARS = 16  # shorter ones are guessable; `openssl rand -hex 32` gives 64


class Scope(enum.IntEnum):
    """What a token may do; a higher scope includes the lower ones."""
    USER = 1  # generate, read its own session's caches, model facts
    ADMIN = 2  # also load/unload adapters and see or touch every session's caches


@dataclass(frozen=True)
class Principal:
    """Who made a call: a token's fingerprint (the first 12 hex digits of its SHA-256: names it in per-token
    accounts, and in str(), without revealing it) and its scope."""
    fingerprint: str
    scope: Scope

    def __str__(self) -> str:
        return f"token {self.fingerprint}"


class TokenFileError(ValueError):
    """A token file that cannot be used; the message names the line, never a token."""


def fingerprint(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:12]


def parse_tokens(text: str) -> list[tuple[bytes, Principal]]:
    """(token bytes, principal) for each token line; TokenFileError naming the first bad line."""
    out: list[tuple[bytes, Principal]] = []
    seen: set[str] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) > 2:
            raise TokenFileError(f"line {number}: want `TOKEN [user|admin]`, found {len(words)} words")
        token, scope_name = words[0], (words[1] if len(words) == 2 else "user")
        try:
            scope = Scope[scope_name.upper()]
        except KeyError:
            raise TokenFileError(f"line {number}: unknown scope {scope_name[:20]!r} (user or admin)") from None
        if len(token) < MIN_TOKEN_CHARS or not token.isascii() or not token.isprintable():
            raise TokenFileError(f"line {number}: a token must be at least {MIN_TOKEN_CHARS} printable ASCII "
                                 "characters (e.g. `openssl rand -hex 32`)")
        if token in seen:
            raise TokenFileError(f"line {number}: this token is already on an earlier line")
        seen.add(token)
        out.append((token.encode(), Principal(fingerprint(token), scope)))
    return out


class TokenFile:
    """The tokens of --auth-token-file, kept current. lookup() is what a server asks per call."""

    def __init__(self, path: Path, flag: str = "--auth-token-file", interval_s: float = CHECK_INTERVAL_S) -> None:
        self.path = Path(path)
        self._flag = flag
        self._lock = threading.Lock()
        self._tokens = self._read()  # at startup a bad file is an error (the caller exits)
        if not self._tokens:
            raise TokenFileError(f"{flag} {self.path} holds no token: nobody could call this server")
        self._watch = FileWatch([self.path], interval_s)

    def _read(self) -> list[tuple[bytes, Principal]]:
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenFileError(f"{self._flag}: cannot read {self.path}: {getattr(exc, 'strerror', exc)}") from None
        try:
            return parse_tokens(text)
        except TokenFileError as exc:
            raise TokenFileError(f"{self._flag} {self.path}: {exc}") from None

    def reload_now(self) -> None:
        """SIGHUP: read the file again on the next lookup."""
        self._watch.force()

    def _refresh(self) -> None:
        if not self._watch.changed():
            return
        try:
            tokens = self._read()
        except TokenFileError as exc:
            log.error("%s; the tokens read before stay in force", exc)
            return
        with self._lock:
            self._tokens = tokens
        log.info("%s re-read: %s", self._flag, describe(tokens))

    def lookup(self, presented: str) -> Principal | None:
        """The principal of a presented token, or None. Compares against every token in constant time each."""
        self._refresh()
        with self._lock:
            tokens = self._tokens
        candidate = presented.encode()
        found = None
        for token, principal in tokens:  # no early exit: the time does not depend on which one matched
            if hmac.compare_digest(token, candidate):
                found = principal
        return found

    def summary(self) -> str:
        with self._lock:
            return describe(self._tokens)


def describe(tokens: list[tuple[bytes, Principal]]) -> str:
    admins = sum(1 for _, p in tokens if p.scope is Scope.ADMIN)
    return f"{len(tokens)} token{'s' if len(tokens) != 1 else ''}, {admins} admin"


class ClientToken:
    """The token a client presents (the scheduler's --executor-token-file): the file's first token (its scope,
    if written, is the server's business), read again when the file changes."""

    def __init__(self, path: Path, flag: str = "--executor-token-file", interval_s: float = CHECK_INTERVAL_S) -> None:
        self.path = Path(path)
        self._flag = flag
        self._token = self._read()
        self._watch = FileWatch([self.path], interval_s)

    def _read(self) -> str:
        try:
            tokens = parse_tokens(self.path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenFileError(f"{self._flag}: cannot read {self.path}: {getattr(exc, 'strerror', exc)}") from None
        except TokenFileError as exc:
            raise TokenFileError(f"{self._flag} {self.path}: {exc}") from None
        if not tokens:
            raise TokenFileError(f"{self._flag} {self.path} holds no token")
        return tokens[0][0].decode()

    def reload_now(self) -> None:
        self._watch.force()

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata that carries it: (("authorization", "Bearer <token>"),)."""
        if self._watch.changed():
            try:
                self._token = self._read()
                log.info("%s re-read", self._flag)
            except TokenFileError as exc:
                log.error("%s; the token read before stays in use", exc)
        return (("authorization", f"Bearer {self._token}"),)
