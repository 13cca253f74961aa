"""Prometheus metrics of both real processes (tiny llama; --metrics-port 0, the port read from the log line
`metrics on http://...`): both /metrics parse; after a known workload the scheduler's counters equal what
was sent and its histograms counted every request and token; every executor forward is observed once in the
step histograms; KV gauges add up; a cancelled stream is counted; every metric the Grafana dashboard and
docs/metrics.md name exists (and every exported one is in docs/metrics.md). Plus, in process: registries are
per instance, and the lock-free histogram's buckets follow Prometheus' `le`."""
from __future__ import annotations

import concurrent.futures as cf
import functools
import json
import re
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from scheduler.metrics import SchedulerMetrics
from tandem.generate.v1 import generate_pb2 as pb
from tandem.histogram import SingleWriterHistogram
from tests.docs_text import docs_text
from tests.grpc_harness import start_for, start_scheduler_for
from tests.scheduler_client import collect, ids_request, wait_kv_free

ROOT = Path(__file__).resolve().parents[2]
KV_BLOCKS = 256
# (prompt length, max_new_tokens): distinct token ids per request, so no prompt shares a cached prefix
WORKLOAD = [(5, 3), (17, 6), (33, 2), (40, 9), (64, 4)]
_URL = re.compile(r"metrics on (https?://\S+/metrics)")
_SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created", "_info")


@pytest.fixture(scope="module")
def executor(request, model_dir):
    return start_for(request, model_dir, "--kv-blocks", str(KV_BLOCKS), "--metrics-port", "0")


@pytest.fixture(scope="module")
def scheduler(request, executor):
    return start_scheduler_for(request, executor.address, "--metrics-port", "0")


def metrics_url(server) -> str:
    found = _URL.search(server.stderr())  # logged before READY
    assert found, f"no 'metrics on' line in the log:\n{server.stderr()}"
    return found.group(1)


def scrape(server) -> dict[str, float]:
    """Every sample of the server's /metrics (which must parse), keyed `name{label="v",...}` (labels sorted)."""
    with urllib.request.urlopen(metrics_url(server), timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def names(samples: dict[str, float]) -> set[str]:
    return {key.split("{")[0] for key in samples}


def families(server) -> set[str]:
    with urllib.request.urlopen(metrics_url(server), timeout=10) as resp:
        return {f.name for f in text_string_to_metric_families(resp.read().decode())}


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def one(samples: dict[str, float], name: str) -> float:
    """The value of a metric with exactly one series (whatever its labels)."""
    values = [v for k, v in samples.items() if k.split("{")[0] == name]
    assert len(values) == 1, f"{name}: {values}"
    return values[0]


def run_workload(scheduler) -> None:
    def send(n: int) -> pb.Usage:
        prompt_len, max_new = WORKLOAD[n]
        ids = [1] + [3 + (7 * n + i) % 390 for i in range(prompt_len - 1)]
        req = ids_request(ids, max_new, stopping=pb.StoppingCriteria(max_new_tokens=max_new, ignore_eos=True))
        return collect(scheduler.stub, req).usage

    with cf.ThreadPoolExecutor(len(WORKLOAD)) as pool:
        usages = list(pool.map(send, range(len(WORKLOAD))))
    assert [(u.prompt_tokens, u.completion_tokens) for u in usages] == WORKLOAD


def test_counters_and_histograms_match_the_workload(scheduler, executor):
    before_s, before_e = scrape(scheduler), scrape(executor)
    run_workload(scheduler)
    wait_kv_free(executor.stub)
    after_s, after_e = scrape(scheduler), scrape(executor)
    d = functools.partial(delta, after_s, before_s)
    requests, prompt, generated = len(WORKLOAD), sum(p for p, _ in WORKLOAD), sum(g for _, g in WORKLOAD)

    assert d('tandem:request_success_total{finished_reason="length"}') == requests
    for reason in ("stop", "stop_sequence", "aborted"):
        assert d(f'tandem:request_success_total{{finished_reason="{reason}"}}') == 0
    assert d("tandem:prompt_tokens_total") == prompt
    assert d("tandem:generation_tokens_total") == generated
    assert d("tandem:prefix_cache_queries_total") == prompt
    assert 0 <= d("tandem:prefix_cache_hits_total") <= prompt
    for hist in ("tandem:time_to_first_token_seconds", "tandem:e2e_request_latency_seconds",
                 "tandem:request_queue_time_seconds", "tandem:request_prompt_tokens",
                 "tandem:request_generation_tokens"):
        assert d(f"{hist}_count") == requests, hist
        assert d(f'{hist}_bucket{{le="+Inf"}}') == requests, hist
    assert d("tandem:inter_token_latency_seconds_count") == generated - requests
    assert d("tandem:request_prompt_tokens_sum") == prompt
    assert d("tandem:request_generation_tokens_sum") == generated
    assert d("tandem:e2e_request_latency_seconds_sum") >= d("tandem:time_to_first_token_seconds_sum") > 0

    where = f'{{executor="{executor.address}"}}'
    assert after_s[f"tandem:num_requests_running{where}"] == 0
    assert after_s[f"tandem:num_requests_waiting{where}"] == 0
    assert after_s[f"tandem:scheduler_executor_up{where}"] == 1
    assert 0 <= after_s[f"tandem:kv_cache_usage_perc{where}"] <= 1
    assert delta(after_s, before_s, f"tandem:scheduler_steps_total{where}") > 0
    assert after_s[f"tandem:num_preemptions_total{where}"] == 0  # 256 blocks: room for everyone

    # Every forward the executor ran is in the step histograms exactly once, with its tokens.
    e = functools.partial(delta, after_e, before_e)
    kinds = ("prefill", "decode", "mixed", "verify")
    steps = sum(e(f'tandem:executor_step_duration_seconds_count{{kind="{k}"}}') for k in kinds)
    assert steps == e("tandem:executor_forward_passes_total") > 0
    assert e('tandem:executor_step_duration_seconds_count{kind="prefill"}') > 0
    assert e('tandem:executor_step_duration_seconds_count{kind="decode"}') > 0
    assert sum(e(f'tandem:executor_step_tokens_sum{{kind="{k}"}}') for k in kinds) == \
        e("tandem:executor_tokens_processed_total") == prompt + generated - requests
    # each scheduler step is one UnifiedDecode, or one Decode of several steps (a burst, scheduler/engine/decode_bursts.py)
    assert e('tandem:executor_rpc_duration_seconds_count{method="UnifiedDecode"}') + \
        e('tandem:executor_rpc_duration_seconds_count{method="Decode"}') == \
        delta(after_s, before_s, f"tandem:scheduler_steps_total{where}")

    # KV gauges: everything released, the parts add up.
    total, free = after_e["tandem:executor_kv_total_blocks"], after_e["tandem:executor_kv_free_blocks"]
    assert total == KV_BLOCKS and free == total and after_e["tandem:executor_kv_used_blocks"] == 0
    assert 0 <= after_e["tandem:executor_kv_cached_blocks"] <= free
    assert after_e["tandem:executor_active_caches"] == 0
    assert e("tandem:executor_prefix_cache_queries_total") == prompt
    assert after_e["tandem:executor_adapters_loaded"] == 0
    assert after_e["tandem:executor_resident_memory_bytes"] > 0
    assert one(after_e, "tandem:executor_info") == 1


def test_cancelled_stream_is_counted(scheduler, executor):
    key = 'tandem:request_failure_total{code="CANCELLED"}'
    before = scrape(scheduler).get(key, 0.0)
    # min_new_tokens: one decode step per call until then (README: multi-step decode), so the request runs for
    # 200 round trips and is surely still running when the cancel arrives.
    call = scheduler.stub.Generate(ids_request([1, 7, 8, 9], 200, stopping=pb.StoppingCriteria(
        max_new_tokens=200, min_new_tokens=200, ignore_eos=True)))
    next(call)
    call.cancel()
    with pytest.raises(grpc.RpcError):
        for _ in call:
            pass
    deadline = time.monotonic() + 15  # the server sees the cancellation after the client does
    while scrape(scheduler).get(key, 0.0) != before + 1:
        assert time.monotonic() < deadline, "the cancelled request was not counted"
        time.sleep(0.05)
    wait_kv_free(executor.stub)


def _metric_names(text: str) -> set[str]:
    return set(re.findall(r"(?:tandem:|vllm:|process_)[A-Za-z0-9_:]*[A-Za-z0-9_]", text))


def _exported(server) -> set[str]:
    """Metric names a query may use: every sample name, and every family name with its suffixes (a family
    with no series yet, e.g. failures by code, still has its name)."""
    out = names(scrape(server))
    for family in families(server):
        out |= {family} | {family + s for s in _SUFFIXES}
    return out


def test_dashboard_uses_only_exported_metrics(scheduler, executor):
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "tandem.json").read_text())
    queries = []

    def walk(node) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("expr", "definition") and isinstance(value, str):
                    queries.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(dashboard)
    assert len(queries) > 20
    exported = _exported(scheduler) | _exported(executor)
    used = set().union(*(_metric_names(q) for q in queries))
    assert used and not used - exported, f"not exported: {sorted(used - exported)}"


