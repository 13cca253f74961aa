"""Smoke test of scripts/bench_forward.py --quick on a tiny checkpoint: it runs, and writes sane JSON.

No timing assertions: the machine is shared and noisy; only structure and positivity are checked.
"""
from __future__ import annotations

import json



def test_bench_forward_quick(tiny_checkpoint, tmp_path, run_bench):
    model_dir = tiny_checkpoint("llama")
    out = tmp_path / "results" / "bench.json"  # the parent dir does not exist yet: the script creates it
    proc = run_bench("bench_forward", "--quick", "--model", str(model_dir), "--out", str(out))
    assert out.is_file()
    data = json.loads(out.read_text())

    assert data["machine"]["cpu_count"] >= 1
    assert data["machine"]["torch_threads"] >= 1
    assert data["machine"]["device"] == "cpu"
    assert data["peak"]["gflops"] > 0

    rows = data["rows"]
    decode = [r for r in rows if r["phase"] == "decode"]
    prefill = [r for r in rows if r["phase"].startswith("prefill")]
    assert sorted(r["batch"] for r in decode) == [1, 8]
    assert {r["batch"] for r in prefill} == {1, 4}
    for r in rows:
        for key in ("tandem_ms", "hf_ms", "hf_over_tandem", "tandem_tok_s", "hf_tok_s", "tandem_gflops",
                    "hf_gflops", "tandem_pct_peak", "hf_pct_peak"):
            assert r[key] > 0, (r["phase"], r["batch"], key, r[key])
        assert all(t > 0 for t in r["tandem_times"]["times_s"])
        assert all(t > 0 for t in r["hf_times"]["times_s"])
    # The table went to stdout, with both sides' columns.
    assert "hf/tandem" in proc.stdout and "tandem ms" in proc.stdout
