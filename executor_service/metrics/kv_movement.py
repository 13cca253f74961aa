"""The executor's Prometheus families for KV that moves (docs/kv-transfer.md): each tier's blocks and bytes,
its hits, writes, evictions, corrupt and missing files, refused writes, spills dropped, and ExportKv/ImportKv transfers (a seconds
histogram, bytes, finished and failed ones). Read when scraped from the counters the tiers (executor_service/kv/tiers/store.py) and the
transfers (executor_service/kv/transfer/pinned_export.py) keep; executor_service/metrics/prometheus.py yields them beside the others."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

if TYPE_CHECKING:
    from executor_service.kv.tiers.store import TierStats
    from executor_service.kv.transfer.pinned_export import TransferStats


def tier_metrics(tiers: "list[TierStats]", dropped: int) -> Iterator[Metric]:
    """tiers: one per configured tier (none: nothing is exported); dropped: spills the disk writer could not
    keep up with."""
    if not tiers:
        return
    medium = ["medium"]
    blocks = GaugeMetricFamily("tandem:executor_kv_tier_blocks", "Blocks held by the KV tier (medium CPU: host "
                               "memory, DISK: the disk tier).", labels=medium)
    size = GaugeMetricFamily("tandem:executor_kv_tier_bytes", "Bytes held by the KV tier (block files' size on "
                             "disk).", labels=medium)
    hits = CounterMetricFamily("tandem:executor_kv_tier_hits", "Blocks loaded back from the tier into the KV pool "
                               "(a prompt prefix that missed the pool).", labels=medium)
    written = CounterMetricFamily("tandem:executor_kv_tier_written_blocks", "Blocks the tier took (evicted from "
                                  "the pool and spilled there).", labels=medium)
    evicted = CounterMetricFamily("tandem:executor_kv_tier_evicted_blocks", "Blocks the tier dropped to stay "
                                  "within its size (least recently used first).", labels=medium)
    for t in tiers:
        blocks.add_metric([t.medium], t.blocks)
        size.add_metric([t.medium], t.bytes)
        hits.add_metric([t.medium], t.hits)
        written.add_metric([t.medium], t.written)
        evicted.add_metric([t.medium], t.evicted)
    yield from (blocks, size, hits, written, evicted)
    yield CounterMetricFamily("tandem:executor_kv_tier_corrupt_files", "Disk tier block files found truncated, "
                              "corrupt or not of this layout: never served, deleted.",
                              value=sum(t.corrupt for t in tiers))
    disk = [t for t in tiers if t.medium == "DISK"]
    if disk:
        yield CounterMetricFamily("tandem:executor_kv_tier_read_bytes", "Bytes of disk tier block files loaded "
                                  "back.", value=disk[0].read_bytes)
        yield CounterMetricFamily("tandem:executor_kv_tier_read_seconds", "Time spent reading and checking them "
                                  "(the read bandwidth is the ratio of the two).", value=disk[0].read_seconds)
        yield CounterMetricFamily("tandem:executor_kv_tier_write_errors", "Evicted blocks not written to the disk "
                                  "tier because the disk refused (full, read-only, I/O error): the failed write "
                                  "and those skipped while writes were stopped.", value=disk[0].write_errors)
        yield GaugeMetricFamily("tandem:executor_kv_tier_disk_writable", "1 while the disk tier writes, 0 while "
                                "its writes are stopped by a refused write (retried every second).",
                                value=int(disk[0].writable))
        yield CounterMetricFamily("tandem:executor_kv_tier_missing_files", "Disk tier block files found deleted "
                                  "under the executor (a miss: dropped from the index, recomputed).",
                                  value=disk[0].missing)
    yield CounterMetricFamily("tandem:executor_kv_tier_dropped_spills", "Evicted blocks not written to the disk "
                              "tier: its writer was too far behind.", value=dropped)


def transfer_metrics(stats: "dict[str, TransferStats]") -> Iterator[Metric]:
    """stats: per direction, "export" (this executor the source) and "import" (it pulled from a peer)."""
    direction = ["direction"]
    seconds = HistogramMetricFamily("tandem:executor_kv_transfer_duration_seconds", "Time of one finished KV "
                                    "transfer (ExportKv stream, or ImportKv from the pull to the new cache).",
                                    labels=direction)
    nbytes = CounterMetricFamily("tandem:executor_kv_transfer_bytes", "KV block bytes sent (export) or received "
                                 "(import), failed transfers' included.", labels=direction)
    done = CounterMetricFamily("tandem:executor_kv_transfers", "KV transfers finished.", labels=direction)
    failed = CounterMetricFamily("tandem:executor_kv_transfer_failures", "KV transfers that ended before their "
                                 "last block (refused, peer gone, cancelled): nothing kept.", labels=direction)
    active = GaugeMetricFamily("tandem:executor_kv_transfers_active", "KV transfers under way (an export pins its "
                               "blocks until it ends).", labels=direction)
    for d, s in sorted(stats.items()):
        s.seconds.add_to(seconds, [d])
        nbytes.add_metric([d], s.bytes)
        done.add_metric([d], s.finished)
        failed.add_metric([d], s.failed)
        active.add_metric([d], s.active)
    yield from (seconds, nbytes, done, failed, active)
