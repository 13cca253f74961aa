"""A tensor-parallel worker rank: it serves nothing; it holds its shard of the weights and of the KV
pool and runs, step by step, the ops rank 0 broadcasts (executor_service/tp/channel.py) until told to stop.

Any error ends the worker (exit EXIT_GROUP_DOWN): rank 0's next collective then fails and takes the group
down, so a worker never limps on out of step."""
from __future__ import annotations

import logging

import torch

from executor_service.config import ExecutorConfig
from executor_service.model_stack import ModelStack
from executor_service.tp.channel import EXIT_GROUP_DOWN, ControlChannel, Step, fatal
from models.attention.paged import AttentionMetadata

log = logging.getLogger("tandem.executor.tp")


def serve_worker(config: ExecutorConfig, stack: ModelStack, channel: ControlChannel) -> int:
    """Runs rank 0's steps on `stack` until a stop step (returns 0); any failure exits EXIT_GROUP_DOWN."""
    log.info("tensor-parallel rank %d of %d ready", channel.rank, channel.size)
    try:
        while True:
            step = channel.recv()
            if step.op == "stop":
                log.info("tensor-parallel rank %d: stopped by rank 0", channel.rank)
                return 0
            if step.op == "ping":
                channel.pong()
                continue
            _run(config, stack, channel, step)
    except Exception as exc:  # noqa: BLE001  (rank 0 gone, a timeout, anything: the group is down)
        fatal(f"rank {channel.rank} stops ({type(exc).__name__}: {exc})")
    return EXIT_GROUP_DOWN


@torch.inference_mode()
def _run(config: ExecutorConfig, stack: ModelStack, channel: ControlChannel, step: Step) -> None:
    model, kv, device = stack.model, stack.kv, stack.device
    for source, dest in step.copies:  # rank 0's copy-on-write of shared blocks, before they are written
        kv.k[:, dest].copy_(kv.k[:, source])
        kv.v[:, dest].copy_(kv.v[:, source])
    if step.op == "project":
        h = torch.empty(step.shape, dtype=getattr(torch, step.dtype), device=device)
        channel.broadcast(h)
        model.project(h)
        return
    cfg = stack.model_config
    meta = AttentionMetadata(step.items, kv.block_size, cfg.num_heads // cfg.num_kv_heads, device, kv.k.dtype,
                             config.attention_bound())
    ids = torch.tensor(step.ids, dtype=torch.int64, device=device)
    rows = None if step.rows is None else torch.tensor(step.rows, dtype=torch.int64, device=device)
    if step.op == "forward":
        model(ids, meta, kv, rows)
    elif step.op == "hidden":
        model.hidden(ids, meta, kv, rows)
    else:
        raise ValueError(f"unknown step {step.op!r}")
