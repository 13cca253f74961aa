"""Workloads: random prompts (fixed seed) from a model's regular vocabulary, grouping them under a per-call
token budget, and the KV blocks a workload needs."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import numpy as np
import torch

from models.kv.paged_cache import DEFAULT_BLOCK_SIZE
from tandem.ceil_div import ceil_div

T = TypeVar("T")
KV_SLACK_BLOCKS = 16  # on top of what the workload's caches hold


def kv_blocks(sequences: int, tokens: int) -> int:
    """KV pool blocks for `sequences` caches of up to `tokens` tokens each, plus some slack."""
    return sequences * ceil_div(tokens, DEFAULT_BLOCK_SIZE) + KV_SLACK_BLOCKS


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """[batch, length] token ids drawn uniformly from [3, vocab) (skipping the usual pad/bos/eos ids)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(min(3, vocab - 1), vocab, (batch, length), generator=gen)


def token_budget_groups(items: Sequence[T], limit: int, size: Callable[[T], int] = len) -> list[list[T]]:
    """Consecutive groups of at most `limit` tokens together (a larger item alone): one per executor call."""
    groups: list[list[T]] = []
    cur: list[T] = []
    total = 0
    for item in items:
        if cur and total + size(item) > limit:
            groups.append(cur)
            cur, total = [], 0
        cur.append(item)
        total += size(item)
    groups.append(cur)
    return groups


def model_vocabulary(model_dir: Path, cfg: Any) -> np.ndarray:
    """Token ids a random prompt may use: below both the model's and the tokenizer's vocabulary size (a tiny
    checkpoint's embedding table is padded past its tokenizer), minus the tokenizer's added tokens and the
    bos / eos / pad ids (config.json, generation_config.json), so that the ids survive a detokenize round trip."""
    from models.config import read_generation_defaults
    gen = read_generation_defaults(model_dir, cfg)
    raw = json.loads((model_dir / "config.json").read_text())
    banned = {int(i) for i in (cfg.bos_token_id, gen.bos_token_id, raw.get("pad_token_id"), *cfg.eos_token_ids,
                               *gen.eos_token_ids) if i is not None}
    limit = cfg.vocab_size
    tok_file = model_dir / "tokenizer.json"
    if tok_file.is_file():
        data = json.loads(tok_file.read_text(encoding="utf-8"))
        vocab = (data.get("model") or {}).get("vocab") or {}
        added = {int(t["id"]) for t in data.get("added_tokens", [])}
        ids = list(vocab.values() if isinstance(vocab, dict) else range(len(vocab))) + list(added)
        limit = min(limit, max(ids, default=limit - 1) + 1)
        banned |= added
    else:  # no tokenizer to read: skip the low ids, where most vocabularies keep their special tokens
        banned |= set(range(min(32, limit // 4)))
    allowed = np.array([i for i in range(limit) if i not in banned], dtype=np.int64)
    if allowed.size == 0:
        raise SystemExit("error: no regular token ids to draw prompts from")
    return allowed


def vocabulary_prompts(n: int, length: int, allowed: np.ndarray, seed: int, stream: int) -> list[list[int]]:
    """n prompts of `length` ids drawn uniformly from `allowed`; `stream` separates independent prompt sets
    (timed, warm-up, ...) so that changing one size leaves the others' ids alone."""
    return np.random.default_rng([seed, stream]).choice(allowed, size=(n, length)).tolist()
