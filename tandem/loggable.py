"""Text a client sent (a request id, an adapter name, an error message quoting them) made safe for one log
line: control characters escaped, so a newline in a request id cannot forge log lines, and cut short."""
from __future__ import annotations


def loggable(text: str, limit: int = 300) -> str:
    """text as one log line: control characters (newlines: forged log lines) escaped, cut at limit characters."""
    cut = text[:limit]
    safe = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in cut)
    return safe + ("..." if len(text) > limit else "")
