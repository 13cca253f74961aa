"""The scheduler's counters for KV that moves between executors (live migration, prefill -> decode) and for the
tokens computed again where it did not: counted by the fleet's migrations (scheduler/fleet/kv_migration.py) and by
the request streams (a request re-admitted after its cache was lost), through SchedulerMetrics' hooks,
exported by scheduler/metrics.py's registry. The event loop is the one writer; a scrape only reads."""
from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from tandem.histogram import SingleWriterHistogram

# One transfer: a cache of a few blocks on a loopback link (~ms) to a long prompt's cache across hosts (~s).
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class KvMoveCounters:
    def __init__(self) -> None:
        self.transfer_bytes = 0  # KV bytes the importers reported taking (ImportKvResponse.bytes)
        self.transfer_failures = 0  # transfers that failed (the request was recomputed instead)
        self.migrated = 0  # requests that moved with their KV to another executor
        self.recomputed_tokens = 0  # tokens computed again because a request's KV was lost or not moved
        self.transfer_s = SingleWriterHistogram(TRANSFER_BUCKETS)


class KvMoveCollector(Collector):
    def __init__(self, counters: KvMoveCounters) -> None:
        self.c = counters

    def collect(self) -> Iterator[Metric]:
        c = self.c
        # (prometheus_client adds _total to a counter's name: these are exported as tandem:..._total)
        yield CounterMetricFamily("tandem:kv_transfer_bytes", "KV bytes moved between executors (ImportKv: the "
                                  "importer pulls them from the source; the scheduler never relays them).",
                                  value=c.transfer_bytes)
        yield CounterMetricFamily("tandem:kv_transfer_failures", "KV transfers that failed; each such request "
                                  "was recomputed where it went instead.", value=c.transfer_failures)
        yield CounterMetricFamily("tandem:requests_migrated", "Requests that moved to another executor with their "
                                  "KV (a draining executor's, or prefill -> decode) and continued there.",
                                  value=c.migrated)
        yield CounterMetricFamily("tandem:tokens_recomputed", "Tokens computed again because a request's KV was "
                                  "lost (an executor lost, a failed transfer, a preemption) rather than moved.",
                                  value=c.recomputed_tokens)
        yield c.transfer_s.add_to(HistogramMetricFamily(
            "tandem:kv_transfer_seconds", "Time of one KV transfer (ImportKv call), in seconds."))
