"""The model stack of one tensor-parallel rank: model_stack.py's order (load, quantize, pack, huge
pages, KV pool), with the model cut to this rank's shard right after loading (models/parallel/shard.py) and a
KV pool of this rank's KV heads, as many blocks on every rank (the smallest any rank sized: rank 0 hands out
block ids that every pool must have). Rank 0's batch runner drives the workers (executor_service/tp/leader.py).

What a tensor-parallel executor refuses at start is in executor_service/step/decode_choice.py's table of
flags (`flag_refusal`): the native and compiled decode steps and --deterministic (they read whole weights; the
eager forward with the gathered paged attention runs every step, with oneDNN's packed weights on CPU), LoRA
adapters (A/B are not sharded yet), KV tiers and KV dtypes other than the weights'.
"""
from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist

from executor_service.step.batch import BatchRunner
from executor_service.config import ExecutorConfig
from executor_service.kv.sizing import build_kv_pool
from executor_service.model_stack import ModelStack, build_model_stack, prepare_block_weights, repack_for_kernels
from executor_service.step.decode_choice import flag_refusal, model_flag_refusal
from executor_service.tp.launch import TpGroup, current
from executor_service.tp.leader import CopyLog, LeaderModel
from models.config import ModelConfig, read_generation_defaults
from models.memory.huge_pages import move_parameters_to_huge_pages
from models.kv.paged_cache import PagedKvCache
from models.loader import load_model, resolve_dtype
from models.memory.mapped_pages import trim_heap
from models.native.library import NativeBuild
from models.quant.blocks import move_blocks_to_huge_pages, weight_format
from models.parallel.shard import Shard, shard_layer, shard_model
from models.transformer import DecoderModel

log = logging.getLogger("tandem.executor.tp")


def load_shard(config: ExecutorConfig, shard: Shard, device: torch.device, progress: bool) -> DecoderModel:
    """This rank's part of the model, on `device`. A checkpoint directory is loaded and cut on the host, then
    the shard is moved: a rank's GPU never holds more than its part (the whole model may not fit one GPU, which
    is why it is split), and the ranks of one machine share the file's pages while they cut. A directory's sizes
    were checked before the rank started (tp_main.refuse_early); a GGUF file's raise ValueError here."""
    directory = config.model_dir.suffix.lower() != ".gguf"  # (a GGUF file is loaded whole, then cut)
    on_host = device.type != "cpu" and directory
    dtype = config.dtype
    if on_host:  # the device's dtype (auto: bfloat16 on CUDA), loaded on the host
        dtype = str(resolve_dtype(dtype, ModelConfig.from_dir(config.model_dir), device)).removeprefix("torch.")
    # a directory's layers cut as each is loaded: one layer's fused q/k/v and stacked experts whole at a time
    model = load_model(config.model_dir, "cpu" if on_host else device, dtype, progress=progress,
                       on_layer=(lambda layer: shard_layer(layer, shard)) if directory else None,
                       gguf_dequantize=config.gguf_dequantize)
    shard_model(model, shard, layers_cut=directory)
    if on_host:
        model.to(device)
        model.init_rotary(device)  # (the rotary tables are not module buffers)
    return model


def build_tp_stack(config: ExecutorConfig, group: TpGroup) -> ModelStack:
    """This rank's stack. Raises ValueError for a combination tensor parallelism refuses."""
    why = flag_refusal(config)
    if why:
        raise ValueError(why)
    device = config.resolve_device()
    model = load_shard(config, group.shard, device, progress=config.progress and not group.is_worker)
    if reason := model_flag_refusal(config, model):  # (a GGUF file's block weights: cut by rank, then asked)
        raise ValueError(reason)
    prepare_block_weights(model, NativeBuild(config.native_cache_dir))
    trim_heap()
    kernel = model.quantize(config.quantization)  # per shard: row-parallel int8 scales are the shard's columns'
    if kernel:
        log.info("linear weights quantized to %s (%s kernel)", config.quantization, kernel)
    if config.cpu_packed_weights:  # (the eager forward runs every step)
        model.pack_cpu_weights()
    if device.type == "cpu":
        move_parameters_to_huge_pages(model, config.huge_pages)
        move_blocks_to_huge_pages(model, config.huge_pages)
    repack_for_kernels(model)  # (after the arena: rewritten in place there)
    model.upcast_cpu_half_linears()
    cfg, dtype = model.config, model.lm_head.weight.dtype
    size = group.shard.size
    local = dataclasses.replace(cfg, num_heads=cfg.num_heads // size, num_kv_heads=cfg.num_kv_heads // size)
    kv, kv_pool = build_kv_pool(config, device, local, dtype)
    agreed = torch.tensor([kv_pool.blocks], dtype=torch.int64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group.channel.control)
    if int(agreed) < kv_pool.blocks:  # another rank has less room: every pool gets its size
        blocks = int(agreed)
        del kv
        kv = PagedKvCache(local.num_layers, blocks, config.block_size, local.num_kv_heads, local.head_dim, dtype,
                          device, local.kv_window)
        kv_pool = dataclasses.replace(kv_pool, blocks=blocks, tokens=blocks * config.block_size,
                                      bytes=kv_pool.bytes // kv_pool.blocks * blocks,
                                      reason=f"{kv_pool.reason}; lowered to the smallest rank's pool")
        log.info("KV pool lowered to %d blocks: the smallest of the %d ranks' pools", blocks, size)
    trim_heap()
    runner_model = model if group.is_worker else LeaderModel(model, group.channel, CopyLog(kv))
    if not group.is_worker:  # from now on every collective goes through the channel's lock
        group.channel.start_heartbeat()
    return ModelStack(device=device, model=model, model_config=cfg,
                      generation=read_generation_defaults(config.model_dir, cfg), quantization_kernel=kernel,
                      kv=kv, kv_pool=kv_pool, decode_step=None,
                      runner=BatchRunner(runner_model, kv, config.attention_bound(), None),  # type: ignore[arg-type]
                      weight_format=weight_format(model))


def build_stack(config: ExecutorConfig) -> ModelStack:
    """The executor's stack: model_stack.py's, or this rank's shard with --tensor-parallel-size > 1 (the group
    this process joined at startup, executor_service/tp/launch.py)."""
    if config.tensor_parallel_size == 1:
        return build_model_stack(config)
    return build_tp_stack(config, current())
