"""`python -m executor_service --tensor-parallel-size N`: how one process of a tensor-parallel executor runs.
Rank 0 starts or awaits the other ranks (launch.py), then serves exactly as a plain executor
(its stack built by stack.py) and, on its way out, stops them; a worker rank builds its shard and runs rank
0's steps (worker.py)."""
from __future__ import annotations

import dataclasses
import logging

import torch

from executor_service.config import ExecutorConfig
from executor_service.server import ServerConfig, serve
from executor_service.tp.launch import TpLaunch, start_group
from executor_service.step.decode_choice import flag_refusal
from executor_service.tp.stack import build_tp_stack
from executor_service.tp.worker import serve_worker
from models.config import ModelConfig
from models.parallel.shard import shard_refusal
from tandem.model_path import is_gguf

log = logging.getLogger("tandem.executor.tp")


def rank_device(device: str, launch: TpLaunch) -> str:
    """CUDA: one device per rank (cuda:<rank> on one machine, cuda:<rank mod devices> across machines, unless
    --device names one); CPU as given."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return f"cuda:{launch.rank % max(1, torch.cuda.device_count())}"
    return device


def refuse_early(cfg: ExecutorConfig, size: int) -> None:
    """Raises ValueError for what cannot run sharded, before any rank starts (the model's config.json read; a
    GGUF file's config is checked once loaded, by shard_model)."""
    why = flag_refusal(dataclasses.replace(cfg, tensor_parallel_size=size))
    if why:
        raise ValueError(why)
    why = None if is_gguf(cfg.model_dir) else shard_refusal(ModelConfig.from_dir(cfg.model_dir), size)
    if why:
        raise ValueError(f"--tensor-parallel-size {size}: {why}")


def run_tensor_parallel(launch: TpLaunch, executor_cfg: ExecutorConfig, server_cfg: ServerConfig,
                        argv: list[str]) -> int:
    """Joins the group and serves (rank 0) or works (the others). argv: this process's flags, which rank 0
    hands to the workers it starts."""
    refuse_early(executor_cfg, launch.size)
    device = rank_device(executor_cfg.device, launch)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    cfg = dataclasses.replace(executor_cfg, device=device, tensor_parallel_size=launch.size)
    group = start_group(launch, torch.device(device), argv)  # ValueError: a rank did not join
    if group.is_worker:
        try:
            code = serve_worker(cfg, build_tp_stack(cfg, group), group.channel)
        finally:
            group.stop()
        return code
    try:
        return serve(cfg, server_cfg)
    finally:
        group.stop()
