"""Reasoning on the HTTP front: the server's parser (chosen once at startup, scheduler/reasoning/registry.py)
applied to one request's choices. From each prompt it learns whether the output starts inside the thinking
(a template that opens the block) and whether the prompt already closed it (enable_thinking false); a request
with a constraint (response_format, guided_*, a tool choice that calls) gets it on the answer only: the
constraint waits for the parser's answer marker (</think>) in the output, unless the prompt closed the
thinking (scheduler/structured/constraint.py). Then the renderers split each choice's text, whole or streamed.

include_reasoning (vLLM's extension, default true): false leaves the reasoning out of the response (the model
still thinks; its answer is the content).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from scheduler.reasoning.parser import Piece, ReasoningParser, ReasoningStream, Split
from scheduler.request import GenerateRequest


@dataclass
class ChoiceReasoning:
    """The split of every choice of one request: thinking[i] = choice i's output starts inside the thinking."""
    parser: ReasoningParser
    thinking: list[bool]
    include: bool = True
    streams: list[ReasoningStream] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.streams = [self.parser.stream(t) for t in self.thinking]

    def whole(self, index: int, text: str) -> Split:
        split = self.parser.split(text, self.thinking[index])
        return split if self.include else Split(None, split.content)

    def delta(self, index: int, text: str, finished: bool) -> Piece:
        """What this much more of choice index's text adds (finished: the last delta, held text flushed)."""
        stream = self.streams[index]
        piece = stream.feed(text)
        if finished:
            tail = stream.finish()
            piece = Piece(piece.reasoning + tail.reasoning, piece.content + tail.content)
        return piece if self.include else Piece(content=piece.content)


def prepare(parser: ReasoningParser | None, requests: list[GenerateRequest],
            include: bool = True) -> tuple[list[GenerateRequest], ChoiceReasoning | None]:
    """The requests with their constraints moved onto the answer, and the split of their outputs (None: no
    parser, the outputs are content as they are)."""
    if parser is None:
        return requests, None
    out = []
    for r in requests:
        if r.constraint is not None and not parser.prompt_ended_thinking(r.prompt_ids):
            r = dataclasses.replace(r, constraint_after=parser.answer_marker)
        out.append(r)
    return out, ChoiceReasoning(parser, [parser.opens_thinking(r.prompt_ids) for r in out], include)
