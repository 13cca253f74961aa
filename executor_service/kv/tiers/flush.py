"""A clean stop keeps the pool's warm prefixes (docs/kv-transfer.md, 'Tiers'): after the last RPC, every block the
prefix cache indexes in the pool (and every host-tier block) that the disk tier lacks is written to it, so that
the restarted executor finds them; without this only blocks evicted before the stop would survive it.

Bounded by time (--kv-disk-flush-s: a stop must not hang on a slow disk) and by the tier's size (no more blocks
than it holds). Blocks are written most recently used first: a prompt's head blocks are freed last, so they are
the pool's most recent, and a flush cut short by its time bound still leaves whole prefixes (a tail without its
head never matches). Once written, the files are touched least recently used first, so that a restart's index
(ordered by mtime) evicts in the order the pool would have. A SIGKILL mid-flush loses only what was not written
yet: each file is written whole under a temporary name and renamed (executor_service/kv/tiers/disk.py), and a
restart drops the temporaries.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from executor_service.kv.block_bytes import read_blocks
from executor_service.kv.tiers.block_file import TierBlock
from executor_service.kv.tiers.link import LockFactory
from executor_service.kv.prefix_cache import PrefixCache

log = logging.getLogger("tandem.executor.kv_tier")
BATCH = 64  # blocks read out of the pool per hold of the model lock
_PROGRESS_S = 1.0  # how often a long flush logs its progress


@dataclass(frozen=True)
class FlushReport:
    """What a stop's flush did (logged; the tests read the log line)."""

    candidates: int  # blocks in the pool (indexed) and in the host tier
    on_disk: int  # of those, on disk already: nothing to write
    written: int  # written by this flush
    over_size: int  # left out: more than the tier holds
    over_time: int  # left out: the time bound passed first
    seconds: float


def flush_to_disk(prefix: PrefixCache, lock: LockFactory, budget_s: float,
                  clock: Callable[[], float] = time.monotonic) -> FlushReport | None:
    """Writes what the pool and the host tier hold and the disk tier lacks to the disk tier, within budget_s
    seconds; None when there is no disk tier or budget_s is 0. Call it after the server stopped taking RPCs, never
    holding the model lock (lock: a factory of it, taken per batch)."""
    tiers = prefix.tiers
    disk = tiers.store.disk if tiers is not None else None
    if tiers is None or disk is None or budget_s <= 0:
        return None
    start = clock()
    deadline = start + budget_s
    store = tiers.store
    store.flush(max(0.0, deadline - clock()))  # the evictions' spills still queued first: then `disk` is current
    with lock():
        pool = prefix.kv.allocator.indexed_by_recency()
    host = store.host.metas() if store.host is not None else []
    hashes = [b.hash for b in host] + pool  # least recently used first (the host tier's were evicted earlier)
    todo = [h for h in hashes if h not in disk]
    room = disk.max_bytes // _file_bytes(disk.data_bytes, prefix.kv.block_size)
    over_size = max(0, len(todo) - room)
    todo = todo[over_size:][::-1]  # the most recent ones that fit, most recent first
    log.info("stopping: writing %d KV blocks of the pool to the disk tier (%d there already%s), up to %.0fs",
             len(todo), len(hashes) - len(todo) - over_size,
             f", {over_size} left out: more than the tier's size" if over_size else "", budget_s)
    host_of = {b.hash: b for b in host}
    written_before, done, queued, last_log = disk.written, 0, [], clock()
    while done < len(todo) and clock() < deadline:
        batch = todo[done:done + BATCH]
        done += len(batch)
        with lock():  # the pool's blocks are read under the model lock (nothing runs now, but a reaper may)
            blocks = _collect(prefix, host_of, batch)
        n = store.write_through(blocks, deadline)
        queued.extend(b.hash for b in blocks[:n])
        if n < len(blocks):
            break
        if clock() - last_log >= _PROGRESS_S:
            last_log = clock()
            log.info("stopping: %d of %d KV blocks written to the disk tier", disk.written - written_before, len(todo))
    finished = store.flush(max(0.0, deadline - clock()))
    written = disk.written - written_before
    disk.touch([h for h in reversed(queued) if h in disk])  # least recently used first: the order a restart reopens
    report = FlushReport(len(hashes), len(hashes) - len(todo) - over_size, written, over_size,
                         len(todo) - written, clock() - start)
    log.info("stopping: %d KV blocks written to the disk tier in %.2fs, %d already there, %d left out (tier "
             "size), %d left out (--kv-disk-flush-s %.0fs%s)", report.written, report.seconds, report.on_disk,
             report.over_size, report.over_time, budget_s, "" if finished else ": the writer did not finish")
    return report


def _collect(prefix: PrefixCache, host_of: dict[bytes, TierBlock], hashes: list[bytes]) -> list[TierBlock]:
    """The blocks of hashes with their bytes: a host-tier block as it is, a pool block read out of the pool (one
    that left the pool since the listing is left out)."""
    in_pool = {h: found[0] for h in hashes if h not in host_of and (found := prefix.kv.allocator.lookup([h]))}
    data = dict(zip(in_pool, read_blocks(prefix.kv, list(in_pool.values()))))
    out: list[TierBlock] = []
    for h in hashes:
        if h in host_of:
            out.append(host_of[h])
        elif h in data:
            parent, adapter, tokens = prefix.block_meta(h)
            out.append(TierBlock(h, parent, adapter, tokens, data[h]))
    return out


def _file_bytes(data_bytes: int, block_size: int) -> int:
    """A block file's size (executor_service/kv/tiers/block_file.py's encode) with a parent and no adapter name:
    the tier's room, in blocks."""
    return 12 + 8 + 16 + 4 * block_size + data_bytes
