"""The block allocator's prefix-cache index (models/kv/block_allocator.py) and the paged KV cache's use of it
(models/kv/paged_cache.py): eviction order, only unreferenced blocks evicted, register collisions, pinning a
cached free block, the removal callback, exact accounting, and copy-on-write of a shared block."""
from __future__ import annotations

import random

import pytest
import torch

from models.kv.block_allocator import BlockAllocator
from models.kv.paged_cache import BlockTable, PagedKvCache
from tandem.errors import KvCapacityExceeded


def h(n: int) -> bytes:
    return n.to_bytes(16, "little")


class Removed:
    """on_removed recorder."""

    def __init__(self) -> None:
        self.calls: list[list[bytes]] = []

    def __call__(self, hashes: list[bytes]) -> None:
        self.calls.append(list(hashes))


def check_accounting(a: BlockAllocator) -> None:
    held = sum(1 for b in range(a.num_blocks) if a.ref_count(b) > 0)
    assert held + a.num_free == a.num_blocks
    assert 0 <= a.num_cached <= a.num_free
    indexed_held = sum(1 for b in range(a.num_blocks) if a.ref_count(b) > 0 and a.is_indexed(b))
    assert a.num_indexed == indexed_held + a.num_cached == len(a.indexed())


def test_freed_chain_is_evicted_tail_first_after_plain_free_blocks():
    removed = Removed()
    a = BlockAllocator(6, on_removed=removed)
    chain = a.allocate(4)
    for i, b in enumerate(chain):
        assert a.register(b, h(i))
    a.free(reversed(chain))  # a table is freed last block first
    assert (a.num_free, a.num_cached, a.num_indexed) == (6, 4, 4)
    check_accounting(a)
    # The two never-cached free blocks go first: nothing evicted.
    plain = a.allocate(2)
    assert set(plain).isdisjoint(chain) and removed.calls == [] and a.evicted == 0
    # Then the chain, tail first: the head (shared by the most prompts) stays longest.
    assert a.allocate(1) == [chain[3]]
    assert removed.calls == [[h(3)]]
    assert a.allocate(2) == [chain[2], chain[1]]
    assert removed.calls == [[h(3)], [h(2), h(1)]]  # one call per allocation, in eviction order
    assert a.evicted == 3 and a.lookup([h(0), h(1)]) == [chain[0]]
    assert not a.is_indexed(chain[3]) and a.num_indexed == 1
    check_accounting(a)


def test_only_unreferenced_blocks_are_evicted():
    removed = Removed()
    a = BlockAllocator(4, on_removed=removed)
    held = a.allocate(2)
    a.register(held[0], h(0))
    a.register(held[1], h(1))
    other = a.allocate(2)
    a.register(other[0], h(2))
    a.free([other[0]])  # cached, evictable
    a.free([other[1]])  # plain free
    with pytest.raises(KvCapacityExceeded):
        a.allocate(3)  # only two blocks are free: held indexed blocks are never taken
    assert removed.calls == [] and a.num_free == 2  # a refused allocation takes and evicts nothing
    assert sorted(a.allocate(2)) == sorted(other)
    assert removed.calls == [[h(2)]]
    assert a.lookup([h(0), h(1)]) == held and all(a.ref_count(b) == 1 for b in held)
    check_accounting(a)


def test_lru_order_follows_use():
    a = BlockAllocator(3)
    blocks = a.allocate(3)
    for i, b in enumerate(blocks):
        a.register(b, h(i))
    a.free([blocks[0]])
    a.free([blocks[1]])
    a.free([blocks[2]])
    # blocks[0] is the least recently used; using it again (pin, free) makes blocks[1] the oldest.
    a.pin([blocks[0]])
    a.free([blocks[0]])
    assert a.allocate(1) == [blocks[1]]
    assert a.allocate(1) == [blocks[2]]


def test_register_collisions():
    a = BlockAllocator(4)
    x, y = a.allocate(2)
    assert a.register(x, h(7))
    assert not a.register(y, h(7))  # another block already holds the hash: the first one stays
    assert not a.is_indexed(y) and a.lookup([h(7)]) == [x]
    assert not a.register(x, h(8))  # a block is indexed under one hash only
    assert a.lookup([h(8)]) == []
    (z,) = a.allocate(1)
    a.free([z])
    with pytest.raises(ValueError):
        a.register(z, h(9))  # a free block holds nothing to index
    a.free([x, y])
    assert (a.num_cached, a.num_free) == (1, 4)  # y was never indexed: plain free
    check_accounting(a)


