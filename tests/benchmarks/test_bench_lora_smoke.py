"""Smoke test of scripts/bench_lora.py --quick on a tiny checkpoint: it creates random PEFT LoRA adapters,
loads them into an in-process Executor, times base / 1-adapter / 4-mixed decode and writes sane JSON; a
second run reuses the adapters kept in --adapter-dir.

No timing assertions: the machine is shared and noisy; only structure and positivity are checked.
"""
from __future__ import annotations

import json


CONFIGS = ["base", "1 adapter", "4 mixed"]


def test_bench_lora_quick(tiny_checkpoint, tmp_path, run_bench):
    model_dir = tiny_checkpoint("llama")
    out = tmp_path / "results" / "bench_lora.json"  # the parent dir does not exist yet: the script creates it
    adapters = tmp_path / "adapters"
    proc = run_bench("bench_lora", "--quick", "--model", str(model_dir), "--batch", "8", "--steps", "2",
                     "--rank", "4", "--adapter-dir", str(adapters), "--out", str(out))
    data = json.loads(out.read_text())

    assert data["benchmark"] == "bench_lora"
    assert data["machine"]["cpu_count"] >= 1
    s = data["settings"]
    assert (s["batch"], s["steps"], s["rank"], s["num_adapters"], s["adapter_counts"]) == (8, 2, 4, 4, [0, 1, 4])
    created = data["adapters"]["creation"]
    assert sorted(created["created"]) == ["lora-0", "lora-1", "lora-2", "lora-3"] and created["reused"] == []
    assert created["total_s"] > 0
    for i in range(4):  # PEFT's own layout, kept in --adapter-dir
        assert (adapters / f"lora-{i}" / "adapter_config.json").is_file()
        assert (adapters / f"lora-{i}" / "adapter_model.safetensors").is_file()
    assert all(v >= 0 for v in data["adapters"]["load_adapter_s"].values())
    assert data["adapters"]["lora_flops_per_token"] > 0

    rows = data["rows"]
    assert [r["config"] for r in rows] == CONFIGS
    by = {r["config"]: r for r in rows}
    for r in rows:
        for key in ("ms_per_step", "min_ms", "tok_s", "ratio_to_base", "ratio_to_base_min"):
            assert r[key] > 0, (r["config"], key, r[key])
        assert r["times"]["n"] == 2 and all(t > 0 for t in r["times_s"])
    assert by["base"]["ratio_to_base"] == 1.0 and by["base"]["tokens_differ_from_base"] == 0.0
    assert by["1 adapter"]["adapter_of_sequence"] == ["lora-0"] * 8
    assert by["4 mixed"]["adapter_of_sequence"] == [f"lora-{i % 4}" for i in range(8)]
    # Random LoRA weights (init_lora_weights=False) change the tiny model's greedy tokens: proof the
    # adapters are applied, per sequence.
    assert by["1 adapter"]["tokens_differ_from_base"] > 0 and by["4 mixed"]["tokens_differ_from_base"] > 0
    assert set(data["ratios"]) == set(CONFIGS)
    v = data["verdict"]
    assert v["config"] == "4 mixed" and v["target"] == 0.8 and isinstance(v["passed"], bool)
    assert "xbase" in proc.stdout and ("PASS" in proc.stdout or "FAIL" in proc.stdout)

    # Second run: the matching adapters in --adapter-dir are reused, not recreated.
    out2 = tmp_path / "again.json"
    run_bench("bench_lora", "--quick", "--model", str(model_dir), "--batch", "4", "--steps", "1", "--rank", "4",
              "--adapter-counts", "0,2", "--num-adapters", "4", "--adapter-dir", str(adapters), "--out", str(out2))
    again = json.loads(out2.read_text())
    assert again["adapters"]["creation"]["created"] == []
    assert sorted(again["adapters"]["creation"]["reused"]) == ["lora-0", "lora-1", "lora-2", "lora-3"]
    assert [r["config"] for r in again["rows"]] == ["base", "2 mixed"]
    assert again["verdict"]["config"] == "2 mixed"
