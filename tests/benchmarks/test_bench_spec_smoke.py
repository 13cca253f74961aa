"""Smoke test of scripts/bench_spec.py on the tiny checkpoint: one executor and two real schedulers (speculation
off / n-gram), both workloads at one concurrency, writing JSON whose figures add up. The tiny model copies
nothing, so only consistency is checked (identical greedy tokens on both sides, counters that agree), never a
speed-up or a timing."""
from __future__ import annotations

import json


def test_bench_spec_quick(model_dir, tmp_path, run_bench):
    out = tmp_path / "spec.json"
    proc = run_bench("bench_spec", "--model", str(model_dir), "--concurrency", "2", "--requests", "3",
                     "--output-len", "12", "--spec-args=--speculative ngram --ngram-min 1", "--out", str(out),
                     timeout=180)
    data = json.loads(out.read_text())
    assert data["benchmark"] == "bench_spec" and data["config"]["spec_args"] == "--speculative ngram --ngram-min 1"
    cells = data["cells"]
    assert [(c["workload"], c["concurrency"]) for c in cells] == [("copy", 2), ("chat", 2)]
    for c in cells:
        assert c["identical"] == c["compared"] == 3  # speculation never changes greedy output
        off, on = c["sides"]["off"], c["sides"]["on"]
        assert off["output_tokens"] == on["output_tokens"] > 0 and not off["errors"] and not on["errors"]
        assert 0 <= c["accepted_tokens"] <= c["drafted_tokens"]
        usage = [r["usage"] for rs in c["records"]["on"] for r in rs]
        assert sum(u["drafted_tokens"] for u in usage) == c["drafted_tokens"]  # Prometheus agrees with usage
        assert sum(u["accepted_tokens"] for u in usage) == c["accepted_tokens"]
    assert "on/off" in proc.stdout and "copy" in proc.stdout
