"""CUDA graphs for decode (models/decode/cuda_graphs.py): the bucket and padding logic on CPU; the capture and a padded
bucket's tokens against the eager step on CUDA (marked `cuda`, skipped without it; scripts/gpu_check runs them)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from models.decode.cuda_graphs import bucket_for, graph_buckets, pad_decode
from models.kv.paged_cache import decode_block_table


def test_buckets_cover_every_batch_size_up_to_the_largest():
    assert graph_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert graph_buckets(3) == (1, 2, 3)
    assert graph_buckets(1) == (1,)
    assert graph_buckets(0) == ()
    buckets = graph_buckets(20)
    for rows in range(1, 21):
        b = bucket_for(rows, buckets)
        assert b is not None and b >= rows and all(x < rows for x in buckets if x < b)
    assert bucket_for(21, buckets) is None  # over the largest: eager


def test_padding_repeats_row_zero_and_fixes_the_table_width():
    p = pad_decode([11, 12, 13], [[4, 5], [6], [7, 8, 9]], [20, 3, 40], bucket=4, block_size=16, width=5)
    assert p.rows == 3
    assert p.ids.tolist() == [11, 12, 13, 11]
    assert p.positions.tolist() == [20, 3, 40, 20]
    assert p.slots.tolist() == [5 * 16 + 4, 6 * 16 + 3, 9 * 16 + 8, 5 * 16 + 4]
    assert p.lens.tolist() == [21, 4, 41, 21]
    assert p.table.shape == (4, 5)
    assert np.array_equal(p.table[:3], decode_block_table([[4, 5], [6], [7, 8, 9]], [20, 3, 40], 16, 3, 5))
    assert np.array_equal(p.table[3], p.table[0])
    with pytest.raises(ValueError, match="needs 3 blocks"):
        pad_decode([1], [[1, 2, 3]], [40], bucket=1, block_size=16, width=2)
    with pytest.raises(ValueError, match="do not fit"):
        pad_decode([1, 2], [[1], [2]], [0, 0], bucket=1, block_size=16, width=2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_padded_bucket_gives_the_eager_tokens(model_dir):
    from models.attention.paged import ItemLayout
    from models.decode.cuda_graphs import CudaGraphDecode
    from models.kv.paged_cache import PagedKvCache
    from models.loader import load_model
    model = load_model(model_dir, "cuda", "float32", progress=False)
    model.init_rotary(torch.device("cuda"))
    cfg = model.config
    pools = [PagedKvCache(cfg.num_layers, 64, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                          torch.device("cuda")) for _ in range(2)]
    graphs = CudaGraphDecode(model, pools[1], max_batch=8)
    graphs.capture()
    from models.attention.backend import AttentionBuilder
    tables = [[1, 2], [3, 4], [5, 6]]  # 3 rows: the bucket of 4, one padded row
    prompts = [list(range(5, 25)), list(range(30, 41)), list(range(50, 53))]
    with torch.inference_mode():
        for kv in pools:  # the same prefill in both pools (eager)
            builder = AttentionBuilder("gathered", kv, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                       torch.device("cuda"))
            items = [ItemLayout(t, 0, len(p)) for t, p in zip(tables, prompts)]
            model(torch.tensor([x for p in prompts for x in p], device="cuda"), builder(items), kv, None)
        pasts = [len(p) for p in prompts]
        tokens = [p[-1] for p in prompts]
        for _ in range(8):
            items = [ItemLayout(t, p, 1) for t, p in zip(tables, pasts)]
            builder = AttentionBuilder("gathered", pools[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                       torch.device("cuda"))
            want = model(torch.tensor(tokens, device="cuda"), builder(items), pools[0], None)
            got = graphs.run(tokens, tables, pasts)
            assert torch.equal(got.argmax(-1), want.argmax(-1))
            assert torch.allclose(got, want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))
            tokens = want.argmax(-1).tolist()
            pasts = [p + 1 for p in pasts]
    assert graphs.calls == 8
