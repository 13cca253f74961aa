"""The byte form of KV blocks (what ExportKv/ImportKv and the tiers move): a block read out and written into
another pool's block is the same bytes, for every KV dtype a pool may have (--kv-dtype, float8 included,
which has no index kernels on CPU)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from executor_service.kv.block_bytes import block_nbytes, read_blocks, write_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_blocks_round_trip_bit_for_bit(dtype: torch.dtype) -> None:
    shape = (2, 5, 4, 3, 8)  # [layers, blocks, block_size, kv_heads, head_dim]
    src = SimpleNamespace(k=torch.randn(shape).to(dtype), v=torch.randn(shape).to(dtype))
    payloads = read_blocks(src, [1, 3])
    assert [len(p) for p in payloads] == [block_nbytes(src)] * 2
    dst = SimpleNamespace(k=torch.zeros(shape).to(dtype), v=torch.zeros(shape).to(dtype))
    write_blocks(dst, [0, 2], payloads)
    for got, want in ((dst.k[:, 0], src.k[:, 1]), (dst.v[:, 2], src.v[:, 3])):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    untouched = dst.k[:, 1].view(torch.uint8)
    assert not untouched.any()


def test_a_payload_of_the_wrong_size_is_refused() -> None:
    shape = (1, 2, 4, 1, 8)
    kv = SimpleNamespace(k=torch.zeros(shape), v=torch.zeros(shape))
    with pytest.raises(ValueError, match="bytes here"):
        write_blocks(kv, [0], [b"\0" * 7])
