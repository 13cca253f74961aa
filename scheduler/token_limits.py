"""Per-token shares of the scheduler (--max-concurrent-per-token, --max-queued-tokens-per-token): one client
that floods the server is refused RESOURCE_EXHAUSTED / 429 while every other token's calls go on.

What counts is generation, in choices: a Generate call is one choice, an HTTP completion request as many as
it asks for (prompts x n), all in flight from arrival to the last token (checked before tokenizing: a refused
call costs nothing; a request with more choices than the whole share is INVALID_ARGUMENT / 400, since no retry
can help it); its tokens are its prompts' lengths plus the max_new_tokens of every choice (checked once
tokenized), held until it ends.
Tokenize, GetModelInfo and the model listings are cheap and not counted. Everything runs on the scheduler's
event loop, so plain counters suffice.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from scheduler.request import GenerateRequest
from tandem.errors import InvalidRequest, TokenLimitExceeded
from tandem.security.tokens import Principal


def cost(requests: Iterable[GenerateRequest]) -> int:
    """The tokens requests may hold: every prompt token and every token they may generate."""
    return sum(len(r.prompt_ids) + r.stopping.max_new_tokens for r in requests)


class Lease:
    """One request's share: charge() its tokens once known, release() when it ends (idempotent). A context
    manager that releases on exit."""

    def __init__(self, limits: "TokenLimits | None", key: str | None, choices: int = 1) -> None:
        self._limits = limits
        self._key = key
        self._choices = choices
        self._tokens = 0
        self._open = limits is not None and key is not None

    def charge(self, tokens: int) -> None:
        if self._open:
            self._limits._charge(self._key, tokens)
            self._tokens += tokens

    def release(self) -> None:
        if self._open:
            self._open = False
            self._limits._release(self._key, self._choices, self._tokens)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class TokenLimits:
    """None = no limit of that kind. Without tokens (principal None) nothing is counted: there is no client to
    tell apart (the CLI refuses these flags without --auth-token-file)."""

    def __init__(self, max_concurrent: int | None = None, max_tokens: int | None = None) -> None:
        self.max_concurrent = max_concurrent
        self.max_tokens = max_tokens
        self._running: Counter[str] = Counter()
        self._tokens: Counter[str] = Counter()

    @property
    def on(self) -> bool:
        return self.max_concurrent is not None or self.max_tokens is not None

    def enter(self, principal: Principal | None, choices: int = 1) -> Lease:
        """A new request of `principal` with `choices` choices (prompts x n; a Generate call has one):
        TokenLimitExceeded when they would bring its choices in flight past max_concurrent, InvalidRequest when
        they are more than max_concurrent alone."""
        if not self.on or principal is None:
            return Lease(None, None)
        key, cap = principal.fingerprint, self.max_concurrent
        if cap is not None and choices > cap:
            raise InvalidRequest(f"this request has {choices} choices (prompts x n) and a token may have at most "
                                 f"{cap} in flight (--max-concurrent-per-token {cap}); ask for fewer")
        if cap is not None and self._running[key] + choices > cap:
            raise TokenLimitExceeded(f"this token already has {self._running[key]} choices in flight; this "
                                     f"request's {choices} would pass its limit (--max-concurrent-per-token {cap}); "
                                     "retry when some have finished")
        self._running[key] += choices
        return Lease(self, key, choices)

    def _charge(self, key: str, tokens: int) -> None:
        held = self._tokens[key]
        if self.max_tokens is not None and held + tokens > self.max_tokens:
            raise TokenLimitExceeded(f"this request's {tokens} tokens (prompt + max new tokens) would bring this "
                                     f"token's requests in flight to {held + tokens} tokens, over its limit "
                                     f"(--max-queued-tokens-per-token {self.max_tokens}); retry when some have "
                                     "finished, or ask for fewer tokens")
        self._tokens[key] += tokens

    def _release(self, key: str, choices: int, tokens: int) -> None:
        self._running[key] -= choices
        self._tokens[key] -= tokens
        if self._running[key] <= 0:  # forget idle tokens: the counters stay as small as the active clients
            del self._running[key]
            self._tokens.pop(key, None)

    def in_flight(self, principal: Principal) -> tuple[int, int]:
        """(choices, tokens) `principal` has in flight now."""
        return self._running[principal.fingerprint], self._tokens[principal.fingerprint]
