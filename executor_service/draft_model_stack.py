"""Loads the draft model of --draft-model beside the served model: its own model stack (model_stack.py, with its
own KV pool of --draft-kv-blocks blocks and its own decode step: native on a CPU, CUDA graphs on a GPU), after
checking that it speaks the served model's vocabulary. Everything refused here is refused at start, with the
reason (the CLI exits 2 with the message).

Same vocabulary means: the same vocab_size, and when both are checkpoint directories with a tokenizer.json, the
same token -> id map (a draft whose ids mean other tokens would have every guess rejected, silently). A GGUF
file's tokenizer is not compared (its vocab_size is), and the log says so.

Memory: the draft model and its pool are allocated after the served model's pool, out of what that pool leaves
(on CUDA its default takes 0.85 of the free memory: plenty for a small draft model; --kv-memory-fraction leaves
more).
"""
from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

from executor_service.config import ExecutorConfig
from executor_service.model_stack import ModelStack, build_model_stack
from executor_service.step.draft_model import DraftModel

log = logging.getLogger("tandem.executor")

DRAFT_POOL_SHARE = 4  # default draft pool: 1 / this of the served pool's blocks (at least MIN_DRAFT_BLOCKS)
MIN_DRAFT_BLOCKS = 16


def draft_pool_blocks(config: ExecutorConfig, target_blocks: int) -> int:
    if config.draft_kv_blocks is not None:
        if config.draft_kv_blocks < 1:
            raise ValueError(f"--draft-kv-blocks must be positive, got {config.draft_kv_blocks}")
        return config.draft_kv_blocks
    return max(MIN_DRAFT_BLOCKS, target_blocks // DRAFT_POOL_SHARE)


def load_draft_model(config: ExecutorConfig, target: ModelStack) -> DraftModel | None:
    """The draft model of config.draft_model (None without one). Raises ValueError naming what is wrong."""
    path = config.draft_model
    if path is None:
        return None
    name = path.name
    if config.tensor_parallel_size > 1:
        raise ValueError("--draft-model does not combine with --tensor-parallel-size > 1 yet")
    if not path.exists():
        raise ValueError(f"--draft-model {name}: no such checkpoint directory or GGUF file")
    blocks = draft_pool_blocks(config, target.kv_pool.blocks)
    draft_cfg = replace(config, model_dir=path, kv_blocks=blocks, kv_memory_fraction=None, adapters=(),
                        adapter_root=None, deterministic=False, compile=False, progress=False, draft_model=None,
                        draft_kv_blocks=None)
    stack = build_model_stack(draft_cfg)
    if problem := vocabulary_mismatch(config.model_dir, target, path, stack):
        raise ValueError(f"--draft-model {name}: {problem}; a draft model must share the served model's tokenizer")
    log.info("draft model %s: %d layers, hidden %d, its own KV pool of %d blocks (%s)", name,
             stack.model_config.num_layers, stack.model_config.hidden_size, blocks,
             "--draft-kv-blocks" if config.draft_kv_blocks is not None
             else f"default: 1/{DRAFT_POOL_SHARE} of the served model's {target.kv_pool.blocks}")
    return DraftModel(name, stack, config.max_batch_tokens)


def vocabulary_mismatch(target_dir: Path, target: ModelStack, draft_dir: Path, draft: ModelStack) -> str | None:
    """Why the draft model's token ids do not mean the served model's (None: they do, as far as can be told)."""
    tv, dv = target.model_config.vocab_size, draft.model_config.vocab_size
    if tv != dv:
        return f"its vocabulary has {dv} tokens, the served model's {tv}"
    a, b = _token_map(target_dir), _token_map(draft_dir)
    if a is None or b is None:
        log.info("draft model: tokenizer.json not in both checkpoints (a GGUF file?): only vocab_size compared")
        return None
    differ = sum(1 for tok, i in a.items() if b.get(tok) != i) + sum(1 for tok in b if tok not in a)
    if differ:
        return f"its tokenizer maps {differ} tokens to other ids than the served model's"
    return None


def _token_map(model_dir: Path) -> dict[str, int] | None:
    """token -> id of a checkpoint's tokenizer.json (its model vocab and added tokens); None without one."""
    f = model_dir / "tokenizer.json"
    if not model_dir.is_dir() or not f.is_file():
        return None
    data = json.loads(f.read_text(encoding="utf-8"))
    raw = (data.get("model") or {}).get("vocab") or {}
    # (Unigram: a list of [token, score] pairs, ids by position)
    vocab = {t[0]: i for i, t in enumerate(raw)} if isinstance(raw, list) else dict(raw)
    for t in data.get("added_tokens") or ():
        vocab[t["content"]] = t["id"]
    return vocab
