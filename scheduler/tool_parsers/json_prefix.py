"""How far a JSON value written by a model reaches: complete (where it ends), still a valid prefix of some JSON
value (the text so far could go on), or broken (where it stops being JSON). A hand-written scanner rather than
json.loads, because a streamed tool call's arguments are sent as they come: only a valid prefix may be sent, and
the end of the arguments object must be found in text that goes on after it (a closing tag, the next call).
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass

_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_PREFIX = re.compile(r"-?(?:0|[1-9][0-9]*)?(?:\.[0-9]*)?(?:[eE][+-]?[0-9]*)?")
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]*')  # characters a string holds as they are
_ESCAPE = re.compile(r'\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})')
_WS = " \t\r\n"
_LITERALS = ("true", "false", "null")


class Reach(enum.Enum):
    COMPLETE = "complete"  # a whole value ends at `end`
    PARTIAL = "partial"  # the text ends inside a value that could still be completed
    BROKEN = "broken"  # the text stops being JSON at `end`


@dataclass(frozen=True)
class Extent:
    reach: Reach
    end: int  # COMPLETE: just past the value; PARTIAL: len(text); BROKEN: the first character that is wrong


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def string_end(text: str, i: int) -> Extent:
    """The extent of the string starting with the quote at text[i]."""
    i += 1
    while True:
        i = _STRING_RUN.match(text, i).end()
        if i >= len(text):
            return Extent(Reach.PARTIAL, len(text))
        c = text[i]
        if c == '"':
            return Extent(Reach.COMPLETE, i + 1)
        if c != "\\":
            return Extent(Reach.BROKEN, i)  # a control character
        m = _ESCAPE.match(text, i)
        if m is None:
            rest = text[i:i + 6]
            if len(text) - i < 6 and re.fullmatch(r'\\(?:u[0-9a-fA-F]{0,3})?', rest):
                return Extent(Reach.PARTIAL, len(text))  # an escape cut short by the end of the text
            return Extent(Reach.BROKEN, i)
        i = m.end()


Memo = dict[int, tuple[int, tuple[str, ...], str]]


def value_end(text: str, start: int, memo: Memo | None = None) -> Extent:
    """The extent of the JSON value that begins at text[start] (after whitespace). memo: where scans of this text
    stopped, by start (valid while the text only grows at its end, as a streamed output does): a value read
    again as its text grows resumes at the token it stopped in instead of reading it all again."""
    stack: list[str] = []  # "{" or "[" of the containers open
    # what the next token may be: "value", "key" (or "}"), "colon", "after" (a "," or the container's close),
    # "value_or_close" (just after "["), "key_or_close" (just after "{")
    want = "value"
    i = start
    if memo is not None and start in memo:
        i, opened, want = memo[start]
        stack = list(opened)
    n = len(text)
    while True:
        i = skip_ws(text, i)
        if i >= n:
            return Extent(Reach.PARTIAL, n)
        if memo is not None:
            memo[start] = (i, tuple(stack), want)  # (the state before this token: resumable however it ends)
        c = text[i]
        if want in ("key", "key_or_close"):
            if c == "}" and want == "key_or_close":
                stack.pop()
                i += 1
                want = "after"
            elif c == '"':
                e = string_end(text, i)
                if e.reach is not Reach.COMPLETE:
                    return e
                i, want = e.end, "colon"
            else:
                return Extent(Reach.BROKEN, i)
        elif want == "colon":
            if c != ":":
                return Extent(Reach.BROKEN, i)
            i, want = i + 1, "value"
        elif want in ("value", "value_or_close"):
            if c == "]" and want == "value_or_close":
                stack.pop()
                i += 1
                want = "after"
            elif c == "{":
                stack.append("{")
                i, want = i + 1, "key_or_close"
            elif c == "[":
                stack.append("[")
                i, want = i + 1, "value_or_close"
            elif c == '"':
                e = string_end(text, i)
                if e.reach is not Reach.COMPLETE:
                    return e
                i, want = e.end, "after"
            elif c == "-" or c.isdigit():
                m = _NUMBER.match(text, i)
                p = _NUMBER_PREFIX.match(text, i)
                if p.end() >= n:  # the number runs to the end of the text: it may go on
                    return Extent(Reach.PARTIAL, n)
                if m is None or m.end() != p.end():
                    return Extent(Reach.BROKEN, p.end() if m is None else max(m.end(), i))
                i, want = m.end(), "after"
            else:
                word = next((w for w in _LITERALS if text.startswith(w, i)), None)
                if word is not None:
                    i, want = i + len(word), "after"
                elif any(w.startswith(text[i:]) for w in _LITERALS):
                    return Extent(Reach.PARTIAL, n)
                else:
                    return Extent(Reach.BROKEN, i)
        else:  # "after"
            if c == ",":
                i, want = i + 1, "key" if stack[-1] == "{" else "value"
            elif c == ("}" if stack[-1] == "{" else "]"):
                stack.pop()
                i += 1
            else:
                return Extent(Reach.BROKEN, i)
        if want == "after" and not stack:
            return Extent(Reach.COMPLETE, i)
