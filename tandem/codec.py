"""Protobuf <-> domain conversions both processes share (the tandem.common.v1 messages and KvUsage), without
torch. One codec per message: the scheduler and the executor check sampling values the same way."""
from __future__ import annotations

import math
from typing import Iterable

from tandem.common.v1 import common_pb2 as cpb
from tandem.errors import InvalidRequest
from tandem.executor.v1 import executor_pb2 as epb
from tandem.kv_usage import KvUsage
from tandem.sampling_params import SamplingParams


def sampling_from_pb(m: cpb.SamplingParams) -> SamplingParams:
    """Wire checks that the domain type cannot see (an explicit top_p of 0, a NaN penalty); the rest is
    SamplingParams.validate's, which needs the vocabulary size."""
    if m.HasField("top_p") and not (0.0 < m.top_p <= 1.0):
        raise InvalidRequest(f"{{field}} must be in (0, 1] (leave it unset for off), got {m.top_p}", "sampling.top_p")
    if not math.isnan(m.repetition_penalty) and m.repetition_penalty < 0:
        raise InvalidRequest(f"{{field}} must be > 0 (unset = off), got {m.repetition_penalty}",
                             "sampling.repetition_penalty")
    return SamplingParams(
        temperature=m.temperature, top_k=m.top_k, top_p=m.top_p if m.HasField("top_p") else 0.0, min_p=m.min_p,
        repetition_penalty=m.repetition_penalty, presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty, seed=m.seed if m.HasField("seed") else None,
        logit_bias=dict(m.logit_bias))


def sampling_to_pb(p: SamplingParams) -> cpb.SamplingParams:
    m = cpb.SamplingParams(temperature=p.temperature, top_k=p.top_k, min_p=p.min_p,
                           repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
                           frequency_penalty=p.frequency_penalty, logit_bias=p.logit_bias)
    if p.top_p:
        m.top_p = p.top_p
    if p.seed is not None:
        m.seed = p.seed
    return m


def token_logprob_to_pb(token_id: int, logprob: float, top: Iterable[tuple[int, float]],
                        rank: int | None = None) -> cpb.TokenLogprob:
    """rank: set for prompt logprobs only (None: unset)."""
    return cpb.TokenLogprob(token_id=token_id, logprob=logprob, rank=rank,
                            top_logprobs=[cpb.TopLogprob(token_id=i, logprob=lp) for i, lp in top])


def kv_usage_to_pb(kv: KvUsage) -> epb.KvUsage:
    return epb.KvUsage(block_size=kv.block_size, total_blocks=kv.total_blocks, free_blocks=kv.free_blocks,
                       active_caches=kv.active_caches, cached_blocks=kv.cached_blocks)


def kv_usage_from_pb(m: epb.KvUsage) -> KvUsage:
    return KvUsage(m.block_size, m.total_blocks, m.free_blocks, m.active_caches, m.cached_blocks)
