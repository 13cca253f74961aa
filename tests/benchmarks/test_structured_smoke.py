"""Smoke test of `python -m benchmarks structured` on a tiny checkpoint: plain and constrained batches through
real servers. No timing assertions: only that the figures exist and add up."""
from __future__ import annotations

import pytest


@pytest.mark.long  # a benchmark's smoke run (minutes in all): scripts/test --long
def test_structured_overhead(model_dir, run_bench):
    proc, data = run_bench("structured", "--quick", "--model", str(model_dir), "--batches", "1,3",
                           "--output-len", "6", timeout=240)
    rows = data["overhead"]["summary"]
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["all_exact_output_len"] and r["plain_tpot_ms"] > 0 and r["constrained_tpot_ms"] > 0
        assert r["masks_per_request"] == 5  # 6 tokens: the first mask came with the compiled grammar
        assert r["mask_ms_per_step"] > 0 and r["mask_wait_ms_per_step"] >= 0
    runs = data["overhead"]["runs"]
    assert {(r["batch"], r["mode"]) for r in runs} == {(b, m) for b in (1, 3) for m in ("plain", "constrained")}
    assert all(r["masks"] == 0 for r in runs if r["mode"] == "plain")
    assert "Step-time overhead" in proc.stdout
