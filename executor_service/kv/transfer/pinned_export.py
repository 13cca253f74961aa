"""Moving KV blocks between executors, the in-process half (docs/kv-transfer.md): an export pins blocks (a
cache's, or the prefix cache's for a chain of hashes) and hands out their bytes in bounded chunks; an import
takes the blocks a header announces, writes the chunks into them as they come and, once every block arrived
and checked, makes them a cache (or prefix cache entries); a cache's image spans travel in the header
(executor_service/kv/transfer/image_spans.py). The network half, which pulls an export from another
executor, is executor_service/kv/transfer/client.py; the RPCs are in executor_service/rpc/servicer.py.

Locking: every step that touches the pool or the block accounting holds the executor's model lock as a control
operation (short: a copy of one chunk), never across a network wait, so a transfer never stalls decoding for
longer than a chunk's copy. Pinned blocks (refcount + 1) cannot be evicted or reused while a transfer holds
them; a transfer that ends any way (done, failed, cancelled, its peer killed) gives them back exactly once.
Import is all or nothing: on any failure every block it took is freed and no cache or index entry is left.
"""
from __future__ import annotations

import threading
import time
from array import array
from dataclasses import dataclass, field
from typing import ContextManager, Iterable, Iterator, Protocol, Sequence

from executor_service.adapters import AdapterRegistry
from executor_service.kv.cache_table import CacheState, CacheTable
from executor_service.kv.block_bytes import block_nbytes, crc32c, read_blocks, write_blocks
from executor_service.kv.fingerprint import differences
from executor_service.kv.transfer.image_spans import TransferImage, adopt_images, check_images, images_of
from executor_service.kv.prefix_cache import PrefixCache
from models.config import ModelConfig
from models.kv.paged_cache import PagedKvCache
from tandem.block_hash import block_hash, image_extra
from tandem.ceil_div import ceil_div
from tandem.histogram import SingleWriterHistogram
from tandem.errors import (BlocksNotCached, CacheStateConflict, DataLoss, InvalidRequest, KvCapacityExceeded,
                           Unsupported)

DEFAULT_CHUNK_BYTES = 4 << 20
MAX_CHAIN = 4096  # hashes an ExportKvRequest may name
# Seconds of one transfer, first chunk to last: from a few blocks on loopback to a long prompt over a slow link.
TRANSFER_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                            60.0, 120.0)
DIRECTIONS = ("export", "import")


class TransferHost(Protocol):
    """What a transfer uses of the executor (executor.py)."""

    kv: PagedKvCache
    prefix: PrefixCache
    adapters: AdapterRegistry
    model_config: ModelConfig

    def control_op(self, name: str, session: str | None = None) -> ContextManager[None]: ...

    def cache_table(self, session: str) -> CacheTable: ...

    def new_cache_state(self, adapter: str) -> CacheState: ...


@dataclass(frozen=True)
class TransferHeader:
    fingerprint: str
    block_size: int
    num_tokens: int
    token_ids: tuple[int, ...]
    adapter: str
    num_blocks: int
    images: tuple[TransferImage, ...] = ()  # the cache's image spans (executor_service/kv/transfer/image_spans.py)
    # True: images lists every image the blocks show; False from an older exporter, and for a chain of hashes
    # (the prefix cache keeps no spans): the importer then refuses tokens holding the image token
    images_listed: bool = True


@dataclass(frozen=True)
class BlockPayload:
    hash: bytes  # b"" for a partial last block
    index: int
    num_tokens: int
    data: bytes
    crc: int


@dataclass(frozen=True)
class ImportResult:
    cache_id: str
    num_tokens: int
    blocks_imported: int
    bytes: int


@dataclass(frozen=True)
class TransferStats:
    """Counters of one direction (export or import) since start, for the metrics."""

    finished: int  # transfers that completed
    failed: int  # transfers that ended any other way (refused, peer gone, cancelled)
    bytes: int  # block bytes sent (export) or received (import), failed transfers' included
    active: int  # transfers under way now
    seconds: SingleWriterHistogram  # of the finished ones (read-only for the caller)


