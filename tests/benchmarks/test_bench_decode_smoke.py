"""Smoke test of scripts/bench_decode.py on the tiny checkpoint: real executor + scheduler per mode
(float32-eager, float32-native, int8-native; the compiled mode's compiles cost ~80 s here, so its server is
tested in tests/executor/test_compiled_decode.py instead), in-process decode steps, and the quality part,
writing JSON whose figures are consistent. Timings are never asserted (noisy machine); llama.cpp is not part
of the smoke run."""
from __future__ import annotations

import json


def test_bench_decode_quick(model_dir, tmp_path, run_bench):
    out = tmp_path / "decode.json"
    proc = run_bench("bench_decode", "--model", str(model_dir), "--quick", "--out", str(out), timeout=240)
    data = json.loads(out.read_text())
    modes = ("float32-eager", "float32-native", "int8-native")
    assert data["benchmark"] == "bench_decode" and data["config"]["modes"] == ",".join(modes)
    assert data["stream"]["float32-native"]["restart_s"] is None  # only the compiled mode is started twice
    for mode in modes:
        s = data["stream"][mode]
        assert len(s["runs"]) == 1 and s["decode_tok_s"] > 0 and s["ready_s"] > 0
        assert set(data["steps"][mode]) == {"1", "4"}
        assert all(v["step_ms"] > 0 and abs(v["tok_s"] - int(b) * 1e3 / v["step_ms"]) < 1e-6
                   for b, v in data["steps"][mode].items())
    assert set(data["quality"]) == {"int8-native"}  # float32 modes are the reference
    q = data["quality"]["int8-native"]
    assert q["total_tokens"] == 4 * q["steps"] and 0 <= q["agreed_tokens"] <= q["top1_matches"] <= q["total_tokens"]
    assert abs(q["nll_delta"] - (q["nll"] - q["nll_float32"])) < 1e-9 and abs(q["nll_delta"]) < 0.1
    assert "single stream" in proc.stdout and "decode steps" in proc.stdout and "quality vs float32" in proc.stdout
    assert "vs eager" in proc.stdout
