"""An executor's own counters (GetMetrics over gRPC) around a timed run: model calls and their time per
operation, tokens processed and sampled, caches created (one per request routed there), prefix-cache counts."""
from __future__ import annotations

from typing import Any

import grpc

from tandem.executor.v1 import executor_pb2 as epb
from tandem.executor.v1 import executor_pb2_grpc as epb_grpc

MODEL_OPS = ("unified_decode", "prefill", "decode", "forward_verify")  # the operations that run the model


def _scalars(msg: Any) -> dict[str, Any]:
    """The numeric and bool scalar fields of a message (by descriptor: fields added later are picked up)."""
    return {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields
            if not f.is_repeated and f.type != f.TYPE_MESSAGE and f.type != f.TYPE_STRING}


def snapshot(address: str) -> dict[str, Any]:
    with grpc.insecure_channel(address) as ch:
        m = epb_grpc.ExecutorServiceStub(ch).GetMetrics(epb.GetMetricsRequest(), timeout=30)
    has_prefix = "prefix_cache" in m.DESCRIPTOR.fields_by_name
    return {"ops": {k: (v.count, v.count * v.mean_ms) for k, v in m.operations.items()},
            "tokens_processed": m.tokens_processed, "tokens_sampled": m.tokens_sampled,
            "caches_created": m.caches_created, "prefix_cache": _scalars(m.prefix_cache) if has_prefix else None}


def work(before: dict[str, Any], after: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """What the executor did between two snapshots: requests (caches created), tokens, model steps, the share
    of the wall time its model was busy, and the prefix-cache counters' change."""
    busy_ms = sum(after["ops"][k][1] - before["ops"].get(k, (0, 0.0))[1] for k in MODEL_OPS if k in after["ops"])
    steps = after["ops"].get("unified_decode", (0, 0.0))[0] - before["ops"].get("unified_decode", (0, 0.0))[0]
    prefix = None
    if before["prefix_cache"] is not None and after["prefix_cache"] is not None:
        prefix = {k: v if isinstance(v, bool) else v - before["prefix_cache"].get(k, 0)
                  for k, v in after["prefix_cache"].items()}
    return {"requests": after["caches_created"] - before["caches_created"],
            "tokens_processed": after["tokens_processed"] - before["tokens_processed"],
            "tokens_sampled": after["tokens_sampled"] - before["tokens_sampled"], "steps": steps,
            "busy_share": busy_ms / 1e3 / wall_s if wall_s > 0 else None, "prefix_cache": prefix}
