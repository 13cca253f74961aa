"""The prefix-caching benchmark's workloads, as token ids (so every shared prefix is the same ids in every
request, whatever the tokenizer would do at a text boundary), and the KV pool they need.

- system-prompt: one system prompt + each of --questions distinct questions;
- multi-turn: --conversations conversations of --turns turns; turn t re-sends the whole conversation so far:
  the system prompt, then for every earlier turn its user message and the answer streamed back (its exact
  token ids), then the new user message. A turn's prompt is thus a true token prefix of the next one's.

Ids are drawn uniformly (numpy, fixed seed) from the model's regular vocabulary (benchmarks/workloads.py:
no added or special tokens), one numpy stream per role so that changing one size leaves the others' ids alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from benchmarks.workloads import KV_SLACK_BLOCKS, vocabulary_prompts
from tandem.ceil_div import ceil_div

WORKLOADS = ("system-prompt", "multi-turn")
# numpy streams of vocabulary_prompts (bench_serving uses 0-2)
SYSTEM_STREAM, QUESTION_STREAM, USER_STREAM, WARMUP_STREAM = 10, 11, 12, 13


@dataclass(frozen=True)
class Shape:
    """The sizes of both workloads (the CLI's flags)."""
    system_tokens: int  # the shared system prompt every prompt starts with
    questions: int  # system-prompt: requests
    question_tokens: int  # a question / a user message
    conversations: int  # multi-turn
    turns: int  # per conversation
    output_len: int  # every request generates exactly this many tokens

    def longest_prompt(self, workload: str) -> int:
        if workload == "system-prompt":
            return self.system_tokens + self.question_tokens
        return self.turn_prompt_len(self.turns)

    def turn_prompt_len(self, turn: int) -> int:
        """Prompt tokens of a conversation's turn `turn` (1-based): the system prompt, `turn` user messages and
        the turn - 1 answers before it."""
        return self.system_tokens + turn * self.question_tokens + (turn - 1) * self.output_len

    def prompt_tokens_sent(self, workload: str) -> int:
        """All prompt tokens the workload sends (when every request succeeds)."""
        if workload == "system-prompt":
            return self.questions * (self.system_tokens + self.question_tokens)
        return self.conversations * sum(self.turn_prompt_len(t) for t in range(1, self.turns + 1))

    def requests(self, workload: str) -> int:
        return self.questions if workload == "system-prompt" else self.conversations * self.turns


@dataclass(frozen=True)
class Prompts:
    """The ids of both workloads. A multi-turn prompt is built while the conversation runs (turn_prompt)."""
    system: list[int]
    questions: list[list[int]]  # system-prompt: the prompt i is system + questions[i]
    users: list[list[list[int]]]  # multi-turn: [conversation][turn] -> the user message
    warmup: list[list[int]]  # untimed requests before each timed run, sharing no prefix with it


def make_prompts(shape: Shape, allowed: np.ndarray, seed: int, warmup: int) -> Prompts:
    system = vocabulary_prompts(1, shape.system_tokens, allowed, seed, SYSTEM_STREAM)[0]
    questions = vocabulary_prompts(shape.questions, shape.question_tokens, allowed, seed, QUESTION_STREAM)
    flat = vocabulary_prompts(shape.conversations * shape.turns, shape.question_tokens, allowed, seed, USER_STREAM)
    users = [flat[c * shape.turns:(c + 1) * shape.turns] for c in range(shape.conversations)]
    # as long as a system-prompt request, so that the warm-up runs the same kernels' shapes
    warm = vocabulary_prompts(warmup, shape.system_tokens + shape.question_tokens, allowed, seed, WARMUP_STREAM)
    return Prompts(system, questions, users, warm)


def question_prompts(prompts: Prompts) -> list[list[int]]:
    """system-prompt: the full prompt of every question."""
    return [prompts.system + q for q in prompts.questions]


def turn_prompt(history: list[int], user: list[int]) -> list[int]:
    """A turn's prompt: the conversation so far (the previous turn's prompt + its answer ids) + the new user
    message."""
    return history + user


def kv_pool_blocks(shape: Shape, workload: str, concurrency: int, block_size: int) -> int:
    """KV blocks for the executor: room for every request in flight AND for every distinct block the workload
    writes, so that the cache never has to evict for lack of room (the benchmark measures reuse; a smaller
    --kv-blocks measures reuse under eviction). The same pool for both modes."""
    per_request = ceil_div(shape.longest_prompt(workload) + shape.output_len, block_size)
    if workload == "system-prompt":
        distinct = ceil_div(shape.system_tokens, block_size) + shape.questions * (
            ceil_div(shape.question_tokens + shape.output_len, block_size) + 1)
    else:  # each conversation's last turn holds all its earlier ones
        distinct = shape.conversations * per_request
    return distinct + concurrency * per_request + KV_SLACK_BLOCKS
