"""GPT-OSS's harmony format (vLLM's parser name: openai). The chat template's generation prompt ends with
<|start|>assistant; the model writes messages, each a header, <|message|>, a body and an end token:

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Rome"}<|call|>

A message to `functions.NAME` (the recipient, in the header before or after the channel) calls the tool NAME with
the body as its arguments. The final channel's body is the answer (content), as is a commentary message to no one
(a preamble the user may see). The analysis channel is the model's chain of thought: never content (issue 45's
reasoning parser returns it as reasoning). Every marker is a special token: kept in the text for this parser.
"""
from __future__ import annotations

import re

from scheduler.tool_parsers.json_prefix import Memo, Reach, skip_ws, value_end
from scheduler.tool_parsers.syntax import Call, Piece, Syntax, Text, held_suffix

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_HEADS = (START, CHANNEL, CONSTRAIN, " to=")  # how a message's header may begin
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"(\w+)")


def _body_end(text: str, i: int) -> tuple[int, int]:
    """(where the body from text[i] ends, where the next message begins); (-1, -1) while no end token came."""
    found = [(at, at + len(e)) for e in ENDS if (at := text.find(e, i)) >= 0]
    start = text.find(START, i)
    if start >= 0:
        found.append((start, start))
    return min(found) if found else (-1, -1)


class OpenAIHarmony(Syntax):
    name = "openai"
    markers = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)

    def scan(self, text: str, final: bool, tools: frozenset[str], memo: Memo | None = None) -> list[Piece]:
        pieces: list[Piece] = []
        i = 0
        while i < len(text):
            if not text.startswith(_HEADS, i):
                if not final and any(h.startswith(text[i:]) for h in _HEADS):
                    return pieces  # a header may be beginning
                stop = text.find(START, i)  # text outside any message (the model did not follow the format)
                stop = len(text) if stop < 0 else stop
                end = stop if final or stop < len(text) else stop - held_suffix(text[i:], (START,))
                if end > i:
                    pieces.append(Text(text[i:end]))
                if stop == len(text):
                    return pieces
                i = stop
                continue
            head_end = text.find(MESSAGE, i)
            if head_end < 0:
                return pieces + ([Text(text[i:])] if final else [])  # (final: a header that never finished)
            header = text[i:head_end]
            body = head_end + len(MESSAGE)
            end, after = _body_end(text, body)
            recipient = _RECIPIENT.search(header)
            channel = _CHANNEL.search(header)
            name = recipient.group(1).removeprefix("functions.") if recipient else None
            if recipient and recipient.group(1).startswith("functions.") and name in tools:
                piece, done = _call(text, i, body, end, name, final, memo)
                pieces.append(piece)
                if not done:
                    return pieces
            elif channel is None or channel.group(1) != "analysis":  # the answer, or a preamble
                stop = end if end >= 0 else len(text)
                if end < 0 and not final:
                    stop -= held_suffix(text[body:], (*ENDS, START))
                if stop > body:
                    pieces.append(Text(text[body:stop]))
            if end < 0:
                return pieces
            i = after  # (a <|start|> there begins the next header)
        return pieces


def _call(text: str, start: int, body: int, end: int, name: str, final: bool,
          memo: Memo | None) -> tuple[Call, bool]:
    """The call a message's body makes, and whether the message is over (complete or broken at its end)."""
    stop = end if end >= 0 else len(text)
    a = skip_ws(text, body)
    if a >= stop:
        if end >= 0 or final:  # no arguments at all
            return Call(name, "{}", done=True), True
        return Call(name, ""), False
    e = value_end(text[:stop], a, memo)
    args = text[a:e.end]
    if text[a] != "{" or e.reach is Reach.BROKEN:
        return Call(name, "" if text[a] != "{" else args, broken=text[start:stop], tail=text[e.end:stop]
                    if text[a] == "{" else text[a:stop]), end >= 0 or final
    if e.reach is Reach.PARTIAL:
        if end >= 0 or final:
            return Call(name, args, broken=text[start:stop], tail=""), True
        return Call(name, args), False
    k = skip_ws(text, e.end)
    if k < stop and end < 0 and not final and any(t.startswith(text[k:]) for t in (*ENDS, START)):
        return Call(name, args), False  # its end token is coming
    if k < stop:  # something after the arguments
        return Call(name, args, broken=text[start:stop], tail=text[e.end:stop]), end >= 0 or final
    return Call(name, args, done=end >= 0 or final), end >= 0 or final
