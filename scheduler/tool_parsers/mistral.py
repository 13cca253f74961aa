"""Mistral's calls, after the special token [TOOL_CALLS] (kept in the text for this parser), in either of the two
forms its tokenizer versions write:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]   (v3: 7B v0.3, Nemo,
                                                                                           Small 3 / 3.1)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}  (v11+: Small 3.2,
                                                                                           Magistral, Devstral)

Text before [TOOL_CALLS] is content. Call ids are 9 letters and digits: Mistral's chat templates refuse any
other id when the call comes back in the next turn's messages.
"""
from __future__ import annotations

import random
import re
import string

from scheduler.tool_parsers.json_prefix import Memo, Reach, skip_ws, value_end
from scheduler.tool_parsers.syntax import Call, Piece, Syntax, Text, held_suffix, read_call_object

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"[A-Za-z0-9_-]*")
_ID = re.compile(r"[A-Za-z0-9]*")
_ALNUM = string.ascii_letters + string.digits


class Mistral(Syntax):
    name = "mistral"
    markers = (TOOL_CALLS, ARGS, CALL_ID)

    def call_id(self) -> str:
        return "".join(random.choices(_ALNUM, k=9))

    def scan(self, text: str, final: bool, tools: frozenset[str], memo: Memo | None = None) -> list[Piece]:
        at = text.find(TOOL_CALLS)
        if at < 0:
            end = len(text) if final else len(text) - held_suffix(text, (TOOL_CALLS,))
            return [Text(text[:end])] if end else []
        pieces: list[Piece] = [Text(text[:at])] if at else []
        i = skip_ws(text, at + len(TOOL_CALLS))
        if i >= len(text):
            return pieces + ([Text(text[at:])] if final else [])
        if text[i] == "[":
            return pieces + _array(text, at, i + 1, tools, final, memo)
        return pieces + _named(text, at, tools, final, memo)


def _array(text: str, at: int, i: int, tools: frozenset[str], final: bool, memo: Memo | None) -> list[Piece]:
    """[{call}, {call}, ...] from text[i] (just past the "[")."""
    pieces: list[Piece] = []
    while True:
        obj = read_call_object(text, i, tools, final, memo)
        if obj.state == "undecided":
            return pieces
        if obj.state == "text":  # not a call: from [TOOL_CALLS] on (or after the calls before it) it is text
            return pieces + [Text(text[i:] if pieces else text[at:])]
        if obj.state == "call":
            return pieces + [Call(obj.name, obj.arguments)]
        if obj.state == "broken":
            return pieces + [Call(obj.name, obj.arguments, broken=text[at:], tail=text[obj.args_end:])]
        j = skip_ws(text, obj.end)
        if j >= len(text):
            return pieces + [Call(obj.name, obj.arguments, done=final)]  # (final: "]" left out, taken as given)
        if text[j] == ",":
            pieces.append(Call(obj.name, obj.arguments, done=True))
            i = j + 1
            continue
        if text[j] == "]":
            rest = text[j + 1:]
            return pieces + [Call(obj.name, obj.arguments, done=True)] + ([Text(rest)] if rest else [])
        return pieces + [Call(obj.name, obj.arguments, broken=text[at:], tail=text[obj.args_end:])]


def _named(text: str, at: int, tools: frozenset[str], final: bool, memo: Memo | None) -> list[Piece]:
    """name[ARGS]{...}, repeated after [TOOL_CALLS], from text[at] (the first [TOOL_CALLS])."""
    pieces: list[Piece] = []
    i = at
    while True:
        start = i
        i = skip_ws(text, i + len(TOOL_CALLS))
        name_end = _NAME.match(text, i).end()
        name = text[i:name_end]
        j = name_end
        if text.startswith(CALL_ID, j):
            j = _ID.match(text, j + len(CALL_ID)).end()
        rest = text[j:]
        if not final and j == len(text) or (not final and (ARGS.startswith(rest) or CALL_ID.startswith(rest))):
            return pieces  # the name (or the markers after it) may go on
        if text.startswith(ARGS, j):
            j += len(ARGS)
        a = skip_ws(text, j)
        if name not in tools or (a < len(text) and text[a] != "{"):
            return pieces + [Text(text[start:])]
        if a >= len(text):
            return pieces + ([Text(text[start:])] if final else [])
        e = value_end(text, a, memo)
        if e.reach is Reach.PARTIAL:
            if final:
                return pieces + [Call(name, text[a:e.end], broken=text[start:], tail="")]
            return pieces + [Call(name, text[a:e.end])]
        if e.reach is Reach.BROKEN:
            return pieces + [Call(name, text[a:e.end], broken=text[start:], tail=text[e.end:])]
        pieces.append(Call(name, text[a:e.end], done=True))
        k = skip_ws(text, e.end)
        if text.startswith(TOOL_CALLS, k):
            i = k
            continue
        if k < len(text) and not (not final and TOOL_CALLS.startswith(text[k:])):
            pieces.append(Text(text[e.end:]))
        elif final and e.end < len(text):
            pieces.append(Text(text[e.end:]))
        return pieces