@dataclass
class _Export:
    header: TransferHeader
    blocks: list[int]  # pool blocks pinned for this export, in index order
    hashes: list[bytes]  # hashes[i] of blocks[i] (b"" for a partial last block)
    counts: list[int]  # tokens per block
    closed: bool = False


class KvTransfer:
    """Exports and imports of one executor. `active_exports` counts exports still pinning blocks."""

    def __init__(self, ex: TransferHost, fingerprint: str) -> None:
        self.ex = ex
        self.fingerprint = fingerprint
        self._guard = threading.Lock()
        self.active_exports = self.active_imports = 0
        self.exports = self.imports = 0
        self.export_failures = self.import_failures = 0
        self.bytes_out = self.bytes_in = 0
        # seconds per finished transfer; observed under _guard, so one writer at a time (tandem/histogram.py)
        self.seconds = {d: SingleWriterHistogram(TRANSFER_SECONDS_BUCKETS) for d in DIRECTIONS}

    def stats(self) -> dict[str, TransferStats]:
        """Per direction ("export", "import")."""
        with self._guard:
            return {"export": TransferStats(self.exports, self.export_failures, self.bytes_out, self.active_exports,
                                            self.seconds["export"]),
                    "import": TransferStats(self.imports, self.import_failures, self.bytes_in, self.active_imports,
                                            self.seconds["import"])}

    # ----------------------------------------------------------------- export
    def export(self, cache_id: str, hashes: Sequence[bytes], session: str,
               max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               accept_images: bool = False) -> Iterator[tuple[TransferHeader | None, list[BlockPayload]]]:
        """(header, blocks) for the first chunk, (None, blocks) after. The generator pins on its first step and
        unpins when it ends or is closed; close() it (or let it finish) to give the blocks back. accept_images:
        the importer builds the header's image spans (else a cache showing images is refused: Unsupported)."""
        if bool(cache_id) == bool(hashes):
            raise InvalidRequest("ExportKv needs exactly one of cache_id and block_hashes")
        if len(hashes) > MAX_CHAIN:
            raise InvalidRequest(f"ExportKv names {len(hashes)} block hashes; at most {MAX_CHAIN}")
        start = time.perf_counter()
        exp = self._pin_cache(cache_id, session, accept_images) if cache_id else self._pin_chain(hashes)
        per_chunk = max(1, max_chunk_bytes // block_nbytes(self.ex.kv))
        done = False
        try:
            first = True
            for lo in range(0, max(1, len(exp.blocks)), per_chunk):
                part = range(lo, min(lo + per_chunk, len(exp.blocks)))
                with self.ex.control_op("export_kv"):
                    data = read_blocks(self.ex.kv, [exp.blocks[i] for i in part])
                payloads = [BlockPayload(exp.hashes[i], i, exp.counts[i], d, crc32c(d)) for i, d in zip(part, data)]
                with self._guard:
                    self.bytes_out += sum(len(d) for d in data)
                yield (exp.header if first else None), payloads
                first = False
            with self._guard:
                self.exports += 1
                self.seconds["export"].observe(time.perf_counter() - start)
            done = True
        finally:
            self._unpin(exp, failed=not done)  # not done: refused mid-way, or the importer went away (closed)

    def _pin_cache(self, cache_id: str, session: str, accept_images: bool) -> _Export:
        with self.ex.control_op("export_kv", session):
            state = self.ex.cache_table(session).get(cache_id)
            table, bs = state.table, self.ex.kv.block_size
            if table.dropped:
                raise Unsupported(f"cache {cache_id!r} has slid past its first blocks (sliding window): its KV "
                                  "cannot be exported whole")
            images = images_of(cache_id, state, accept_images)
            blocks = list(table.blocks)
            self.ex.kv.allocator.share(blocks)
            n = table.length
            counts = [min(bs, n - i * bs) for i in range(len(blocks))]
            hashes = [table.hashes[i] if i < len(table.hashes) else b"" for i in range(len(blocks))]
            header = TransferHeader(self.fingerprint, bs, n, tuple(state.tokens[:n]), state.adapter, len(blocks),
                                    images)
            return self._opened(_Export(header, blocks, hashes, counts))

    def _pin_chain(self, hashes: Sequence[bytes]) -> _Export:
        with self.ex.control_op("export_kv"):
            prefix, bs = self.ex.prefix, self.ex.kv.block_size
            blocks = prefix.lookup(list(hashes)) if prefix.enabled else []
            if not blocks:
                raise BlocksNotCached(f"none of the {len(hashes)} block hashes is cached here")
            self.ex.kv.allocator.pin(blocks)
            found = list(hashes[:len(blocks)])
            tokens: list[int] = []
            adapter = prefix.block_meta(found[0])[1]
            for h in found:
                tokens.extend(array("I", prefix.block_meta(h)[2]))
            header = TransferHeader(self.fingerprint, bs, len(tokens), tuple(tokens), adapter, len(blocks),
                                    images_listed=False)
            return self._opened(_Export(header, blocks, found, [bs] * len(blocks)))

    def _opened(self, exp: _Export) -> _Export:
        with self._guard:
            self.active_exports += 1
        return exp

    def _unpin(self, exp: _Export, failed: bool) -> None:
        with self._guard:
            if exp.closed:
                return
            exp.closed = True
        with self.ex.control_op("export_kv"):
            self.ex.kv.allocator.free(reversed(exp.blocks))
        with self._guard:  # no longer active and failed in one step: a scrape never sees one without the other
            self.active_exports -= 1
            self.export_failures += failed

    # ----------------------------------------------------------------- import
    def import_(self, chunks: Iterable[tuple[TransferHeader | None, list[BlockPayload]]], create_cache: bool,
                session: str) -> ImportResult:
        """Takes the blocks of an export (the chunks as export() yields them, usually from another executor).
        Raises, having kept nothing: CacheStateConflict (fingerprint or layout mismatch), DataLoss (checksum,
        a missing or out-of-order block), KvCapacityExceeded, and whatever the chunk source raises (the
        network: Unavailable)."""
        start = time.perf_counter()
        with self._guard:
            self.active_imports += 1
        failed = True
        try:
            result = self._import(chunks, create_cache, session, start)
            failed = False
            return result
        finally:
            with self._guard:  # (as _unpin: the two move together)
                self.active_imports -= 1
                self.import_failures += failed

    def _import(self, chunks: Iterable[tuple[TransferHeader | None, list[BlockPayload]]], create_cache: bool,
                session: str, start: float) -> ImportResult:
        it = iter(chunks)
        header, first = next(it, (None, []))
        if header is None:
            raise DataLoss("the export stream ended before its header")
        plan = self._take(header, create_cache, session)
        received = 0
        try:
            pending = first
            while True:
                received += self._write(plan, pending)
                nxt = next(it, None)
                if nxt is None:
                    break
                pending = nxt[1]
            if plan.next_index != len(plan.wanted):
                raise DataLoss(f"the export stream ended after {plan.next_index} of {len(plan.wanted)} blocks")
            result = self._finish(plan, create_cache, session, received)
        except BaseException:
            self._drop(plan)
            with self._guard:
                self.bytes_in += received
            raise
        with self._guard:
            self.imports += 1
            self.bytes_in += received
            self.seconds["import"].observe(time.perf_counter() - start)
        return result

    def _take(self, header: TransferHeader, create_cache: bool, session: str) -> "_Plan":
        ex, bs = self.ex, self.ex.kv.block_size
        diff = differences(self.fingerprint, header.fingerprint)
        if diff:
            raise CacheStateConflict(f"the source's KV is not compatible with this executor's: {diff}")
        if header.block_size != bs or header.num_blocks != ceil_div(header.num_tokens, bs) \
                or len(header.token_ids) != header.num_tokens:
            raise DataLoss(f"inconsistent export header: {header.num_tokens} tokens, {len(header.token_ids)} token "
                           f"ids, {header.num_blocks} blocks of {header.block_size}")
        if header.num_tokens > ex.model_config.max_position_embeddings:
            raise InvalidRequest(f"the export holds {header.num_tokens} tokens; this model takes at most "
                                 f"{ex.model_config.max_position_embeddings}")
        if any(t >= ex.model_config.vocab_size for t in header.token_ids):
            raise InvalidRequest("the export's token ids are outside this model's vocabulary")
        check_images(header.images, header.images_listed, header.token_ids, ex.model_config)
        if create_cache and not header.num_tokens:
            raise InvalidRequest("the export holds no tokens: nothing to make a cache of")
        wanted = header.num_blocks if create_cache else header.num_tokens // bs
        with ex.control_op("import_kv", session):
            if header.adapter:
                ex.adapters.get(header.adapter)  # AdapterNotFound: load it here first
            plan = _Plan(header, wanted=[-1] * wanted)
            if not ex.kv.allocator.can_allocate(wanted):
                raise KvCapacityExceeded(wanted, ex.kv.allocator.num_free, ex.kv.num_blocks)
            plan.wanted = ex.kv.allocator.allocate(wanted)
        return plan

    def _write(self, plan: "_Plan", payloads: list[BlockPayload]) -> int:
        bs, n = self.ex.kv.block_size, plan.header.num_tokens
        keep: list[tuple[int, bytes]] = []
        nbytes = 0
        for p in payloads:
            if p.index != plan.next_index:
                raise DataLoss(f"block {p.index} arrived where block {plan.next_index} was due")
            if crc32c(p.data) != p.crc:
                raise DataLoss(f"block {p.index}: its CRC-32C does not match its data (corrupted in transit or at "
                               "the source)")
            expect = min(bs, n - p.index * bs)
            if p.num_tokens != expect or (expect == bs) != bool(p.hash):
                raise DataLoss(f"block {p.index} holds {p.num_tokens} tokens, {expect} expected")
            plan.hashes.append(p.hash)
            plan.next_index += 1
            nbytes += len(p.data)
            if p.index < len(plan.wanted):
                keep.append((plan.wanted[p.index], p.data))
        if keep:
            with self.ex.control_op("import_kv"):
                write_blocks(self.ex.kv, [b for b, _ in keep], [d for _, d in keep])
        return nbytes

    def _finish(self, plan: "_Plan", create_cache: bool, session: str, received: int) -> ImportResult:
        ex, h = self.ex, plan.header
        bs = ex.kv.block_size
        full = [x for x in plan.hashes if x]
        spans = [(im.offset, im.length, im.content_hash) for im in h.images]
        for i in range(1, len(full)):  # the chain must hold together (a source bug must not poison the index)
            extra = image_extra(spans, i * bs, (i + 1) * bs) if spans else b""
            if block_hash(full[i - 1], h.token_ids[i * bs:(i + 1) * bs], extra) != full[i]:
                raise DataLoss(f"block {i}'s hash does not chain from block {i - 1}'s and its tokens")
        with ex.control_op("import_kv", session):
            registered = ex.prefix.adopt_imported(plan.wanted[:len(full)], full, h.token_ids, h.adapter)
            if not create_cache:
                ex.kv.allocator.free(reversed(plan.wanted))
                plan.wanted = []
                return ImportResult("", len(full) * bs, registered, received)
            state: CacheState = ex.new_cache_state(h.adapter)
            state.table.blocks = list(plan.wanted)
            state.table.hashes = list(full) if ex.prefix.enabled else []
            state.table.length = h.num_tokens
            state.tokens = list(h.token_ids)
            state.prompt_len = h.num_tokens
            adopt_images(state, h.images)
            cache_id = ex.cache_table(session).add(state)
            plan.wanted = []
            return ImportResult(cache_id, h.num_tokens, len(state.table.blocks), received)

    def _drop(self, plan: "_Plan") -> None:
        if plan.wanted:
            with self.ex.control_op("import_kv"):
                self.ex.kv.allocator.free(reversed(plan.wanted))
            plan.wanted = []


@dataclass
class _Plan:
    header: TransferHeader
    wanted: list[int]  # pool blocks taken for the blocks to keep (index order); [] once handed over or freed
    hashes: list[bytes] = field(default_factory=list)  # of the blocks received so far
    next_index: int = 0
