"""Smoke test of scripts/bench_startup.py --quick --cold on a tiny checkpoint: it starts a real executor twice
(model files evicted from the page cache, then warm), sends the first and second request after READY, stops
it cleanly and writes sane JSON and a table.

No timing assertions: the machine is shared and noisy; only structure and positivity are checked.
"""
from __future__ import annotations

import json


def test_bench_startup_quick(tiny_checkpoint, tmp_path, run_bench):
    model_dir = tiny_checkpoint("llama")
    out = tmp_path / "results" / "startup.json"  # the parent dir does not exist yet: the script creates it
    proc = run_bench("bench_startup", "--quick", "--cold", "--model", str(model_dir), "--out", str(out), timeout=240)
    data = json.loads(out.read_text())

    assert data["benchmark"] == "bench_startup"
    assert data["config"]["config_list"] == ["defaults"] and data["config"]["prompt_len"] == 16
    assert data["machine"]["cpu_count"] >= 1 and data["machine"]["memtotal_bytes"] > 0
    (result,) = data["results"]
    assert result["config"] == "defaults" and result["flags"] == []
    cold_run, warm_run = result["runs"]
    assert cold_run["cold"] is True and warm_run["cold"] is False
    if data["cold_available"]:
        assert cold_run["model_cached_fraction"] < 0.5  # evicted (fsync + fadvise) just before the start
    for run in result["runs"]:
        assert run["exit_code"] == 0  # SIGTERM -> clean drain
        assert run["ready_s"] > 0 and run["ready_in_s"] > 0 and run["imports_s"] is not None
        assert run["rss_at_ready_bytes"] > 0 and run["peak_bytes"] >= run["rss_at_ready_bytes"] > 0
        pool = run["info"]["kv_pool"]
        assert pool["blocks"] == run["info"]["kv_blocks"] > 0 and pool["reason"].startswith("CPU default")
        assert run["info"]["resident_memory_bytes"] > 0
        for req in ("first_request", "second_request"):
            r = run[req]
            assert r["prefill_ms"] > 0 and len(r["decode_ms"]) == 2 and all(ms > 0 for ms in r["decode_ms"])
            assert r["total_ms"] >= r["prefill_ms"]
    assert [(r["config"], r["cache"], r["runs"]) for r in data["rows"]] == [("defaults", "cold", 1),
                                                                            ("defaults", "warm", 1)]
    # The table and the KV pool's reason went to stdout.
    assert "READY s" in proc.stdout and "RSS@READY MB" in proc.stdout and "1st req ms" in proc.stdout
    assert "defaults: KV pool CPU default" in proc.stdout
