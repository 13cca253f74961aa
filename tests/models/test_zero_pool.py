"""models/memory/zero_pool.py: a KV pool that is zero without being written, and committed only where it is written."""
from __future__ import annotations

import pytest
import torch

from executor_service.memory_probe import resident_memory_bytes
from models.kv.paged_cache import PagedKvCache
from models.memory.zero_pool import lazy_zeros

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MiB = 1 << 20


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lazy_zeros_are_exact_zeros_of_the_asked_shape_and_dtype(dtype):
    t = lazy_zeros((3, 5, 16, 2, 8), dtype, "cpu")
    assert t.shape == (3, 5, 16, 2, 8) and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
    assert torch.count_nonzero(t) == 0 and not torch.signbit(t).any()  # +0.0 everywhere, not -0.0
    t[1, 2].fill_(1.5)  # writable, in place
    assert t[1, 2].eq(1.5).all() and torch.count_nonzero(t) == 16 * 2 * 8


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_large_pool_is_not_resident_until_written(dtype):
    rss = resident_memory_bytes()
    if rss == 0:
        pytest.skip("no /proc: resident memory is not known on this platform")
    pool = lazy_zeros((2, 1024, 16, 8, 128, 16), dtype, "cpu")  # 1 GiB in float32, 512 MiB in 16-bit
    assert pool.nbytes >= 512 * MiB
    assert resident_memory_bytes() - rss < 64 * MiB  # allocated, not committed
    pool[0, 7].fill_(1.0)  # one "block" of one "layer": 256 KiB (float32) committed, the rest still free
    assert resident_memory_bytes() - rss < 64 * MiB
    assert torch.count_nonzero(pool[1]) == 0  # reading untouched pages (the OS's zero page) commits nothing
    assert resident_memory_bytes() - rss < 64 * MiB


def test_paged_kv_cache_allocates_its_pools_lazily():
    rss = resident_memory_bytes()
    if rss == 0:
        pytest.skip("no /proc: resident memory is not known on this platform")
    kv = PagedKvCache(num_layers=8, num_blocks=4096, block_size=16, num_kv_heads=4, head_dim=64,
                      dtype=torch.float32, device=torch.device("cpu"))  # 2 x 512 MiB
    assert kv.k.nbytes + kv.v.nbytes == 1024 * MiB
    assert resident_memory_bytes() - rss < 64 * MiB
    assert kv.k.data_ptr() != kv.v.data_ptr()  # two separate pools


def test_other_devices_keep_torch_zeros():
    t = lazy_zeros((4, 2), torch.bfloat16, "meta")  # stands in for CUDA: not the CPU mapping path
    assert t.device.type == "meta" and t.shape == (4, 2) and t.dtype == torch.bfloat16
