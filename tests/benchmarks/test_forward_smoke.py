"""Smoke tests of `python -m benchmarks forward` and `moe` --quick on tiny checkpoints: both sides run and the JSON
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


@pytest.mark.long  # a benchmark's smoke run (minutes in all): scripts/test --long
def test_moe_quick_counts_the_routed_experts(run_bench):
    proc, data = run_bench("moe", "--quick", "--batches", "1,8", "--peak-n", "256")
    model = data["model"]
    assert model["architecture"] == "Qwen3MoeForCausalLM" and model["num_layers"] == 8
    # per layer: attention (q 256x256, k/v 64x256, o 256x256) + router (16x256) + 2 routed experts of 3x256x128
    attn = 256 * 256 * 2 + 64 * 256 * 2
    assert model["layer_linear_params"] == 8 * (attn + 16 * 256 + 2 * 3 * 256 * 128)
    assert [(r["phase"], r["batch"]) for r in data["rows"]] == [("decode", 1), ("decode", 8)]
    assert all(r["hf_over_tandem"] > 0 for r in data["rows"])
    assert "Qwen3MoeForCausalLM" in proc.stdout
