"""SamplingParams <-> tandem.executor.v1.SamplingParams, without torch: the scheduler uses it too."""
from __future__ import annotations

import math

from models.errors import InvalidRequest
from models.sampling_params import SamplingParams
from protos import executor_pb2 as pb


def sampling_from_pb(m: pb.SamplingParams) -> SamplingParams:
    if m.HasField("top_p") and not (0.0 < m.top_p <= 1.0):
        raise InvalidRequest(f"sampling.top_p must be in (0, 1] (leave it unset for off), got {m.top_p}")
    if not math.isnan(m.repetition_penalty) and m.repetition_penalty < 0:
        raise InvalidRequest(f"sampling.repetition_penalty must be > 0 (unset = off), got {m.repetition_penalty}")
    return SamplingParams(
        temperature=m.temperature, top_k=m.top_k, top_p=m.top_p if m.HasField("top_p") else 0.0, min_p=m.min_p,
        repetition_penalty=m.repetition_penalty, presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty, seed=m.seed if m.HasField("seed") else None,
        logit_bias=dict(m.logit_bias))


def sampling_to_pb(p: SamplingParams) -> pb.SamplingParams:
    m = pb.SamplingParams(temperature=p.temperature, top_k=p.top_k, min_p=p.min_p,
                          repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
                          frequency_penalty=p.frequency_penalty, logit_bias=p.logit_bias)
    if p.top_p:
        m.top_p = p.top_p
    if p.seed is not None:
        m.seed = p.seed
    return m
