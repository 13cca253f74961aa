"""KV block accounting: any mix of operations returns every block once caches are released."""
from __future__ import annotations

import random

import pytest

from executor_service.types import CacheRef, DecodeItem, UnifiedItem
from models.kv.block_allocator import BlockAllocator
from tandem.errors import KvCapacityExceeded, PositionMismatch, TandemError
from tests.executor_driver import make_executor


def test_allocator_refcounts():
    alloc = BlockAllocator(4)
    a = alloc.allocate(3)
    with pytest.raises(KvCapacityExceeded):
        alloc.allocate(2)
    assert alloc.num_free == 1  # a failed allocation takes nothing
    alloc.share(a[:2])
    alloc.free(a)
    assert alloc.num_free == 2  # two blocks still have a holder
    alloc.free(a[:2])
    assert alloc.num_free == 4
    with pytest.raises(ValueError):
        alloc.free([a[0]])


def test_random_operation_mix_returns_every_block(tiny_checkpoint):
    ex = make_executor(tiny_checkpoint("qwen3"), kv_blocks=24)
    total = ex.kv_usage().total_blocks
    rng = random.Random(0)
    live: dict[str, int] = {}  # cache id -> next token position
    errors = 0
    for _ in range(150):
        op = rng.choice(["prefill", "prefill", "decode", "unified", "truncate", "release", "verify", "bad"])
        try:
            if op == "prefill" or not live:
                res = ex.prefill([rng.randrange(3, 200) for _ in range(rng.randrange(1, 40))])
                live[res.cache.cache_id] = res.cache.seq_len
            elif op == "decode":
                cids = rng.sample(sorted(live), k=min(len(live), 3))
                steps = rng.randrange(1, 4)
                for d in ex.decode([DecodeItem(CacheRef(c, live[c]), 5) for c in cids], num_steps=steps):
                    if d.error is None:  # an item's own error (past the model's length) leaves it as it was
                        live[d.cache.cache_id] = d.cache.seq_len
                    errors += d.error is not None
            elif op == "unified":
                c = rng.choice(sorted(live))
                results = ex.unified_decode([UnifiedItem((7,) * rng.randrange(1, 20), c, live[c],
                                                         rng.random() < 0.5),
                                             UnifiedItem((8,) * rng.randrange(1, 20), None, 0, False)])
                for r in results:
                    if r.error is None:
                        live[r.cache.cache_id] = r.cache.seq_len
                    errors += r.error is not None
            elif op == "truncate":
                c = rng.choice(sorted(live))
                live[c] = ex.truncate_cache(c, rng.randrange(0, live[c] + 1)).seq_len
            elif op == "release":
                c = rng.choice(sorted(live))
                ex.release_cache([c])
                del live[c]
            elif op == "verify":
                c = rng.choice(sorted(live))
                live[c] = ex.forward_verify(CacheRef(c, live[c]), [9] * rng.randrange(1, 6)).cache.seq_len
            else:
                c = rng.choice(sorted(live))
                (bad,) = ex.decode([DecodeItem(CacheRef(c, live[c] + 1), 5)])  # wrong position: fails alone
                assert isinstance(bad.error, PositionMismatch) and bad.cache.seq_len == live[c]
                errors += 1
        except TandemError:
            errors += 1
        # Invariant after every operation: blocks held by live caches + free blocks == pool size.
        held = sum(len(ex._caches[c].table.blocks) for c in live)
        assert held + ex.kv_usage().free_blocks == total
        assert set(live) == set(ex._caches)
        for c, n in live.items():
            assert ex.cache_length(c) == n
            assert len(ex._caches[c].table.blocks) == -(-n // 16)
    assert errors > 0  # the mix did hit full pools and bad positions (call errors and item errors)
    ex.release_cache(list(live))
    assert ex.kv_usage().free_blocks == total and ex.kv_usage().active_caches == 0
