"""The executor's draft-model counters on its Prometheus exporter (--metrics-port: tandem:executor_draft_model_*),
in process over a tiny fp32 checkpoint drafting for itself: after model-drafted decode steps every family equals
the GetInfo counters it is read from (guessed and accepted tokens, the draft model's time, catch-up tokens, caches,
its pool), and an executor without a draft model exports none of them."""
from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from executor_service.metrics.op_stats import RpcMetrics
from executor_service.metrics.prometheus import ExecutorExporter
from executor_service.model_thread import ModelThread
from executor_service.types import UnifiedItem
from tests.executor_driver import make_executor

PREFIX = "tandem:executor_draft_model_"


def scrape(ex) -> dict[str, float]:
    thread = ModelThread()
    try:
        exporter = ExecutorExporter(RpcMetrics(), thread)
        exporter.attach(ex)
        text = generate_latest(exporter.registry).decode()
    finally:
        thread.shutdown()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.fixture(scope="module")
def drafting(model_dir):
    return make_executor(model_dir, kv_blocks=64, draft_model=model_dir, draft_kv_blocks=16)


def test_draft_model_counters_are_exported(drafting):
    (r,) = drafting.unified_decode([UnifiedItem((5, 9, 13, 21, 34, 55), model_draft_tokens=3)])
    for _ in range(4):  # the model guessing for itself: its greedy guesses are all accepted
        (r,) = drafting.unified_decode([UnifiedItem((r.output.tokens[-1].token_id,), r.cache.cache_id,
                                                    r.cache.seq_len, model_draft_tokens=3)])
        assert r.error is None and r.model_draft_tokens == 3
    info = drafting.info().draft_model
    m = scrape(drafting)
    assert info.draft_tokens >= 12 and info.accepted_draft_tokens == info.draft_tokens
    assert m[PREFIX + "draft_tokens_total"] == info.draft_tokens
    assert m[PREFIX + "accepted_tokens_total"] == info.accepted_draft_tokens
    assert m[PREFIX + "seconds_total"] == pytest.approx(info.draft_seconds) and info.draft_seconds > 0
    assert m[PREFIX + "catch_up_tokens_total"] == info.catch_up_tokens > 0
    assert m[PREFIX + "items_without_drafts_total"] == info.items_without_drafts == 0
    assert m[PREFIX + "live_caches"] == info.live_caches == 1
    assert (m[PREFIX + "kv_total_blocks"], m[PREFIX + "kv_free_blocks"]) == (16, info.free_blocks)
    drafting.release_cache([r.cache.cache_id])
    m = scrape(drafting)
    assert m[PREFIX + "caches_freed_total"] == drafting.info().draft_model.caches_freed >= 1
    assert m[PREFIX + "live_caches"] == 0


def test_no_draft_model_no_families(model_dir):
    m = scrape(make_executor(model_dir, kv_blocks=16))
    assert "tandem:executor_forward_passes_total" in m
    assert not [name for name in m if name.startswith(PREFIX)]
