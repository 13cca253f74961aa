"""Smoke test of `python -m benchmarks tp --quick` on the tiny checkpoint: real servers at TP 1 and 2, both stopped
cleanly, a row per size and batch with each rank's memory. No timing assertions (shared, noisy machine)."""
from __future__ import annotations

import pytest


@pytest.mark.long  # a benchmark's smoke run: scripts/test --long
def test_tp_quick(model_dir, run_bench):
    proc, data = run_bench("tp", "--quick", "--model", str(model_dir), timeout=300)
    assert "tp=1 server stopped (exit code 0)" in proc.stderr and "tp=2 server stopped (exit code 0)" in proc.stderr
    rows = data["rows"]
    assert [(r["tp"], r["batch"]) for r in rows] == [(1, 1), (1, 4), (2, 1), (2, 4)]
    assert all(r["decode_ms"] > 0 and r["prefill_ms"] > 0 for r in rows)
    assert all(len(r["rank_rss_mib"].split(" / ")) == r["tp"] for r in rows)  # one figure per rank
    assert "RSS MiB per rank" in proc.stdout
