"""What every reasoning parser is: given how the output starts (inside a think block or not), it splits the
output text into reasoning and content, whole (split) or as it streams (stream(): a ReasoningStream fed the
text deltas). A marker split across deltas is held back until it is whole, so streamed and whole agree.

The parser also tells structured output where the answer begins (answer_marker: the token ids after which
the answer's constraint starts, scheduler/structured/constraint.py), and from the prompt whether the
template already closed the thinking (enable_thinking false writes an empty <think></think> into the prompt):
then the constraint starts with the first token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence

Encode = Callable[[str], Sequence[int]]  # text -> its token ids, no special tokens added


@dataclass(frozen=True)
class Split:
    """A whole output split: reasoning None = the model did not think; content None = no answer (yet)."""
    reasoning: str | None
    content: str | None


@dataclass
class Piece:
    """What one stream delta adds: reasoning text and content text ("" = none)."""
    reasoning: str = ""
    content: str = ""


class ReasoningStream:
    """One output's split as it streams: feed(delta) per text delta, finish() once at the end."""

    def feed(self, text: str) -> Piece:
        raise NotImplementedError

    def finish(self) -> Piece:
        """What was held back (a possible marker's start that never completed)."""
        raise NotImplementedError


class ReasoningParser:
    """A family's parser, built by the registry for one tokenizer (encode), whose vocabulary has every marker
    as one token."""

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]]  # texts that must be tokens of the vocabulary (checked by the registry)
    keep_special_tokens: ClassVar[bool] = False  # the markers are special tokens: detokenize them

    def __init__(self, encode: Encode) -> None:
        self.ids = {m: tuple(encode(m)) for m in self.markers}

    def opens_thinking(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the output starts inside the thinking (the prompt opened a think block)."""
        raise NotImplementedError

    def prompt_ended_thinking(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the prompt already closed the thinking: the answer's constraint starts at once."""
        raise NotImplementedError

    @property
    def answer_marker(self) -> tuple[int, ...]:
        """The token ids after which the answer begins (where the answer's constraint starts)."""
        raise NotImplementedError

    def split(self, text: str, thinking: bool) -> Split:
        raise NotImplementedError

    def stream(self, thinking: bool) -> ReasoningStream:
        raise NotImplementedError


def held_prefix(text: str, marker: str) -> int:
    """Characters at the end of text that could begin marker (a proper prefix of it): held back until the
    next delta says whether the marker follows."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
