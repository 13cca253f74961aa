"""Pooled items (UnifiedItem.pooling): a sequence whose final chunk returns values computed from its final hidden
states instead of a sampled token, in the same packed forward as every other item of the step (so embeddings and
scores batch with generation, and their full blocks join the prefix cache like any prompt's):

- EMBED: the last position's hidden state, or the mean over every position (the cache keeps a float32 running
  sum between chunks, so a long input is chunked like any prompt), optionally L2-normalised;
- CLASSIFY: a *ForSequenceClassification checkpoint's `score` head at the last position (raw outputs);
- TOKEN_LOGITS: the raw logits of chosen tokens at the last position (a decoder LM answering yes/no, as
  Qwen3-Reranker does: the scheduler turns the two logits into a relevance score).

`PoolingRules` checks an item against the model (what it has, the default pooling) and the cache (mean pooling
needs every position from 0: a cache that reused a cached prefix cannot be mean-pooled); `kept_rows` says which
of an item's rows the forward must keep; `pool` commits an item's rows to its cache and returns its values."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from executor_service.kv.cache_table import CacheState
from executor_service.types import PoolingInfo, PoolingTask, PoolingType, UnifiedItem
from models.pooling_config import read_pooling_config
from tandem.errors import CacheStateConflict, InvalidRequest

if TYPE_CHECKING:
    from executor_service.config import ExecutorConfig
    from models.config import ModelConfig
    from models.transformer import DecoderModel

MAX_SCORED_TOKENS = 64  # PoolingOptions.token_ids per item


class PoolingRules:
    """The checks of pooled items (and of sampled ones on a model without an LM head). info None: this executor
    serves no pooled item, for the reason given."""

    def __init__(self, info: PoolingInfo | None, refusal: str, vocab_size: int, architecture: str,
                 lm_head: bool = True) -> None:
        self.info = info
        self.lm_head = lm_head
        self.refusal = refusal
        self.vocab_size = vocab_size
        self.architecture = architecture

    def check(self, it: UnifiedItem, state: CacheState | None) -> UnifiedItem:
        """The item with its pooling type resolved (the model's default when unset); raises its error."""
        p = it.pooling
        if p is None:
            if not self.lm_head:
                raise InvalidRequest(f"this model ({self.architecture}) has no LM head: it serves pooled items "
                                     "only ({field} with task classify or embed), nothing is sampled", "pooling")
            return it
        if self.info is None:
            raise InvalidRequest(f"{{field}} is set but this executor serves no pooled items: {self.refusal}",
                                 "pooling")
        if it.draft_token_ids or it.allowed_tokens is not None or it.prompt_logprobs is not None:
            raise InvalidRequest("a pooled item samples nothing: it cannot carry draft_token_ids, allowed_tokens or "
                                 "prompt_logprobs", "draft_token_ids" if it.draft_token_ids else "allowed_tokens"
                                 if it.allowed_tokens is not None else "prompt_logprobs")
        if p.task is PoolingTask.CLASSIFY and not self.info.num_labels:
            raise InvalidRequest(f"this model ({self.architecture}) has no sequence-classification head: classify "
                                 "needs a *ForSequenceClassification checkpoint (embed or token_logits instead)",
                                 "pooling.task")
        if p.task is PoolingTask.TOKEN_LOGITS:
            if not self.info.lm_head:
                raise InvalidRequest(f"this model ({self.architecture}) has no LM head, so no token logits: use "
                                     "task classify", "pooling.task")
            if not 1 <= len(p.token_ids) <= MAX_SCORED_TOKENS:
                raise InvalidRequest(f"token_logits needs 1 to {MAX_SCORED_TOKENS} {{field}}, got {len(p.token_ids)}",
                                     "pooling.token_ids")
            bad = next((t for t in p.token_ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InvalidRequest(f"{{field}} holds token id {bad}, outside the vocabulary [0, {self.vocab_size})",
                                     "pooling.token_ids")
        if p.task is not PoolingTask.EMBED:
            return it
        kind = p.type or self.info.default_type
        if kind is None:
            raise InvalidRequest(f"the model's pooling configuration is not served ({self.info.source}): name a "
                                 "pooling type (last or mean), or start the executor with --pooling", "pooling.type")
        if kind is PoolingType.MEAN and it.pos_offset and (state is None or state.pool_sum is None
                                                           or state.pool_rows != it.pos_offset):
            raise CacheStateConflict(
                f"mean pooling averages every position, but the cache's positions 0..{it.pos_offset - 1} were not "
                "pooled (a reused prefix, or chunks sent without pooling): send every chunk from position 0 with "
                "mean pooling, in a cache that reused no prefix")
        return it if kind is p.type else dataclasses.replace(it, pooling=dataclasses.replace(p, type=kind))


def kept_rows(it: UnifiedItem, n: int) -> tuple[int, int] | None:
    """Which of a pooled item's n rows the forward keeps (start, end), or None: every row for mean pooling, the
    last one of its final chunk otherwise."""
    p = it.pooling
    if p is None:
        return None
    if p.task is PoolingTask.EMBED and p.type is PoolingType.MEAN:
        return 0, n
    return (n - 1, n) if it.is_final_chunk else None


@torch.inference_mode()
def pool(model: "DecoderModel", it: UnifiedItem, state: CacheState, hidden: torch.Tensor | None) -> torch.Tensor | None:
    """After the item's forward (hidden: its kept rows, [k, hidden_size]): updates the cache's running sum (mean
    pooling; any other item drops it) and returns the item's values for a final chunk, float32 on the CPU."""
    p = it.pooling
    mean = p is not None and p.task is PoolingTask.EMBED and p.type is PoolingType.MEAN
    if not mean:
        state.pool_sum, state.pool_rows = None, 0
    else:
        rows = hidden.float().sum(dim=0)  # [hidden_size]
        state.pool_sum = rows if not it.pos_offset else state.pool_sum + rows
        state.pool_rows = it.pos_offset + hidden.shape[0]
    if p is None or not it.is_final_chunk:
        return None
    if p.task is PoolingTask.CLASSIFY:
        return model.classify(hidden[-1:])[0].cpu()
    if p.task is PoolingTask.TOKEN_LOGITS:
        return model.project(hidden[-1:])[0, list(p.token_ids)].cpu()
    vec = state.pool_sum / state.pool_rows if mean else hidden[-1].float()
    if p.normalize:
        vec = vec / vec.norm().clamp_min(1e-12)
    return vec.cpu()


def pooling_rules(config: "ExecutorConfig", cfg: "ModelConfig") -> PoolingRules:
    """The rules for this executor: pooled items are served unless every row runs through the native step
    (--deterministic, which keeps no hidden states) or the model is split over ranks."""
    refusal = ("--deterministic runs every row through the native step, which keeps no hidden states"
               if config.deterministic else "the model is split over ranks (--tensor-parallel-size > 1)"
               if config.tensor_parallel_size > 1 else "")
    info = None
    if not refusal:
        found = read_pooling_config(config.model_dir, config.pooling)
        info = PoolingInfo(PoolingType(found.default) if found.default else None, found.source, cfg.num_labels,
                           not cfg.num_labels, found.matryoshka, found.matryoshka_dimensions)
    return PoolingRules(info, refusal, cfg.vocab_size, cfg.checkpoint_architecture or cfg.architecture,
                        lm_head=not cfg.num_labels)
