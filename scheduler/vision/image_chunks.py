"""Where a prefill chunk may end around images whose tokens attend to each other both ways (Gemma 3:
PromptImage.one_chunk). A later chunk cannot change the KV an earlier one wrote, so such a span is written in one
chunk: a chunk that would end inside it ends before it instead, or, when it starts at (or inside: a reused prefix)
the span, runs to the span's end even past the prefill chunk size, within the step's token budget. The executor
refuses a chunk that ends inside such a span (executor_service/vision/image_checks.py)."""
from __future__ import annotations

from typing import Sequence

from scheduler.vision.chat_images import PromptImage


def chunk_tokens(images: Sequence[PromptImage], start: int, n: int, most: int) -> int:
    """Tokens of a chunk from position `start`: `n` as the planner cut it (chunk size, budget, blocks), moved so
    that it ends outside every one-chunk span; `most`: the most it may take (the budget, the blocks, the prompt).
    0: the span at `start` needs more than `most` this step."""
    end = start + n
    for im in images:
        lo, hi = im.offset, im.offset + im.length
        if im.one_chunk and lo < end < hi:
            end = lo if lo > start else hi  # before the span, else through it
    return end - start if end - start <= most else 0


def longest_span(images: Sequence[PromptImage]) -> int:
    """Tokens of the longest span that must be written in one chunk (0: none)."""
    return max((im.length for im in images if im.one_chunk), default=0)
