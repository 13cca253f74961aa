"""Llama 3.1 / 3.2 / 3.3 JSON calls. Their chat templates ask for "a JSON for a function call with its proper
arguments that best answers the given prompt ... in the format {"name": function name, "parameters": dictionary of
argument name and its value}", and the model answers with the call alone, maybe after <|python_tag|> (a special
token, dropped from the text unless special tokens are kept):

    {"name": "get_weather", "parameters": {"city": "Paris"}}

Several calls are separated by ";" (as vLLM's llama3_json parser reads them). "arguments" is taken for
"parameters", and a "type": "function" key (Llama 3.2 writes one) is allowed. Calls count only at the start of the
output: an answer that starts otherwise, or whose JSON is not a call of a tool, is content as written; text after
the calls is content.
"""
from __future__ import annotations

from scheduler.tool_parsers.json_prefix import Memo, skip_ws
from scheduler.tool_parsers.syntax import Call, Piece, Syntax, Text, read_call_object

PYTHON_TAG = "<|python_tag|>"


class Llama3Json(Syntax):
    name = "llama3_json"
    markers = (PYTHON_TAG,)

    def scan(self, text: str, final: bool, tools: frozenset[str], memo: Memo | None = None) -> list[Piece]:
        i = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[i:]) and i < len(text):
            return []  # (the tag itself may be coming)
        if i >= len(text):
            return [Text(text)] if final and text else []
        pieces: list[Piece] = []
        start = 0  # where the text not yet given to a piece begins
        while True:
            obj = read_call_object(text, i, tools, final, memo)
            if obj.state == "undecided":
                return pieces
            if obj.state == "text":
                return pieces + [Text(text[start:])]
            if obj.state == "call":
                return pieces + [Call(obj.name, obj.arguments)]
            if obj.state == "broken":
                return pieces + [Call(obj.name, obj.arguments, broken=text[start:], tail=text[obj.args_end:])]
            pieces.append(Call(obj.name, obj.arguments, done=True))
            start = obj.end
            j = skip_ws(text, obj.end)
            if j < len(text) and text[j] == ";":
                j = skip_ws(text, j + 1)
            if j >= len(text):
                if final and start < len(text):
                    pieces.append(Text(text[start:]))
                return pieces
            if text[j] != "{":
                pieces.append(Text(text[start:]))
                return pieces
            i = j
