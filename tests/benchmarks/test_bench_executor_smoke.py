"""Smoke test of scripts/bench_executor.py --quick on a tiny checkpoint: it starts a real executor server,
runs both sides, stops the server and writes sane JSON.

No timing assertions: the machine is shared and noisy; only structure and positivity are checked.
"""
from __future__ import annotations

import json


CONFIGS = {"tokens", "logits/f32", "logits/bf16", "tokens/x8"}


def test_bench_executor_quick(tiny_checkpoint, tmp_path, run_bench):
    model_dir = tiny_checkpoint("llama")
    out = tmp_path / "results" / "bench_executor.json"  # the parent dir does not exist yet: the script creates it
    proc = run_bench("bench_executor", "--quick", "--model", str(model_dir), "--out", str(out))
    assert "server stopped (exit code 0)" in proc.stderr  # SIGTERM -> clean drain, not a kill
    assert out.is_file()
    data = json.loads(out.read_text())

    assert data["benchmark"] == "bench_executor"
    assert data["machine"]["cpu_count"] >= 1
    assert data["settings"]["threads_per_side"] >= 1
    assert data["server"]["address"].startswith("127.0.0.1:")
    assert data["empty_rpc"]["before"]["median_ms"] > 0

    rows = data["rows"]
    assert {r["config"] for r in rows} == CONFIGS
    assert sorted({r["batch"] for r in rows}) == [1, 4]
    assert len(rows) == len(CONFIGS) * 2
    for r in rows:
        where = (r["config"], r["batch"])
        for key in ("inproc_ms", "grpc_ms", "grpc_over_inproc", "inproc_tok_s", "grpc_tok_s", "response_bytes",
                    "request_bytes"):
            assert r[key] > 0, (where, key, r[key])
        assert all(t > 0 for t in r["inproc_times"]["times_s"]), where
        assert all(t > 0 for t in r["grpc_times"]["times_s"]), where
        assert r["breakdown_ms"]["server_op"] > 0 and r["breakdown_ms"]["inproc_op"] > 0, where
    by = {(r["config"], r["batch"]): r for r in rows}
    for b in (1, 4):
        # float32 logits carry 4 bytes per vocab entry and bfloat16 2: the wire sizes must show it.
        assert by[("logits/f32", b)]["response_bytes"] > by[("logits/bf16", b)]["response_bytes"] \
            > by[("tokens", b)]["response_bytes"]
        multi = by[("tokens/x8", b)]
        assert multi["num_steps"] == 8 and multi["grpc_multi_over_single"] > 0
    # The tables went to stdout, with both sides' columns.
    assert "grpc/inproc" in proc.stdout and "inproc ms/step" in proc.stdout and "grpc ms/step" in proc.stdout
