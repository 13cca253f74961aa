"""tandem.executor.v1 pooling messages <-> the executor's domain objects (UnifiedItem.pooling,
UnifiedResult.pooled, GetInfoResponse.pooling; executor_service/step/pooling.py computes them)."""
from __future__ import annotations

import torch

from executor_service.types import PoolingInfo, PoolingOptions, PoolingTask, PoolingType
from tandem.errors import InvalidRequest
from tandem.executor.v1 import executor_pb2 as pb

_TASKS = {pb.POOLING_TASK_UNSPECIFIED: PoolingTask.EMBED, pb.POOLING_TASK_EMBED: PoolingTask.EMBED,
          pb.POOLING_TASK_CLASSIFY: PoolingTask.CLASSIFY, pb.POOLING_TASK_TOKEN_LOGITS: PoolingTask.TOKEN_LOGITS}
_TYPES = {pb.POOLING_TYPE_UNSPECIFIED: None, pb.POOLING_TYPE_LAST: PoolingType.LAST,
          pb.POOLING_TYPE_MEAN: PoolingType.MEAN}
_TYPE_PB = {v: k for k, v in _TYPES.items()}


def pooling_from_pb(m: pb.UnifiedItem) -> PoolingOptions | None:
    if not m.HasField("pooling"):
        return None
    p = m.pooling
    if p.task not in _TASKS:
        raise InvalidRequest(f"{{field}} {p.task} is not a known PoolingTask", "pooling.task")
    if p.type not in _TYPES:
        raise InvalidRequest(f"{{field}} {p.type} is not a known PoolingType", "pooling.type")
    return PoolingOptions(_TASKS[p.task], _TYPES[p.type], p.normalize, tuple(p.token_ids))


def pooled_to_pb(values: torch.Tensor) -> pb.PooledOutput:
    """values: float32 [dim] on the CPU -> little-endian float32 bytes."""
    return pb.PooledOutput(data=values.numpy().astype("<f4", copy=False).tobytes(), dim=values.shape[0])


def pooling_info_to_pb(info: PoolingInfo) -> pb.PoolingInfo:
    return pb.PoolingInfo(default_type=_TYPE_PB[info.default_type], source=info.source, num_labels=info.num_labels,
                          lm_head=info.lm_head, matryoshka=info.matryoshka,
                          matryoshka_dimensions=list(info.matryoshka_dimensions))
