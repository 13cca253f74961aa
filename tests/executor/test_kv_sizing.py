"""executor_service/kv/sizing.py: the KV pool's size for each flag and default, in blocks, tokens and bytes,
with a reason a user can read. Free memory is faked, so the numbers are exact."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor_service.kv import sizing as kv_sizing
from executor_service.config import ExecutorConfig
from executor_service.kv.sizing import (CPU_KV_BUDGET_BYTES, DEFAULT_KV_FRACTION_CUDA, DEFAULT_MAX_SEQUENCES,
                                        describe, size_kv_pool)

GiB = 1 << 30
PER_BLOCK = 737_280  # SmolLM2-135M float32: 2 x 30 layers x 16 tokens x 3 kv heads x 64 x 4 bytes
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def free_memory(monkeypatch):
    """free_memory(n): the device (host or CUDA) has n bytes free."""
    def set_free(n: int) -> None:
        monkeypatch.setattr(kv_sizing, "available_memory_bytes", lambda device: n)
    return set_free


def cfg(**kw) -> ExecutorConfig:
    return ExecutorConfig(Path("m"), **kw)


def test_kv_blocks_flag_is_exact(free_memory):
    free_memory(1)  # not consulted
    s = size_kv_pool(cfg(kv_blocks=512), CPU, PER_BLOCK, 8192)
    assert (s.blocks, s.tokens, s.bytes, s.reason) == (512, 512 * 16, 512 * PER_BLOCK, "--kv-blocks 512")
    assert describe(s) == "512 blocks = 8192 tokens, 0.35 GiB: --kv-blocks 512"


def test_cpu_default_is_the_fixed_budget_when_memory_and_sequences_allow(free_memory):
    free_memory(23 * GiB)
    s = size_kv_pool(cfg(), CPU, PER_BLOCK, 8192)  # 64 x 8192 tokens would need 24 GiB
    assert s.blocks == CPU_KV_BUDGET_BYTES // PER_BLOCK == 5825
    assert (s.tokens, s.bytes) == (5825 * 16, 5825 * PER_BLOCK) and s.bytes <= 4 * GiB
    assert s.reason.startswith("CPU default: the fixed 4.00 GiB budget") and "--kv-memory-fraction" in s.reason


def test_cpu_default_is_capped_at_what_max_running_full_length_sequences_need(free_memory):
    free_memory(23 * GiB)
    s = size_kv_pool(cfg(), CPU, PER_BLOCK, 1000)  # 64 x 1000 tokens: 64 x 63 blocks, 2.77 GiB
    assert s.blocks == DEFAULT_MAX_SEQUENCES * 63
    assert f"{DEFAULT_MAX_SEQUENCES} sequences of max_seq_len 1000 tokens" in s.reason


def test_cpu_default_takes_at_most_half_of_available_memory(free_memory):
    free_memory(6 * GiB)
    s = size_kv_pool(cfg(), CPU, PER_BLOCK, 8192)
    assert s.blocks == (3 * GiB) // PER_BLOCK
    assert s.reason.startswith("CPU default: 0.5 of 6.00 GiB available host memory, under the fixed 4.00 GiB")


def test_memory_fraction_goes_beyond_the_cpu_default(free_memory):
    free_memory(20 * GiB)
    s = size_kv_pool(cfg(kv_memory_fraction=0.5), CPU, PER_BLOCK, 8192)
    assert s.blocks == (10 * GiB) // PER_BLOCK and s.bytes > CPU_KV_BUDGET_BYTES
    assert s.reason == "--kv-memory-fraction 0.5 of 20.00 GiB available host memory"


def test_cuda_default_is_unchanged(free_memory):
    free_memory(70 * GiB)
    s = size_kv_pool(cfg(), CUDA, PER_BLOCK, 8192)
    assert s.blocks == int(70 * GiB * DEFAULT_KV_FRACTION_CUDA) // PER_BLOCK
    assert s.reason.startswith("CUDA default: 0.85 of 70.00 GiB free device memory")
    s = size_kv_pool(cfg(kv_memory_fraction=0.5), CUDA, PER_BLOCK, 8192)
    assert s.reason == "--kv-memory-fraction 0.5 of 70.00 GiB free device memory"


@pytest.mark.parametrize("kw, message", [
    ({"kv_blocks": 0}, "--kv-blocks must be positive"),
    ({"kv_memory_fraction": 0.0}, "--kv-memory-fraction must be in (0, 1]"),
    ({"kv_memory_fraction": 1.5}, "--kv-memory-fraction must be in (0, 1]"),
    ({}, "not enough free memory for a single KV block"),
])
def test_bad_flags_and_no_room_are_errors(free_memory, kw, message):
    free_memory(PER_BLOCK)  # half of it: less than one block
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("]", r"\]")):
        size_kv_pool(cfg(**kw), CPU, PER_BLOCK, 8192)
