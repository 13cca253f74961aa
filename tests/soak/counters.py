"""What the fleet's own Prometheus counters say happened during `scripts/soak --all` (disk-tier hits and corrupt files
caught, KV moved between executors, requests migrated or recomputed, streams stopped for a stalled reader), summed
over every process instance: each is read just before the soak signals it, and the live ones at the end (a counter
restarts at 0 with its process)."""
from __future__ import annotations

import collections

import httpx
from prometheus_client.parser import text_string_to_metric_families

EXECUTOR = ("tandem:executor_kv_tier_hits", "tandem:executor_kv_tier_written_blocks",
            "tandem:executor_kv_tier_corrupt_files", "tandem:executor_kv_transfers")
SCHEDULER = ("tandem:stream_stalls", "tandem:requests_migrated", "tandem:tokens_recomputed",
             "tandem:kv_transfer_failures", "tandem:scheduler_executor_losses", "tandem:num_preemptions")


def scrape(url: str, names: tuple[str, ...]) -> collections.Counter:
    """The counters `names` (summed over their labels) from GET url; empty if the process does not answer."""
    out: collections.Counter = collections.Counter()
    try:
        text = httpx.get(url, timeout=5).text
    except httpx.HTTPError:
        return out
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            base = sample.name.removesuffix("_total")
            if base in names and sample.name.endswith("_total"):
                out[base.removeprefix("tandem:")] += sample.value
    return out
