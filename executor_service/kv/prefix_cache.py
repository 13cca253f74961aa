"""Automatic prefix caching: the executor's side of the block-hash index (models/kv/block_allocator.py).

Every full block a forward completes is hashed (tandem/block_hash.py: chained from its parent block, the
cache's root of adapter, adapter weights digest and cache salt) and registered, so that CreateCache can
start a new cache with the longest cached prefix of its prompt. Registering and evicting publish KV events
(executor_service/kv/events/hub.py) for routers. With prefix caching off nothing is hashed and nothing matches.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Sequence

from executor_service.kv.events.hub import BlocksRemoved, BlocksStored, KvEvent, KvEventHub
from executor_service.kv.tiers.link import TierLink
from executor_service.kv.prompt_logprob_store import PromptLogprobStore
from models.kv.paged_cache import BlockTable, PagedKvCache
from tandem.block_hash import ImageSpan, block_hash, chain_hashes, image_extra, root_hash


@dataclass(frozen=True)
class PrefixCacheStats:
    enabled: bool
    query_tokens: int  # prompt tokens looked up (CreateCache)
    hit_tokens: int  # of those, served from cached blocks
    stored_blocks: int  # blocks registered since start
    evicted_blocks: int
    indexed_blocks: int  # in the index now (held or evictable)
    copied_blocks: int  # copy-on-write copies of indexed blocks


class PrefixCache:
    def __init__(self, kv: PagedKvCache, enabled: bool, events: KvEventHub) -> None:
        self.kv = kv
        self.enabled = enabled
        self.events = events
        self.query_tokens = 0
        self.hit_tokens = 0
        self.stored_blocks = 0
        # hash -> (parent hash, adapter, token ids as uint32 bytes) of every indexed block: what a new
        # subscriber's snapshot needs (packed: 4 bytes a token, not a tuple of int objects)
        self._meta: dict[bytes, tuple[bytes, str, bytes]] = {}
        self.logprobs = PromptLogprobStore()  # prompt logprobs beside indexed blocks (executor_service/kv/prompt_logprob_store.py)
        self.tiers: TierLink | None = None  # host/disk tiers evicted blocks go to (executor_service/kv/tiers/link.py)
        self._block_of: dict[bytes, int] = {}  # hash -> pool block of every indexed block (for spilling)
        kv.allocator.on_removed = self._removed

    @staticmethod
    def root(adapter: str, adapter_digest: str, cache_salt: str) -> bytes:
        return root_hash(adapter, adapter_digest, cache_salt)

    def match(self, table: BlockTable, token_ids: Sequence[int], root: bytes,
              prompt_logprobs: int | None = None, images: Sequence[ImageSpan] = ()) -> int:
        """Fills the empty table with the longest indexed prefix of token_ids, in whole blocks, leaving at
        least one token to compute; the blocks are pinned at once. Returns the tokens reused. prompt_logprobs:
        only blocks whose prompt logprobs are stored with that many alternatives (executor_service/kv/prompt_logprob_store.py).

        A prompt whose every block is indexed (its length a multiple of the block size) reuses all but its last
        token: the table holds its last block too, one token short, and the forward that writes that token
        writes into a private copy of it (copy-on-write, PagedKvCache.reserve). Without this, such a prompt
        recomputed a whole block to get one position's logits: a burst of cached 256-token prompts ran 16
        tokens per request where 1 does (docs/performance.md, 'A burst of cached prompts')."""
        if not self.enabled or not token_ids:
            return 0
        bs = self.kv.block_size
        whole = prompt_logprobs is None and len(token_ids) % bs == 0  # the last block may be reused too
        hashes = chain_hashes(root, token_ids, bs, max_blocks=len(token_ids) // bs if whole
                              else (len(token_ids) - 1) // bs, images=images)
        blocks = self.kv.allocator.lookup(hashes)
        if self.tiers is not None and prompt_logprobs is None and len(blocks) < len(hashes):
            blocks = self._load_from_tiers(hashes, blocks)
        if prompt_logprobs is not None:
            blocks = blocks[:self.logprobs.covered(hashes[:len(blocks)], prompt_logprobs)]
        self.kv.adopt(table, blocks, hashes[:len(blocks)])
        reused = len(blocks) * bs
        if reused == len(token_ids):  # every block: keep the last token to compute (its logits are wanted)
            reused -= 1
            table.length = reused
            del table.hashes[reused // bs:]  # (a table's hashes are of its full blocks only)
        self.query_tokens += len(token_ids)
        self.hit_tokens += reused
        return reused

    def seal(self, table: BlockTable, tokens: Sequence[int], root: bytes, adapter: str,
             images: Sequence[ImageSpan] = ()) -> None:
        """Hashes and registers the blocks of table that became full since the last call. tokens: every
        token the table holds (tokens[i] is at position i); images: the spans of the images it shows (a block
        that overlaps one is keyed by its hash too)."""
        if not self.enabled:
            return
        bs = self.kv.block_size
        entries = []
        for i in range(len(table.hashes), table.length // bs):
            parent = table.hashes[i - 1] if i else root
            ids = tokens[i * bs:(i + 1) * bs]
            h = block_hash(parent, ids, image_extra(images, i * bs, (i + 1) * bs) if images else b"")
            table.hashes.append(h)
            entries.append((table.blocks[i], h, b"" if i == 0 else parent, array("I", ids).tobytes()))
        self._index(entries, adapter)

    def block_meta(self, h: bytes) -> tuple[bytes, str, bytes]:
        """(parent hash, adapter, token ids as uint32 bytes) of an indexed block."""
        return self._meta[h]

    def adopt_imported(self, blocks: Sequence[int], hashes: Sequence[bytes], token_ids: Sequence[int],
                       adapter: str) -> int:
        """Indexes full blocks written from elsewhere (an import, a tier), held by the caller: blocks[i] holds
        hashes[i], chained from hashes[i - 1], with tokens token_ids[i * block_size:]. Returns how many were
        indexed (not those whose hash another block holds already). Nothing with prefix caching off."""
        if not self.enabled:
            return 0
        bs = self.kv.block_size
        entries = [(b, h, hashes[i - 1] if i else b"", array("I", token_ids[i * bs:(i + 1) * bs]).tobytes())
                   for i, (b, h) in enumerate(zip(blocks, hashes))]
        return len(self._index(entries, adapter))

    def snapshot(self) -> list[KvEvent]:
        """Every indexed block, then every block of the tiers, as stored events (one per block: their chains may
        interleave)."""
        bs = self.kv.block_size
        out: list[KvEvent] = []
        for h in self.kv.allocator.indexed():
            parent, adapter, ids = self._meta[h]
            out.append(BlocksStored((h,), parent, adapter, bs, tuple(array("I", ids))))
        if self.tiers is not None:  # and what the host and disk tiers hold, with their medium
            out.extend(self.tiers.snapshot())
        return out

    def stats(self) -> PrefixCacheStats:
        a = self.kv.allocator
        return PrefixCacheStats(self.enabled, self.query_tokens, self.hit_tokens, self.stored_blocks, a.evicted,
                                a.num_indexed, self.kv.copied_blocks)

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The pool blocks of the longest cached run of hashes, the tiers' blocks loaded into the pool (not
        pinned)."""
        blocks = self.kv.allocator.lookup(hashes)
        if self.tiers is not None and len(blocks) < len(hashes):
            blocks = self._load_from_tiers(hashes, blocks)
        return blocks

    def _load_from_tiers(self, hashes: list[bytes], blocks: list[int]) -> list[int]:
        """blocks (the pool's run of hashes) continued with what the tiers hold of the hashes after them, loaded
        into newly taken pool blocks and indexed; as many as the pool has room for."""
        a = self.kv.allocator
        a.pin(blocks)  # loading takes blocks: the run found so far must not be evicted for them
        try:
            found = self.tiers.load(hashes[len(blocks):])[:a.num_free]
            if not found:
                return blocks
            taken = a.allocate(len(found))
            self.tiers.write(taken, found)
            indexed = set(self._index([(b, t.hash, t.parent, t.token_ids) for b, t in zip(taken, found)],
                                      found[0].adapter))
            # the run ends before a block the pool holds already (its child outlived an evicted parent): that
            # copy is not indexed, and adopt pins indexed blocks only
            run = next((i for i, t in enumerate(found) if t.hash not in indexed), len(found))
            a.free(reversed(taken))  # back to free-but-cached (the indexed ones): adopt pins them with the rest
            return blocks + taken[:run]
        finally:
            a.free(reversed(blocks))

    def _index(self, entries: list[tuple[int, bytes, bytes, bytes]], adapter: str) -> list[bytes]:
        """Indexes full blocks whose contents are known: (pool block, hash, parent hash (b"" for a chain's first
        block), token ids as uint32 bytes), skipping a hash another block holds already; counts them and
        publishes BlocksStored. Returns the hashes indexed."""
        stored = []
        for b, h, parent, ids in entries:
            if self.kv.allocator.register(b, h):
                self._block_of[h] = b
                self._meta[h] = (parent, adapter, ids)
                stored.append(h)
        self.stored_blocks += len(stored)
        if stored and self.events.active:
            # the blocks chain unless another cache registered one of them first: then each run is its own
            # event (an event's hashes chain from one parent)
            bs = self.kv.block_size
            for run in _runs(stored, self._meta):
                ids = tuple(t for h in run for t in array("I", self._meta[h][2]))
                self.events.publish(BlocksStored(tuple(run), self._meta[run[0]][0], adapter, len(run) * bs, ids))
        return stored

    def _removed(self, hashes: list[bytes]) -> None:
        if self.events.active:  # first: a consumer that ignores `medium` then keeps what the tiers announce next
            self.events.publish(BlocksRemoved(tuple(hashes)))
        if self.tiers is not None:
            self.tiers.spill([(h, self._block_of[h], self._meta[h]) for h in hashes if h in self._block_of])
        for h in hashes:
            self._block_of.pop(h, None)
        self.logprobs.forget(hashes)
        for h in hashes:
            self._meta.pop(h, None)


def _runs(stored: list[bytes], meta: dict[bytes, tuple[bytes, str, bytes]]) -> list[list[bytes]]:
    """stored split where a block's parent is not the block before it."""
    runs: list[list[bytes]] = []
    for h in stored:
        if runs and meta[h][0] == runs[-1][-1]:
            runs[-1].append(h)
        else:
            runs.append([h])
    return runs
