"""Hermes-style calls, as Qwen2.5, Qwen3, Hermes 2 Pro / 3 and SmolLM3 write them (their chat templates ask for
"a json object with function name and arguments within <tool_call></tool_call> XML tags"):

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"tz": "CET"}}
    </tool_call>

Text before, between and after the calls is the message's content. A call the output ends in without its closing
tag counts when its object is complete (vLLM's hermes parser takes it too). A <tool_call> whose text is not such
an object (or names no tool) is left in the content as written.
"""
from __future__ import annotations

from scheduler.tool_parsers.json_prefix import Memo, skip_ws
from scheduler.tool_parsers.syntax import Call, Piece, Syntax, Text, held_suffix, read_call_object

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class Hermes(Syntax):
    name = "hermes"
    markers = (OPEN, CLOSE)

    def scan(self, text: str, final: bool, tools: frozenset[str], memo: Memo | None = None) -> list[Piece]:
        pieces: list[Piece] = []
        i = 0
        while True:
            at = text.find(OPEN, i)
            if at < 0:
                end = len(text) if final else len(text) - held_suffix(text[i:], (OPEN,))
                if end > i:
                    pieces.append(Text(text[i:end]))
                return pieces
            if at > i:
                pieces.append(Text(text[i:at]))
            body = at + len(OPEN)
            obj = read_call_object(text, body, tools, final, memo)
            if obj.state == "undecided":
                return pieces
            if obj.state == "text":  # not a call: the tag stays in the text as written
                pieces.append(Text(OPEN))
                i = body
                continue
            if obj.state == "call":
                pieces.append(Call(obj.name, obj.arguments))
                return pieces
            if obj.state == "done":
                j = skip_ws(text, obj.end)
                if text.startswith(CLOSE, j) or (final and j == len(text)):
                    pieces.append(Call(obj.name, obj.arguments, done=True))
                    i = min(j + len(CLOSE), len(text))
                    continue
                if not final and CLOSE.startswith(text[j:]):  # its closing tag may still come
                    pieces.append(Call(obj.name, obj.arguments))
                    return pieces
            close = text.find(CLOSE, obj.end)  # broken: its text runs to its closing tag
            if close < 0 and not final:
                pieces.append(Call(obj.name, obj.arguments, broken=text[at:], tail=text[obj.args_end:]))
                return pieces
            stop = len(text) if close < 0 else close + len(CLOSE)
            pieces.append(Call(obj.name, obj.arguments, broken=text[at:stop], tail=text[obj.args_end:stop]))
            i = stop
