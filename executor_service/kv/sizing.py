"""How big the KV pool is, and why: the sizing decision, stated in blocks, tokens and bytes with its reason.

- `--kv-blocks N`: exactly N blocks.
- `--kv-memory-fraction F`: F of the free memory now (CUDA: the device's free bytes after the weights; CPU:
  the host's MemAvailable after the weights).
- CUDA default: 0.85 of the device's free memory (the device serves the model alone).
- CPU default: a fixed budget, CPU_KV_BUDGET_BYTES (4 GiB, like vLLM's CPU backend, whose
  VLLM_CPU_KVCACHE_SPACE defaults to 4 GiB), lowered to what DEFAULT_MAX_SEQUENCES full-length sequences need
  (a default scheduler's running sequences never hold more) and to half of MemAvailable (a laptop keeps
  room for everything else). The host pool is committed as blocks are first written (models/memory/zero_pool.py),
  so it costs nothing at start; the budget bounds memory under full load, and over a long-running server's
  life (the free list hands blocks out in turn, so traffic gradually touches all of them).
"""
from __future__ import annotations

import logging

import torch

from executor_service.config import ExecutorConfig
from executor_service.memory_probe import available_memory_bytes
from executor_service.types import KvPoolSizing
from models.config import ModelConfig
from models.kv.paged_cache import PagedKvCache
from tandem.ceil_div import ceil_div

DEFAULT_KV_FRACTION_CUDA = 0.85  # of the device memory left free after the weights
CPU_KV_BUDGET_BYTES = 4 << 30  # the CPU default's fixed budget
CPU_KV_AVAILABLE_SHARE = 0.5  # the CPU default takes at most this share of MemAvailable
# Sequences the CPU default makes room for at full length (max_seq_len each): the scheduler's default
# --max-running, i.e. the most sequences a default scheduler keeps in the pool at once.
DEFAULT_MAX_SEQUENCES = 64

log = logging.getLogger("tandem.executor")


def gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def size_kv_pool(cfg: ExecutorConfig, device: torch.device, bytes_per_block: int, max_seq_len: int
                 ) -> KvPoolSizing:
    """The pool's size under cfg's flags (see the module docstring). Raises ValueError for a flag out of range
    or when not one block fits."""
    def sized(blocks: int, reason: str) -> KvPoolSizing:
        if blocks < 1:
            raise ValueError(f"not enough free memory for a single KV block ({reason}); pass --kv-blocks")
        return KvPoolSizing(blocks, blocks * cfg.block_size, blocks * bytes_per_block, reason)

    if cfg.kv_blocks is not None:
        if cfg.kv_blocks <= 0:
            raise ValueError(f"--kv-blocks must be positive, got {cfg.kv_blocks}")
        return sized(cfg.kv_blocks, f"--kv-blocks {cfg.kv_blocks}")
    where = "free device memory" if device.type == "cuda" else "available host memory"
    fraction = cfg.kv_memory_fraction
    if fraction is not None:
        if not 0 < fraction <= 1:
            raise ValueError(f"--kv-memory-fraction must be in (0, 1], got {fraction}")
        free = available_memory_bytes(device)
        return sized(int(free * fraction) // bytes_per_block, f"--kv-memory-fraction {fraction:g} of {gib(free)} {where}")
    if device.type == "cuda":
        free = available_memory_bytes(device)
        return sized(int(free * DEFAULT_KV_FRACTION_CUDA) // bytes_per_block,
                     f"CUDA default: {DEFAULT_KV_FRACTION_CUDA:g} of {gib(free)} {where} (--kv-memory-fraction or "
                     "--kv-blocks to change)")
    free = available_memory_bytes(device)
    budget = CPU_KV_BUDGET_BYTES // bytes_per_block
    room = int(free * CPU_KV_AVAILABLE_SHARE) // bytes_per_block
    needed = DEFAULT_MAX_SEQUENCES * ceil_div(max_seq_len, cfg.block_size)
    more = "--kv-memory-fraction or --kv-blocks for more"
    if needed <= min(budget, room):
        return sized(needed, f"CPU default: what {DEFAULT_MAX_SEQUENCES} sequences of max_seq_len {max_seq_len} "
                             f"tokens need, under the fixed {gib(CPU_KV_BUDGET_BYTES)} budget ({more})")
    if room < budget:
        return sized(room, f"CPU default: {CPU_KV_AVAILABLE_SHARE:g} of {gib(free)} {where}, under the fixed "
                           f"{gib(CPU_KV_BUDGET_BYTES)} budget ({more})")
    return sized(budget, f"CPU default: the fixed {gib(CPU_KV_BUDGET_BYTES)} budget ({more})")


def describe(s: KvPoolSizing) -> str:
    """`5825 blocks = 93200 tokens, 4.00 GiB: <reason>`: the startup log's line."""
    return f"{s.blocks} blocks = {s.tokens} tokens, {gib(s.bytes)}: {s.reason}"


def build_kv_pool(cfg: ExecutorConfig, device: torch.device, model: ModelConfig, dtype: torch.dtype
                  ) -> tuple[PagedKvCache, KvPoolSizing]:
    """Sizes the pool (after the weights are loaded, so free memory accounts for them), logs the decision
    and allocates the pool (on CPU, zero pages committed as they are written)."""
    per_block = PagedKvCache.bytes_per_block(model.num_layers, cfg.block_size, model.num_kv_heads, model.head_dim,
                                             dtype)
    sizing = size_kv_pool(cfg, device, per_block, model.max_position_embeddings)
    log.info("KV pool: %s", describe(sizing))
    window = model.kv_window  # every layer slides: sequences hold only their window's blocks (kv_cache.py)
    if window is not None:
        log.info("KV: every layer attends a sliding window of %d tokens; a sequence holds at most %d blocks",
                 window, ceil_div(window, cfg.block_size) + 1)
    pool = PagedKvCache(model.num_layers, sizing.blocks, cfg.block_size, model.num_kv_heads, model.head_dim, dtype,
                        device, window)
    return pool, sizing
