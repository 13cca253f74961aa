"""Smoke test of scripts/bench_moe.py --quick: builds its synthetic Qwen3-MoE checkpoint, runs both sides'
decode, and writes sane JSON whose FLOPs count the routed experts. No timing assertions (shared machine)."""
from __future__ import annotations

import json



def test_bench_moe_quick(tmp_path, run_bench):
    out = tmp_path / "results" / "bench_moe.json"
    proc = run_bench("bench_moe", "--quick", "--batches", "1,8", "--peak-n", "256", "--out", str(out))
    data = json.loads(out.read_text())

    model = data["model"]
    assert model["architecture"] == "Qwen3MoeForCausalLM"
    assert model["num_layers"] == 8 and model["hidden_size"] == 256
    # Per-token weights: attention (q 256x256, k/v 64x256 each, o 256x256) + router (16x256) + 2 routed
    # experts of 3 x 256 x 128, per layer.
    attn = 256 * 256 * 2 + 64 * 256 * 2
    assert model["layer_linear_params"] == 8 * (attn + 16 * 256 + 2 * 3 * 256 * 128)

    rows = data["rows"]
    assert [r["phase"] for r in rows] == ["decode", "decode"]  # prefill is off by default
    assert [r["batch"] for r in rows] == [1, 8]
    for r in rows:
        for key in ("tandem_ms", "hf_ms", "hf_over_tandem", "tandem_tok_s", "hf_tok_s", "tandem_gflops"):
            assert r[key] > 0, (r["batch"], key, r[key])
    assert "hf/tandem" in proc.stdout and "Qwen3MoeForCausalLM" in proc.stdout