def test_lookup_stops_at_the_first_miss():
    a = BlockAllocator(4)
    blocks = a.allocate(3)
    for i, b in enumerate(blocks):
        a.register(b, h(i))
    assert a.lookup([h(0), h(1), h(2), h(3)]) == blocks
    assert a.lookup([h(0), h(5), h(2)]) == blocks[:1]
    assert a.lookup([h(5), h(0)]) == []


def test_pin_a_cached_free_block():
    removed = Removed()
    a = BlockAllocator(3, on_removed=removed)
    (b,) = a.allocate(1)
    a.register(b, h(1))
    a.free([b])
    assert (a.num_free, a.num_cached, a.ref_count(b)) == (3, 1, 0)
    a.pin(a.lookup([h(1)]))
    assert (a.num_free, a.num_cached, a.ref_count(b)) == (2, 0, 1)
    a.pin([b])  # a second holder (another cache matched the same prefix)
    assert a.ref_count(b) == 2
    assert b not in a.allocate(2) and removed.calls == []  # pinned: out of the eviction queue
    a.free([b])
    assert a.ref_count(b) == 1 and a.num_cached == 0
    a.free([b])
    assert a.num_cached == 1 and a.lookup([h(1)]) == [b]
    check_accounting(a)


def test_random_mix_keeps_exact_accounting():
    rng = random.Random(0)
    removed = Removed()
    a = BlockAllocator(12, on_removed=removed)
    tables: list[list[int]] = []
    next_hash = 0
    for _ in range(400):
        op = rng.choice(["alloc", "alloc", "register", "free", "pin", "share"])
        if op == "alloc":
            n = rng.randrange(1, 4)
            if a.can_allocate(n):
                tables.append(a.allocate(n))
            else:
                with pytest.raises(KvCapacityExceeded):
                    a.allocate(n)
        elif op == "register" and tables:
            t = rng.choice(tables)
            next_hash += 1
            a.register(rng.choice(t), h(next_hash))
        elif op == "free" and tables:
            a.free(reversed(tables.pop(rng.randrange(len(tables)))))
        elif op == "pin":
            found = a.lookup([rng.choice(a.indexed())]) if a.indexed() else []
            a.pin(found)
            if found:
                tables.append(found)
        elif op == "share" and tables:
            t = rng.choice(tables)
            a.share(t)
            tables.append(list(t))
        check_accounting(a)
        for t in tables:
            assert all(a.ref_count(b) > 0 for b in t)
    assert sum(len(c) for c in removed.calls) == a.evicted > 0
    for t in tables:
        a.free(reversed(t))
    assert a.num_free == a.num_blocks and a.num_cached == a.num_indexed
    check_accounting(a)


# ----------------------------------------------------------------------------- PagedKvCache
def kv_cache(num_blocks: int = 6) -> PagedKvCache:
    return PagedKvCache(num_layers=2, num_blocks=num_blocks, block_size=4, num_kv_heads=1, head_dim=2,
                        dtype=torch.float32, device=torch.device("cpu"))


