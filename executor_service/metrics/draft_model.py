"""The executor's Prometheus families for its draft model (--draft-model, docs/serving.md's "A draft model"):
the tokens it guessed and the served model accepted, the time it ran, the tokens it wrote catching its caches up,
items it could not draft for, and its own KV pool. Read when scraped from the counters GetInfo reports
(GetInfoResponse.draft_model: executor_service/step/draft_model.py's DraftStats, plain ints); nothing is exported
when the executor runs no draft model. executor_service/metrics/prometheus.py yields them beside the others.

The scheduler counts the same guesses from its side (tandem:spec_decode_draft_tokens_by_method_total{method="draft_model"}):
these are the executor's own, whichever schedulers asked, with the time the draft model took."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from executor_service.types import DraftModelInfo

PREFIX = "tandem:executor_draft_model_"


def draft_model_metrics(info: "DraftModelInfo | None") -> Iterator[Metric]:
    if info is None:
        return
    for name, doc, value in (
            ("draft_tokens", "Draft tokens the draft model guessed (and the served model verified).",
             info.draft_tokens),
            ("accepted_tokens", "Of the draft model's guesses, those the served model accepted.",
             info.accepted_draft_tokens),
            ("seconds", "Time spent running the draft model (its catch-up and its guesses).", info.draft_seconds),
            ("catch_up_tokens", "Tokens the draft model wrote to catch its caches up with their sequences (prompts, "
             "accepted tokens) before guessing.", info.catch_up_tokens),
            ("items_without_drafts", "Items that asked for model drafts but got none (the draft pool could not hold "
             "their sequence, or the draft model failed: the log says why); they ran without drafts.",
             info.items_without_drafts),
            ("caches_evicted", "Draft caches evicted (least recently used first) to make room in the draft pool.",
             info.caches_evicted),
            ("caches_freed", "Draft caches freed with the served caches they belonged to.", info.caches_freed)):
        yield CounterMetricFamily(PREFIX + name, doc, value=value)
    for name, doc, value in (
            ("live_caches", "Draft caches held now (one per served cache that has drafted).", info.live_caches),
            ("kv_total_blocks", "Blocks in the draft model's own KV pool (--draft-kv-blocks).", info.kv_pool.blocks),
            ("kv_free_blocks", "Blocks of the draft model's KV pool free now.", info.free_blocks)):
        yield GaugeMetricFamily(PREFIX + name, doc, value=value)
