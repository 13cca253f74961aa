"""Smoke test of scripts/bench_serving.py --quick on a tiny checkpoint: it starts a real executor and
scheduler, streams concurrent requests through them, stops them, runs both transformers baselines on the
same prompts and writes sane JSON and a PNG.

No timing assertions: the machine is shared and noisy; only structure, positivity and exact output
lengths are checked.
"""
from __future__ import annotations

import json


N, INPUT_LEN, OUTPUT_LEN, CONCURRENCY = 4, 16, 8, 2
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_bench_serving_quick(tiny_checkpoint, tmp_path, run_bench):
    model_dir = tiny_checkpoint("llama")
    out = tmp_path / "results" / "serving.json"  # the parent dir does not exist yet: the script creates it
    proc = run_bench("bench_serving", "--quick", "--model", str(model_dir), "--baseline", "hf,hf-serial",
                     "--num-requests", str(N), "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
                     "--concurrency", str(CONCURRENCY), "--out", str(out), timeout=180)
    data = json.loads(out.read_text())

    assert data["benchmark"] == "bench_serving"
    cfg = data["config"]
    assert (cfg["num_requests"], cfg["input_len"], cfg["output_len"], cfg["concurrency"]) == \
        (N, INPUT_LEN, OUTPUT_LEN, CONCURRENCY)
    assert data["machine"]["cpu_count"] >= 1 and cfg["threads"] >= 1
    assert data["peak"]["gflops"] > 0
    assert data["model"]["flops"]["per_request"]["total"] > 0
    assert data["servers"]["scheduler"]["address"].startswith("127.0.0.1:")
    assert data["servers"]["exit_codes"] == {"scheduler": 0, "executor": 0}  # SIGTERM -> clean drain
    assert data["all_exact_output_len"] is True

    assert set(data["sides"]) == {"tandem", "hf", "hf-serial"}
    for name, side in data["sides"].items():
        assert side["requests"] == side["completed"] == side["exact_output_len"] == N, name
        assert side["failed"] == 0, name
        for key in ("duration_s", "request_throughput", "output_throughput", "total_token_throughput", "gflops",
                    "pct_peak"):
            assert side[key] > 0, (name, key, side[key])
        assert side["output_tokens"] == N * OUTPUT_LEN, name
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            for stat in ("mean", "p50", "p99"):
                assert side[metric][stat] >= 0, (name, metric, stat)
            assert side[metric]["mean"] > 0 or metric == "itl_ms", (name, metric)
        assert side["itl_ms"]["n"] == N * (OUTPUT_LEN - 1), name  # one ITL value per token after the first
        assert len(side["per_request"]) == N
        for r in side["per_request"]:
            assert r["error"] is None and r["output_len"] == OUTPUT_LEN and len(r["output_ids"]) == OUTPUT_LEN, \
                (name, r)
            assert r["ttft_ms"] > 0 and r["latency_ms"] >= r["ttft_ms"], (name, r)
    for r in data["sides"]["tandem"]["per_request"]:
        assert r["finish_reason"] == "FINISH_REASON_LENGTH"
        assert r["usage"]["prompt_tokens"] == INPUT_LEN and r["usage"]["completion_tokens"] == OUTPUT_LEN
    for name in ("hf", "hf-serial"):
        ratio = data["ratios"][name]
        assert ratio["output_throughput"] > 0 and ratio["target"] > 0
        assert data["sides"][name]["agreement_with_tandem"]["compared"] == N

    png = out.with_suffix(".png")
    assert data["plot"] == str(png)
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    # The tables went to stdout.
    assert "out tok/s" in proc.stdout and "TTFT p99" in proc.stdout and "tandem speedup" in proc.stdout


def test_bench_serving_backends_quick(tiny_checkpoint, tmp_path, run_bench):
    """--backend grpc,openai-chat: one scheduler with its HTTP front, the same chat prompts through both, two
    alternating rounds; both sides did exactly the same token work and the comparison is in the JSON."""
    model_dir = tiny_checkpoint("llama")
    out = tmp_path / "serving.json"
    proc = run_bench("bench_serving", "--quick", "--model", str(model_dir), "--backend", "grpc,openai-chat",
                     "--out", str(out), timeout=120)
    data = json.loads(out.read_text())

    assert data["config"]["backends"] == ["grpc", "openai-chat"] and data["config"]["rounds"] == 2
    assert data["config"]["chat_prompts"] is True
    assert data["backends"] == {"grpc": "tandem", "openai-chat": "openai-chat"}
    assert data["servers"]["scheduler"]["http_url"].startswith("http://127.0.0.1:")
    assert data["servers"]["exit_codes"] == {"scheduler": 0, "executor": 0}
    assert "--no-prefix-caching" in data["servers"]["executor"]["command"]  # phases reuse the prompts
    assert data["all_exact_output_len"] is True
    grpc_side, http_side = data["sides"]["tandem"], data["sides"]["openai-chat"]
    for side in (grpc_side, http_side):
        assert side["requests"] == side["completed"] == side["exact_output_len"] == 2 * N  # 2 rounds of N
        assert side["output_tokens"] == 2 * N * OUTPUT_LEN
        assert side["output_throughput"] > 0 and side["ttft_ms"]["p50"] > 0 and side["tpot_ms"]["mean"] > 0
    # The same work: the same rendered chat prompts (prompt tokens from each front's usage) and outputs.
    assert grpc_side["input_tokens"] == http_side["input_tokens"] > 2 * N * INPUT_LEN // 2
    assert sorted(r["usage"]["prompt_tokens"] for r in grpc_side["per_request"]) == \
        sorted(r["usage"]["prompt_tokens"] for r in http_side["per_request"])
    assert {r["finish_reason"] for r in grpc_side["per_request"]} == {"FINISH_REASON_LENGTH"}
    assert {r["finish_reason"] for r in http_side["per_request"]} == {"length"}
    cmp = data["backend_comparison"]
    assert cmp["equal_tokens"] is True and cmp["identical_outputs"]["compared"] == N
    assert cmp["output_throughput"] > 0 and cmp["ttft_p50"] > 0
    assert set(cmp["targets"]) == {"output_throughput", "ttft_p50"}
    assert [(p["round"], p["backend"]) for p in cmp["phases"]] == \
        [(0, "grpc"), (0, "openai-chat"), (1, "openai-chat"), (1, "grpc")]
    assert "openai-chat / grpc" in proc.stdout and "target throughput" in proc.stdout
