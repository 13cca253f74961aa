"""A Prometheus histogram for a hot path with one writer: observe() is a bisect and two additions, no lock.

prometheus_client's Histogram takes a lock per observation (~10x the cost). Here the writer is a single thread
(the executor's forwards run one at a time; the scheduler's requests report from its event loop) and a scrape,
from another thread, copies the counts (one C-level list copy: atomic under the GIL). A scrape may see the
sum without the observation in progress, never inconsistent counts.
"""
from __future__ import annotations

import bisect

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString


class SingleWriterHistogram:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = tuple(sorted(bounds))
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # the first bound >= value: `le` semantics
        self.sum += value

    def add_to(self, family: HistogramMetricFamily, labels: list[str] | None = None) -> HistogramMetricFamily:
        """Adds this histogram's series (cumulative buckets, sum) to family; returns family."""
        counts, total, running = list(self.counts), self.sum, 0
        buckets = []
        for bound, n in zip((*self.bounds, float("inf")), counts):
            running += n
            buckets.append((floatToGoString(bound), running))
        family.add_metric(labels or [], buckets, total)
        return family