def test_readme_lists_every_tandem_metric(scheduler, executor):
    documented = _metric_names(docs_text("docs/metrics.md"))  # the metrics page, as the README's section was
    exported = {f for f in families(scheduler) | families(executor)
                if f.startswith(("tandem:", "vllm:")) and not f.endswith("_created")}
    missing = {f for f in exported if f not in documented and f + "_total" not in documented}
    assert not missing, f"missing from docs/metrics.md: {sorted(missing)}"
    # (CUDA-only, MoE-only, KV-tier and draft-model metrics are documented though this CPU, dense, tierless run
    # without --draft-model does not export them; tests/executor/test_kv_tier_events_metrics.py reads the tier ones,
    # tests/executor/test_draft_model_metrics.py the draft model's)
    extra = documented - _exported(scheduler) - _exported(executor)
    tiers = {n for n in documented if n.startswith(("tandem:executor_kv_tier_", "tandem:executor_draft_model_"))}
    assert extra <= {"tandem:executor_device_memory_allocated_bytes", "tandem:executor_device_memory_reserved_bytes",
                     "tandem:executor_moe_expert_tokens_total", "tandem:executor_moe_expert_tokens"} | tiers, \
        sorted(extra)


def test_registries_are_per_instance():
    a, b = SchedulerMetrics(), SchedulerMetrics()
    a.first_token(0.5, 10, 0)
    body, content_type = a.render()
    assert content_type.startswith("text/plain")
    got = {s.name: s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples}
    assert got["tandem:prompt_tokens_total"] == 10 and got["tandem:time_to_first_token_seconds_count"] == 1
    other = {s.name: s.value for f in text_string_to_metric_families(b.render()[0].decode()) for s in f.samples}
    assert other["tandem:prompt_tokens_total"] == 0


def test_single_writer_histogram_buckets_are_le():
    family = HistogramMetricFamily("h", "doc")
    hist = SingleWriterHistogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 1.0, 3.0):
        hist.observe(value)
    hist.add_to(family)
    got = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert got[("h_bucket", "0.1")] == 2 and got[("h_bucket", "1.0")] == 4 and got[("h_bucket", "+Inf")] == 5
    assert got[("h_count", None)] == 5 and got[("h_sum", None)] == pytest.approx(4.65)
