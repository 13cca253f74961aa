"""Smoke test of `python -m benchmarks structured` on a tiny checkpoint: both parts, tiny, llguidance only
(xgrammar is not a dependency). No timing assertions: only that the figures exist and add up."""
from __future__ import annotations

import pytest

from benchmarks.structured_engines import FEATURES


@pytest.mark.long  # a benchmark's smoke run (minutes in all): scripts/test --long
def test_structured_both_parts(model_dir, run_bench):
    proc, data = run_bench("structured", "--quick", "--model", str(model_dir), "--engines", "llguidance",
                           "--batches", "1,3", "--output-len", "6", timeout=240)
    eng = data["engines"]
    assert eng["versions"]["llguidance"]
    assert [(r["engine"], r["batch"]) for r in eng["mask_timing"]] == [("llguidance", 1), ("llguidance", 3)]
    for r in eng["mask_timing"]:
        assert r["violations"] == 0 and r["steps"] == 8  # every mask allowed the token that came next
        assert 0 < r["mask_ms_p50"] <= r["mask_ms_p99"]
    assert eng["compile"][0]["compile_ms_max"] > 0
    cover = eng["coverage"]["llguidance"]
    assert list(cover) == [f.name for f in FEATURES] and cover["$ref / $defs"] == "yes"
    assert cover["not"].startswith("no (refused")  # refused, never silently ignored

    rows = data["overhead"]["summary"]
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["all_exact_output_len"] and r["plain_tpot_ms"] > 0 and r["constrained_tpot_ms"] > 0
        assert r["masks_per_request"] == 5  # 6 tokens: the first mask came with the compiled grammar
        assert r["mask_ms_per_step"] > 0 and r["mask_wait_ms_per_step"] >= 0
    runs = data["overhead"]["runs"]
    assert {(r["batch"], r["mode"]) for r in runs} == {(b, m) for b in (1, 3) for m in ("plain", "constrained")}
    assert all(r["masks"] == 0 for r in runs if r["mode"] == "plain")
    assert "JSON Schema coverage" in proc.stdout and "Step-time overhead" in proc.stdout
