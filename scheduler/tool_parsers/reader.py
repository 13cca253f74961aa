"""One choice's output read for tool calls, whole or as it streams: the content the user reads and the calls, with
the deltas a stream sends (content, then per call its id and name once, then fragments of its arguments, as OpenAI
streams them).

A stream and a whole response of the same text agree, however the text was split into deltas: each delta re-reads
all the text so far (scan) and sends only what the scan added to what was sent. This holds because a scan only ever
adds: text that may still turn into a call (the start of a marker, a call whose name has not come, whitespace that
may touch a call) is held back until it is decided. The one difference: a call that breaks after its name and
part of its arguments were streamed cannot be taken back — the stream ends it there and sends the rest of its text
as content, while the whole response gives its text as content (a call that does not parse is never a call).

Content is the text outside the calls, without the whitespace that touches a call; runs of text on both sides of a
call are joined by a newline. With no call the content is the text exactly. Special tokens other than the syntax's
markers (an end-of-turn token kept in the text because a marker is a special token) are removed from it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from scheduler.tool_parsers.json_prefix import Memo
from scheduler.tool_parsers.syntax import Call, Piece, Syntax, Text, held_suffix


@dataclass(frozen=True)
class CallDelta:
    index: int
    id: str | None = None  # the first delta of a call: its id and name
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class Update:
    content: str = ""
    calls: tuple[CallDelta, ...] = ()


@dataclass(frozen=True)
class MadeCall:
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Message:
    """A whole output read: content (None when empty and calls were made) and the complete calls."""
    content: str | None
    calls: tuple[MadeCall, ...] = ()


class SpecialFilter:
    """Removes special-token texts (those not in keep) from text that arrives in pieces; the end of a piece that may
    be the start of one is held until the next piece (or the end) decides."""

    def __init__(self, specials: frozenset[str], keep: tuple[str, ...]) -> None:
        self._drop = tuple(sorted((s for s in specials if s and s not in keep), key=len, reverse=True))
        self._re = re.compile("|".join(map(re.escape, self._drop))) if self._drop else None
        self._pending = ""

    def __call__(self, text: str, final: bool) -> str:
        if self._re is None:
            return text
        text = self._re.sub("", self._pending + text)
        hold = 0 if final else held_suffix(text, self._drop)
        self._pending = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold]


@dataclass
class _Sent:
    content: str = ""
    ids: list[str] = field(default_factory=list)
    arguments: list[str] = field(default_factory=list)


class ToolCallReader:
    """Reads one choice's output. tools: the names it may call; max_calls: 1 with parallel_tool_calls false (later
    calls are dropped), None for any number. strip: the special-token filter (None: the text is kept as it is)."""

    def __init__(self, syntax: Syntax, tools: frozenset[str], max_calls: int | None = None,
                 strip: SpecialFilter | None = None) -> None:
        self.syntax = syntax
        self.tools = tools
        self.max_calls = max_calls
        self._strip = strip
        self.text = ""
        self._memo: Memo = {}  # (the text only grows: JSON read before is not read again)
        self._sent = _Sent()
        self.done_calls = 0  # calls complete so far (streamed)

    def _add(self, text: str, final: bool) -> None:
        self.text += self._strip(text, final) if self._strip is not None else text

    def feed(self, text: str, final: bool = False) -> Update:
        """The deltas to stream for this much more text (final: no more follows)."""
        self._add(text, final)
        pieces = self._limit(self.syntax.scan(self.text, final, self.tools, self._memo))
        content, calls = _content(pieces, final, whole=False), [p for p in pieces if isinstance(p, Call)]
        sent = self._sent
        if not content.startswith(sent.content):  # (a scan only adds; never send a content that contradicts it)
            content = sent.content
        out_content, sent.content = content[len(sent.content):], content
        deltas = []
        for k, c in enumerate(calls):
            if k == len(sent.ids):
                sent.ids.append(self.syntax.call_id())
                sent.arguments.append(c.arguments)
                deltas.append(CallDelta(k, sent.ids[k], c.name, c.arguments))
            elif c.arguments.startswith(sent.arguments[k]) and len(c.arguments) > len(sent.arguments[k]):
                deltas.append(CallDelta(k, arguments=c.arguments[len(sent.arguments[k]):]))
                sent.arguments[k] = c.arguments
        self.done_calls = sum(c.done and c.broken is None for c in calls)
        return Update(out_content, tuple(deltas))

    def whole(self, text: str) -> Message:
        """The message of a whole output (call once, on a fresh reader)."""
        self._add(text, True)
        pieces = self._limit(self.syntax.scan(self.text, True, self.tools))
        calls = tuple(MadeCall(self.syntax.call_id(), p.name, p.arguments) for p in pieces
                      if isinstance(p, Call) and p.done and p.broken is None)
        content = _content(pieces, True, whole=True)
        return Message(content if content or not calls else None, calls)

    def _limit(self, pieces: list[Piece]) -> list[Piece]:
        if self.max_calls is None:
            return pieces
        out, calls = [], 0
        for p in pieces:
            if isinstance(p, Call):
                calls += 1
                if calls > self.max_calls:
                    continue
            out.append(p)
        return out


def _content(pieces: list[Piece], final: bool, whole: bool) -> str:
    """The content of the pieces: text runs stripped where they touch a call, joined by newlines. Not final: the
    last run's trailing whitespace is held (a call may follow)."""
    runs: list[str] = []  # one per stretch between calls
    called: list[bool] = []  # whether a call precedes the run
    current, after_call = "", False
    for p in pieces:
        if isinstance(p, Text) or (whole and p.broken is not None):
            current += p.text if isinstance(p, Text) else p.broken
            continue
        runs.append(current)
        called.append(after_call)
        current, after_call = p.tail if p.broken is not None else "", True
    runs.append(current)
    called.append(after_call)
    out = []
    for k, run in enumerate(runs):
        if called[k]:
            run = run.lstrip()
        if k < len(runs) - 1 or not final:
            run = run.rstrip()
        if run:
            out.append(run)
    return "\n".join(out)
