"""Stop strings matched across token boundaries, with the text that may start one held back."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class StopMatch:
    stop: str  # the stop string that matched
    text: str  # the text to emit before finishing (the rest of the output, cut at the match)


class StopStringMatcher:
    """Feed it every piece of decoded text; it returns what may be streamed now, or the match.

    Text that is a proper prefix of some stop string is held back (a later token may complete the stop
    string, which must then not have been streamed); once it can no longer start one it is released.
    """

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        self._stops = tuple(s for s in stops if s)
        self._include = include_stop
        self._longest = max((len(s) for s in self._stops), default=0)
        self._pending = ""  # received but not yet released

    def feed(self, text: str) -> tuple[str, StopMatch | None]:
        """Returns (text to emit now, match or None). After a match, nothing more should be fed."""
        if not self._stops:
            return text, None
        pending = self._pending + text
        best: tuple[int, str] | None = None  # earliest match wins; the longer stop at equal positions
        for s in self._stops:
            at = pending.find(s)
            if at >= 0 and (best is None or at < best[0] or (at == best[0] and len(s) > len(best[1]))):
                best = (at, s)
        if best is not None:
            at, s = best
            self._pending = ""
            return "", StopMatch(s, pending[:at + len(s)] if self._include else pending[:at])
        hold = self._held_suffix(pending)
        self._pending = pending[len(pending) - hold:] if hold else ""
        return pending[:len(pending) - hold], None

    def flush(self) -> str:
        """At the end of the sequence (no stop string matched): the held-back text."""
        out, self._pending = self._pending, ""
        return out

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        for k in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
