"""Smoke tests of `python -m benchmarks executor` and `startup` --quick on a tiny checkpoint: real
server processes where the benchmark starts them, sane JSON. No timing assertions (shared, noisy machine)."""
from __future__ import annotations

import pytest

CONFIGS = {"tokens", "logits/f32", "logits/bf16", "tokens/x8"}


@pytest.mark.long  # a benchmark's smoke run (minutes in all): scripts/test --long
def test_executor_quick(model_dir, run_bench):
    proc, data = run_bench("executor", "--quick", "--model", str(model_dir))
    assert "server stopped (exit code 0)" in proc.stderr and data["server_exit_code"] == 0  # SIGTERM -> clean drain
    assert data["benchmark"] == "bench_executor" and data["server"]["address"].startswith("127.0.0.1:")
    rows = data["rows"]
    assert {r["config"] for r in rows} == CONFIGS and len(rows) == 2 * len(CONFIGS)
    for r in rows:
        for key in ("inproc_ms", "grpc_ms", "grpc_over_inproc", "response_bytes", "request_bytes"):
            assert r[key] > 0, (r["config"], r["batch"], key)
        assert r["server_cpu_ms"] > 0
    by = {(r["config"], r["batch"]): r for r in rows}
    for b in (1, 4):  # float32 logits carry 4 bytes per vocab entry, bfloat16 2: the wire sizes show it
        assert by[("logits/f32", b)]["response_bytes"] > by[("logits/bf16", b)]["response_bytes"] \
            > by[("tokens", b)]["response_bytes"]
    assert "grpc/inproc" in proc.stdout


@pytest.mark.long  # a benchmark's smoke run (minutes in all): scripts/test --long
def test_startup_quick_cold(model_dir, run_bench):
    proc, data = run_bench("startup", "--quick", "--cold", "--model", str(model_dir), timeout=240)
    (result,) = data["results"]
    assert result["config"] == "defaults" and result["flags"] == []
    cold, warm = result["runs"]
    assert cold["cold"] is True and warm["cold"] is False
    for run in result["runs"]:
        assert run["exit_code"] == 0 and run["ready_s"] > 0 and run["ready_in_s"] > 0
        assert run["rss_at_ready_bytes"] > 0 and run["peak_bytes"] >= run["rss_at_ready_bytes"]
        assert run["info"]["kv_pool"]["reason"].startswith("CPU default")
        for req in ("first_request", "second_request"):
            assert run[req]["prefill_ms"] > 0 and len(run[req]["decode_ms"]) == 2
    assert [(r["config"], r["cache"]) for r in data["rows"]] == [("defaults", "cold"), ("defaults", "warm")]
    assert "READY s" in proc.stdout and "defaults: KV pool CPU default" in proc.stdout
