"""Smoke tests of `python -m benchmarks lora` and `decode` on the tiny checkpoint. lora: random PEFT adapters made,
loaded and decoded with (a second run reuses them); decode: real executor + scheduler per mode, in-process steps
(the compiled mode's compiles cost ~80 s: tests/executor/test_compiled_decode.py covers it;
llama.cpp is not part of the smoke run). Timings are never asserted (noisy machine)."""
from __future__ import annotations

import pytest


@pytest.mark.long  # a benchmark's smoke run (minutes in all): scripts/test --long
def test_lora_quick(model_dir, tmp_path, run_bench):
    adapters = tmp_path / "adapters"
    proc, data = run_bench("lora", "--quick", "--model", str(model_dir), "--steps", "2", "--rank", "4",
                           "--adapter-dir", str(adapters))
    created = data["adapters"]["creation"]
    assert sorted(created["created"]) == [f"lora-{i}" for i in range(4)] and created["reused"] == []
    assert all((adapters / f"lora-{i}" / "adapter_model.safetensors").is_file() for i in range(4))
    rows = {r["config"]: r for r in data["rows"]}
    assert list(rows) == ["base", "1 adapter", "4 mixed"]
    assert rows["base"]["ratio_to_base"] == 1.0 and rows["base"]["tokens_differ_from_base"] == 0.0
    assert rows["4 mixed"]["adapter_of_sequence"] == [f"lora-{i % 4}" for i in range(8)]
    # random LoRA weights change the tiny model's greedy tokens: proof the adapters are applied, per sequence
    assert rows["1 adapter"]["tokens_differ_from_base"] > 0 and rows["4 mixed"]["tokens_differ_from_base"] > 0
    assert all(r["ms_per_step"] > 0 and r["ratio_to_base"] > 0 for r in rows.values())
    assert "xbase" in proc.stdout and "PASS" not in proc.stdout  # measurements, no verdicts

    _, again = run_bench("lora", "--quick", "--model", str(model_dir), "--batch", "4", "--steps", "1", "--rank", "4",
                         "--adapter-counts", "0,2", "--num-adapters", "4",
                         "--adapter-dir", str(adapters), "--out", str(tmp_path / "again.json"))
    assert again["adapters"]["creation"]["created"] == [] and len(again["adapters"]["creation"]["reused"]) == 4
    assert [r["config"] for r in again["rows"]] == ["base", "2 mixed"]


@pytest.mark.long  # a benchmark's smoke run (minutes in all): scripts/test --long
def test_decode_quick(model_dir, run_bench):
    proc, data = run_bench("decode", "--model", str(model_dir), "--quick", timeout=240)
    modes = ("float32-eager", "float32-native", "int8-native")
    assert data["config"]["modes"] == ",".join(modes)
    for mode in modes:
        s = data["stream"][mode]
        assert len(s["runs"]) == 1 and s["decode_tok_s"] > 0
        assert set(data["steps"][mode]) == {"1", "4"} and all(v["step_ms"] > 0 for v in data["steps"][mode].values())
    assert "quality" not in data  # tests/executor/test_quantization_quality.py holds the bounds
    assert "single stream" in proc.stdout and "decode steps" in proc.stdout
