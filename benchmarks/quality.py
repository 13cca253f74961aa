"""Quality of a low-precision weight mode against float32 on the same checkpoint (decode's quality part and
tests/executor/test_quantization_quality.py): leading greedy tokens that agree, teacher-forced argmax agreement
(a near-tie costs one position, not the rest) and the mean NLL of a fixed text, through the decode kernel."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from executor_service.executor import Executor
from executor_service.types import CacheRef, DecodeItem, OutputMode, OutputOptions

QUESTIONS = ("What is the capital of France?", "Write a haiku about the sea.",
             "Explain in two sentences why the sky is blue.", "List three prime numbers and add them up.")
FIXED_TEXT = (
    "The river rises in the hills to the north of the town and flows south through a broad valley of farms "
    "and orchards. In the spring, when the snow melts, it often floods the lower fields, and the farmers have "
    "built long earth banks to hold it back. A stone bridge with five arches crosses it near the market "
    "square; it was built in the fourteenth century and has been repaired many times since. Every summer the "
    "town holds a festival on the water, with boat races, music and a fair that lasts for three days.")
LOGITS = OutputOptions(OutputMode.LOGITS)


def chat_prompt(question: str) -> str:
    return ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")


def greedy_tokens(ex: Executor, prompt: Sequence[int], steps: int) -> list[int]:
    """Greedy continuation of `prompt`, one decode call per token."""
    res = ex.prefill(list(prompt))
    cache_id, tokens = res.cache.cache_id, [res.output.tokens[0].token_id]
    for _ in range(steps - 1):
        (d,) = ex.decode([DecodeItem(CacheRef(cache_id, len(prompt) + len(tokens) - 1), tokens[-1])])
        tokens.append(d.output.tokens[-1].token_id)
    ex.release_cache([cache_id])
    return tokens


def teacher_forced_logits(ex: Executor, prompt: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
    """Logits [len(tokens), vocab] before each of `tokens` when exactly these follow `prompt`."""
    first = ex.prefill(list(prompt), output=LOGITS)
    cache_id, out = first.cache.cache_id, [first.output.logits]
    for i, token in enumerate(tokens[:-1]):
        (d,) = ex.decode([DecodeItem(CacheRef(cache_id, len(prompt) + i), token, output=LOGITS)])
        out.append(d.output.logits)
    ex.release_cache([cache_id])
    return torch.cat(out).float()


def mean_nll(ex: Executor, ids: Sequence[int]) -> float:
    """Mean negative log-likelihood (nats per token) of ids[1:] given what precedes each, teacher-forced."""
    logp = torch.log_softmax(teacher_forced_logits(ex, ids[:1], ids[1:]), dim=-1)  # [len(ids) - 1, vocab]
    targets = torch.tensor(ids[1:], dtype=torch.int64)
    return float(-logp[torch.arange(len(targets)), targets].mean())


def top1_matches(ex: Executor, prompt: Sequence[int], tokens: Sequence[int]) -> int:
    """Positions where the executor's argmax after prompt + tokens[:i] is tokens[i] (teacher-forced)."""
    predicted = teacher_forced_logits(ex, prompt, tokens).argmax(dim=-1).tolist()
    return sum(p == t for p, t in zip(predicted, tokens))


def leading_agreement(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@dataclass
class Quality:
    agreement: list[int]  # per parity prompt: leading greedy tokens equal to float32's
    top1: list[int]  # per parity prompt: teacher-forced argmax equal to float32's token
    steps: int  # greedy tokens per prompt
    nll: float  # mean NLL of FIXED_TEXT
    nll_float32: float

    @property
    def nll_delta(self) -> float:
        return self.nll - self.nll_float32

    def as_json(self) -> dict:
        return {"agreement": self.agreement, "top1": self.top1, "top1_matches": sum(self.top1),
                "steps": self.steps, "agreed_tokens": sum(self.agreement),
                "total_tokens": self.steps * len(self.agreement), "nll": self.nll, "nll_float32": self.nll_float32,
                "nll_delta": self.nll_delta}


class QualityReference:
    """float32's greedy tokens and NLL, computed once, to compare every other mode with."""

    def __init__(self, ex: Executor, encode, steps: int = 32) -> None:  # encode: text -> ids, no special tokens
        self.steps = steps
        self.prompts = [encode(chat_prompt(q)) for q in QUESTIONS]
        self.text = encode(FIXED_TEXT)[:ex.model_config.max_position_embeddings - 1]  # a tiny test model's is short
        self.tokens = [greedy_tokens(ex, p, steps) for p in self.prompts]
        self.nll = mean_nll(ex, self.text)

    def measure(self, ex: Executor, free_running: bool = True) -> Quality:
        """free_running False: no greedy runs (agreement -1 per prompt), for the teacher-forced figures alone."""
        agreement = [leading_agreement(greedy_tokens(ex, p, self.steps), ref) if free_running else -1
                     for p, ref in zip(self.prompts, self.tokens)]
        top1 = [top1_matches(ex, p, ref) for p, ref in zip(self.prompts, self.tokens)]
        return Quality(agreement, top1, self.steps, mean_nll(ex, self.text), self.nll)
