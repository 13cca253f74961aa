"""GPT-OSS (OpenAI's harmony format): the output is messages on channels,
`<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>`. The
analysis channel is the reasoning, the final channel the answer; any other channel's text (commentary: tool
calls and their preambles) goes to the content as written, for a tool-call parser to read. The markers are
special tokens, so the output is detokenized with them (keep_special_tokens) and they are taken out here. An
output without any channel is all content.
"""
from __future__ import annotations

import re
from typing import Sequence

from scheduler.reasoning.parser import Encode, Piece, ReasoningParser, ReasoningStream, Split

_MARKER = re.compile(r"<\|[a-z_]+\|>")
_PARTIAL = re.compile(r"<(\|[a-z_]*\|?)?")  # the start of a marker, held back until it is whole
_BODY_ENDS = {"<|end|>", "<|return|>", "<|call|>", "<|start|>"}
ANSWER = "<|channel|>final<|message|>"


class HarmonyStream(ReasoningStream):
    def __init__(self) -> None:
        self.mode = "outside"  # outside a message, "header" (channel name ...), or "body"
        self.header = ""
        self.channel = ""
        self.saw_channel = False
        self.held = ""

    def _text(self, text: str, out: Piece) -> None:
        if self.mode == "header":
            self.header += text
        elif self.mode == "body":
            if self.channel == "analysis":
                out.reasoning += text
            else:
                out.content += text
        elif not self.saw_channel:  # no harmony at all (yet): plain content
            out.content += text

    def _marker(self, marker: str, out: Piece) -> None:
        if marker == "<|channel|>":
            self.mode, self.header, self.saw_channel = "header", "", True
        elif marker == "<|message|>" and self.mode == "header":
            self.mode, self.channel = "body", (self.header.split() or [""])[0]
        elif marker in _BODY_ENDS:
            self.mode = "outside"
        elif self.mode == "body":  # (another special token inside a body: <|constrain|> ...): as text
            self._text(marker, out)

    def feed(self, text: str) -> Piece:
        out = Piece()
        self.held += text
        pos = 0
        for m in _MARKER.finditer(self.held):
            self._text(self.held[pos:m.start()], out)
            self._marker(m.group(), out)
            pos = m.end()
        rest = self.held[pos:]
        cut = rest.rfind("<")
        if cut >= 0 and _PARTIAL.fullmatch(rest[cut:]):
            self._text(rest[:cut], out)
            self.held = rest[cut:]
        else:
            self._text(rest, out)
            self.held = ""
        return out

    def finish(self) -> Piece:
        out = Piece()
        held, self.held = self.held, ""
        self._text(held, out)
        return out


class GptOssParser(ReasoningParser):
    name = "gpt_oss"
    markers = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>")
    keep_special_tokens = True

    def __init__(self, encode: Encode) -> None:
        super().__init__(encode)
        self._answer = tuple(encode(ANSWER))

    def opens_thinking(self, prompt_ids: Sequence[int]) -> bool:
        return False  # (the channels say it, not the prompt)

    def prompt_ended_thinking(self, prompt_ids: Sequence[int]) -> bool:
        return False

    @property
    def answer_marker(self) -> tuple[int, ...]:
        return self._answer

    def split(self, text: str, thinking: bool) -> Split:
        stream = HarmonyStream()
        first, last = stream.feed(text), stream.finish()
        reasoning, content = first.reasoning + last.reasoning, first.content + last.content
        return Split(reasoning if stream.saw_channel and reasoning else None,
                     content if content or not stream.saw_channel else None)

    def stream(self, thinking: bool) -> ReasoningStream:
        return HarmonyStream()
