"""A prefix loaded back from the KV tiers (executor_service/kv/prefix_cache.py, _load_from_tiers) stops before a
block the pool already holds: with a sliding window a cache frees its early blocks while it still holds later
ones, so a parent can be evicted (and spilled) while its child stays in the pool. The copy loaded for that child
cannot be indexed (its hash is taken), and adopting an unindexed block would corrupt the allocator; the run the
lookup returns therefore ends there, and every block taken for the load goes back."""
from __future__ import annotations

import torch

from executor_service.kv.events.hub import KvEventHub
from executor_service.kv.tiers.config import KvTierConfig
from executor_service.kv.tiers.link import TierLink
from executor_service.kv.prefix_cache import PrefixCache
from models.kv.paged_cache import BlockTable, PagedKvCache
from tandem.block_hash import chain_hashes

BS = 4


def test_tier_run_stops_before_a_block_the_pool_holds():
    kv = PagedKvCache(1, 8, BS, 1, 2, torch.float32, torch.device("cpu"))
    cache = PrefixCache(kv, True, KvEventHub())
    cache.tiers = TierLink.open(kv, "test", KvTierConfig(host_gb=0.01))
    a = kv.allocator
    root = PrefixCache.root("", "", "")
    tokens = list(range(10, 10 + 3 * BS + 1))  # blocks A, B, C and one token more
    hashes = chain_hashes(root, tokens, BS, max_blocks=3)
    table = BlockTable()
    kv.reserve([(table, len(tokens))])
    table.length = len(tokens)
    kv.k[:, table.blocks[:3]] = torch.arange(3.0).view(1, 3, 1, 1, 1)  # each block's own contents
    cache.seal(table, tokens, root, "")
    kv.release(table)
    a.free(a.allocate(a.num_free))  # evicts A, B and C: they spill to the host tier
    assert a.lookup(hashes) == [] and all(cache.tiers.store.has(h) for h in hashes)
    loaded = cache.lookup(hashes)  # back into the pool (the tier keeps its copies)
    assert len(loaded) == 3
    b_block = loaded[1]
    a.pin([b_block])  # B stays held (a window's later block), the rest is free again
    a.free(a.allocate(a.num_free))  # evicts A and C
    # the tier has A, B and C; the pool has B: the loaded run is A alone
    assert a.lookup(hashes) == [] and a.lookup(hashes[1:2]) == [b_block]
    free_before = a.num_free
    blocks = cache.lookup(hashes)
    assert len(blocks) == 1 and a.is_indexed(blocks[0])
    assert torch.equal(kv.k[0, blocks[0]], torch.zeros_like(kv.k[0, blocks[0]]))  # A's contents, loaded
    adopted = BlockTable()
    kv.adopt(adopted, blocks, hashes[:1])  # raised KeyError when the run went on past B
    kv.release(adopted)
    a.free([b_block])
    assert a.num_free == free_before + 1  # nothing taken for the load is lost (B is free again too)
