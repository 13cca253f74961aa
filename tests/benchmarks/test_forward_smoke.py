"""Smoke test of `python -m benchmarks forward --quick` on a tiny checkpoint: both sides run and the JSON
is sane. No timing assertions: the machine is shared and noisy; only structure and positivity are checked."""
from __future__ import annotations

import pytest


@pytest.mark.long  # a benchmark's smoke run (minutes in all): scripts/test --long
def test_forward_quick(tiny_checkpoint, run_bench):
    proc, data = run_bench("forward", "--quick", "--model", str(tiny_checkpoint("llama")))
    assert data["benchmark"] == "bench_forward" and data["machine"]["cpu_count"] >= 1 and data["peak"]["gflops"] > 0
    rows = data["rows"]
    assert sorted(r["batch"] for r in rows if r["phase"] == "decode") == [1, 8]
    assert {r["batch"] for r in rows if r["phase"].startswith("prefill")} == {1, 4}
    for r in rows:
        for key in ("tandem_ms", "hf_ms", "hf_over_tandem", "tandem_tok_s", "hf_tok_s", "tandem_gflops",
                    "hf_gflops", "tandem_pct_peak", "hf_pct_peak"):
            assert r[key] > 0, (r["phase"], r["batch"], key, r[key])
    assert "hf/tandem" in proc.stdout and "tandem ms" in proc.stdout

