"""The <think> ... </think> families (Qwen3, DeepSeek-R1, SmolLM3, QwQ): the reasoning is the text between
the tags, the answer what follows the end tag (its leading whitespace dropped: Qwen3 writes "</think>\\n\\n").
The start tag is either in the prompt (a template that opens the block, DeepSeek-R1's "<think>\\n") or the
first thing the model writes (leading whitespace allowed); an output that starts otherwise has no reasoning.
An output cut before the end tag is all reasoning (content None), as vLLM answers it.
"""
from __future__ import annotations

from typing import Sequence

from scheduler.reasoning.parser import Piece, ReasoningParser, ReasoningStream, Split, held_prefix

START, END = "<think>", "</think>"


def _last_tag(prompt_ids: Sequence[int], start: int, end: int) -> int | None:
    for token in reversed(prompt_ids):
        if token == start or token == end:
            return token
    return None


class ThinkTagParser(ReasoningParser):
    markers = (START, END)

    @property
    def _start(self) -> int:
        return self.ids[START][0]

    @property
    def _end(self) -> int:
        return self.ids[END][0]

    def opens_thinking(self, prompt_ids: Sequence[int]) -> bool:
        return _last_tag(prompt_ids, self._start, self._end) == self._start

    def prompt_ended_thinking(self, prompt_ids: Sequence[int]) -> bool:
        return _last_tag(prompt_ids, self._start, self._end) == self._end

    @property
    def answer_marker(self) -> tuple[int, ...]:
        return self.ids[END]

    def split(self, text: str, thinking: bool) -> Split:
        if not thinking:
            stripped = text.lstrip()
            if not stripped.startswith(START):
                return Split(None, text)
            text = stripped[len(START):]
        reasoning, found, answer = text.partition(END)
        if not found:
            return Split(reasoning, None)
        return Split(reasoning, answer.lstrip() or None)

    def stream(self, thinking: bool) -> ReasoningStream:
        return ThinkTagStream(thinking)


class ThinkTagStream(ReasoningStream):
    def __init__(self, thinking: bool) -> None:
        self.state = "thinking" if thinking else "before"  # before -> thinking -> answer, or before -> answer
        self.held = ""  # text not yet said: a possible tag's start, or the answer's leading whitespace
        self.started_answer = False  # (after the end tag) a non-whitespace character of the answer came

    def feed(self, text: str) -> Piece:
        out = Piece()
        self.held += text
        if self.state == "before":
            stripped = self.held.lstrip()
            if START.startswith(stripped):  # whitespace, or the start tag's beginning: wait
                return out
            if not stripped.startswith(START):
                self.state, rest, self.held = "answer", self.held, ""
                self.started_answer = True  # (no tag: the text is the content as it is)
                out.content = rest
                return out
            self.state, self.held = "thinking", stripped[len(START):]
        if self.state == "thinking":
            reasoning, found, answer = self.held.partition(END)
            if not found:
                keep = held_prefix(self.held, END)
                out.reasoning, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
                return out
            out.reasoning, self.state, self.held = reasoning, "answer", answer
        if not self.started_answer:
            answer = self.held.lstrip()
            if not answer:
                return out
            self.started_answer, self.held = True, answer
        out.content, self.held = out.content + self.held, ""
        return out

    def finish(self) -> Piece:
        held, self.held = self.held, ""
        if self.state == "before":
            return Piece(content=held)
        if self.state == "thinking":
            return Piece(reasoning=held)
        return Piece()  # (only the answer's leading whitespace can be held)


class Qwen3Parser(ThinkTagParser):
    """Qwen3: thinking when the model starts with <think> (or the template opened it); enable_thinking false
    writes "<think>\\n\\n</think>\\n\\n" into the prompt, so the output is all answer."""
    name = "qwen3"


class SmolLM3Parser(ThinkTagParser):
    """SmolLM3: as Qwen3 ("/no_think" in the system prompt, or enable_thinking false, closes the block in the
    prompt)."""
    name = "smollm3"


class DeepSeekR1Parser(ThinkTagParser):
    """DeepSeek-R1 (and QwQ): the output is reasoning until </think> even when neither the template nor the
    model wrote <think> (R1 often leaves it out), unless the prompt closed the block."""
    name = "deepseek_r1"

    def opens_thinking(self, prompt_ids: Sequence[int]) -> bool:
        return not self.prompt_ended_thinking(prompt_ids)