def fill(kv: PagedKvCache, table: BlockTable, new_length: int) -> None:
    """reserve + write token t's K as the value t (all layers), as a forward would."""
    kv.reserve([(table, new_length)])
    for t in range(table.length, new_length):
        kv.k[:, table.blocks[t // 4], t % 4] = float(t)
        kv.v[:, table.blocks[t // 4], t % 4] = -float(t)
    table.length = new_length


def test_copy_on_write_of_a_shared_last_block():
    kv = kv_cache()
    a = BlockTable()
    fill(kv, a, 8)
    for i, b in enumerate(a.blocks):
        kv.allocator.register(b, h(i))
    a.hashes = [h(0), h(1)]
    b = BlockTable()
    kv.adopt(b, kv.allocator.lookup([h(0), h(1)]), [h(0), h(1)])
    assert b.blocks == a.blocks and b.length == 8 and all(kv.allocator.ref_count(x) == 2 for x in a.blocks)
    kv.truncate(b, 6)  # into the shared block 1: nothing freed, nothing copied yet
    assert b.blocks == a.blocks and b.hashes == [h(0)] and kv.copied_blocks == 0
    assert kv.blocks_needed(b, 7) == 1  # the private copy
    free_before = kv.allocator.num_free
    kv.reserve([(b, 7)])
    assert kv.copied_blocks == 1 and b.blocks[0] == a.blocks[0] and b.blocks[1] != a.blocks[1]
    assert kv.allocator.num_free == free_before - 1
    assert kv.allocator.ref_count(a.blocks[1]) == 1 and kv.allocator.is_indexed(a.blocks[1])
    assert torch.equal(kv.k[:, b.blocks[1]], kv.k[:, a.blocks[1]])  # the copy holds every layer's K and V
    assert torch.equal(kv.v[:, b.blocks[1]], kv.v[:, a.blocks[1]])
    kv.k[:, b.blocks[1], 2] = 99.0  # b writes position 6 in its copy
    assert (kv.k[:, a.blocks[1], 2] == 6.0).all()  # a's block is untouched
    # A private partial block is written in place: no further copy.
    b.length = 7
    kv.reserve([(b, 8)])
    assert kv.copied_blocks == 1
    kv.release(b)
    kv.release(a)
    assert kv.allocator.num_free == kv.num_blocks and kv.usage().cached_blocks == 2


def test_copy_on_write_when_the_pool_is_full():
    """The copy needs a block: a full pool refuses the growth before touching the table."""
    kv = kv_cache(num_blocks=2)
    a = BlockTable()
    fill(kv, a, 8)
    kv.allocator.register(a.blocks[1], h(1))
    kv.truncate(a, 6)
    with pytest.raises(KvCapacityExceeded):
        kv.reserve([(a, 7)])
    assert a.length == 6 and len(a.blocks) == 2 and kv.copied_blocks == 0


def test_truncate_and_release_free_the_tail_first():
    kv = kv_cache(num_blocks=4)
    t = BlockTable()
    fill(kv, t, 16)
    for i, b in enumerate(t.blocks):
        kv.allocator.register(b, h(i))
    t.hashes = [h(i) for i in range(4)]
    blocks = list(t.blocks)
    kv.truncate(t, 9)  # keeps 3 blocks (the third partly), hashes of the 2 full ones
    assert t.blocks == blocks[:3] and t.hashes == [h(0), h(1)] and t.length == 9
    kv.release(t)
    assert (t.blocks, t.hashes, t.length) == ([], [], 0)
    usage = kv.usage()
    assert usage.free_blocks == 4 and usage.cached_blocks == 4
    # eviction order: the tail of the chain first
    assert kv.allocator.allocate(4) == [blocks[3], blocks[2], blocks[1], blocks[0]]


def test_undo_copy_gives_back_the_original_unless_it_was_evicted():
    kv = kv_cache(num_blocks=4)
    t = BlockTable()
    fill(kv, t, 8)
    kv.allocator.register(t.blocks[1], h(1))
    kv.truncate(t, 6)
    original = t.blocks[1]
    kv.reserve([(t, 7)])  # a private copy; the original (held by no one else) is cached-evictable
    assert t.blocks[1] != original and kv.usage().cached_blocks == 1
    kv.undo_copy(t, original)  # the call failed: back to the original, the copy is free
    assert t.blocks[1] == original and kv.copied_blocks == 0
    assert (kv.usage().free_blocks, kv.usage().cached_blocks) == (2, 0)
    kv.undo_copy(t, original)  # nothing to undo
    assert t.blocks[1] == original and kv.usage().free_blocks == 2
    # The original evicted meanwhile (taken by another allocation): the copy, holding the same data, stays.
    kv.reserve([(t, 7)])
    copy = t.blocks[1]
    taken = kv.allocator.allocate(2)
    assert original in taken and not kv.allocator.is_indexed(original)
    kv.undo_copy(t, original)
    assert t.blocks[1] == copy and kv.copied_blocks == 1
    kv.allocator.free(taken)
    kv.release(t)
    assert kv.usage().free_blocks == 4
