"""Smoke test of scripts/bench_prefix.py on a tiny checkpoint: both workloads, tiny, with the cache on (the mode
an executor of any version runs; `off` needs its --no-prefix-caching). It starts a real executor and scheduler
per workload, streams the questions and the conversations through them and writes JSON whose counts add up.

No timing assertions (the machine is shared and noisy), and no assertion on how much is cached: only that the
counts are consistent, whatever the executor reuses.
"""
from __future__ import annotations

import json

S, QUESTIONS, Q, CONVERSATIONS, TURNS, OUT, CONCURRENCY = 40, 4, 8, 3, 3, 4, 2
BLOCK = 16  # the executor's default block size: reuse comes in whole blocks


def test_bench_prefix_both_workloads(model_dir, tmp_path, run_bench):
    out = tmp_path / "results" / "prefix.json"  # the parent dir does not exist yet: the script creates it
    proc = run_bench("bench_prefix", "--model", str(model_dir), "--modes", "on", "--system-tokens", str(S),
                     "--questions", str(QUESTIONS), "--question-tokens", str(Q), "--conversations", str(CONVERSATIONS),
                     "--turns", str(TURNS), "--output-len", str(OUT), "--concurrency", str(CONCURRENCY),
                     "--warmup", "0", "--out", str(out), timeout=120)
    data = json.loads(out.read_text())

    assert data["benchmark"] == "bench_prefix" and data["all_exact_output_len"] is True
    cfg = data["config"]
    assert cfg["workloads"] == ["system-prompt", "multi-turn"] and cfg["modes"] == ["on"]
    assert cfg["mode_executor_args"] == {"on": []}
    assert data["machine"]["cpu_count"] >= 1 and data["model"]["vocab_size"] > 0
    assert set(data["runs"]) == {"system-prompt", "multi-turn"}

    expected_prompts = {
        "system-prompt": [S + Q] * QUESTIONS,
        "multi-turn": [S + t * Q + (t - 1) * OUT for _ in range(CONVERSATIONS) for t in range(1, TURNS + 1)],
    }
    for workload, runs in data["runs"].items():
        assert set(runs) == {"on"}
        run = runs["on"]
        n = len(expected_prompts[workload])
        assert run["requests"] == run["completed"] == run["exact_output_len"] == n, workload
        assert run["output_tokens"] == n * OUT
        assert run["servers"]["exit_codes"] == {"scheduler": 0, "executor": 0}  # SIGTERM -> clean drain
        recs = run["per_request"]
        assert [r["prompt_len"] for r in recs] == expected_prompts[workload]
        for r in recs:
            assert r["error"] is None and r["finish_reason"] == "FINISH_REASON_LENGTH", r
            assert r["output_len"] == len(r["output_ids"]) == OUT and r["ttft_ms"] > 0
            u = r["usage"]
            assert u["prompt_tokens"] == r["prompt_len"] and u["completion_tokens"] == OUT
            # reuse is whole blocks and never the whole prompt (a token is computed, so logits exist)
            assert u["cached_tokens"] % BLOCK == 0 and 0 <= u["cached_tokens"] < r["prompt_len"]

        p = run["prefix"]
        sent = sum(expected_prompts[workload])
        assert p["prompt_tokens_sent"] == p["usage_prompt_tokens"] == sent
        assert p["cached_tokens"] == sum(r["usage"]["cached_tokens"] for r in recs)
        assert p["prompt_tokens_computed"] == sent - p["cached_tokens"]
        assert p["computed_fraction"] == p["prompt_tokens_computed"] / sent
        assert 0.0 <= p["hit_rate"] <= 1.0 and p["hit_rate_source"] in ("executor", "usage")
        # the executor ran exactly the prompt tokens the scheduler did not get from the cache, plus one decode
        # token per output token after the first (no preemption: the pool holds the whole workload)
        assert p["preemptions"] == 0
        assert p["executor_tokens_processed"] == p["prompt_tokens_computed"] + n * (OUT - 1)
        assert p["executor_prompt_tokens_processed"] == p["prompt_tokens_computed"]
        for metric in ("ttft_ms", "tpot_ms", "e2el_ms"):
            assert run[metric]["n"] == n and run[metric]["mean"] > 0, (workload, metric)
        assert run["request_throughput"] > 0 and run["output_throughput"] > 0

    turns = data["runs"]["multi-turn"]["on"]["per_request"]
    assert [(r["conversation"], r["turn"]) for r in turns] == \
        [(c, t) for c in range(CONVERSATIONS) for t in range(1, TURNS + 1)]
    assert data["runs"]["multi-turn"]["on"]["ttft_late_turns_ms"]["n"] == CONVERSATIONS  # turn 3 of each
    assert data["runs"]["system-prompt"]["on"]["ttft_late_turns_ms"] is None

    # one mode: the on/off ratios are unknown, the cache-on-only target is judged
    rows = {(c["workload"], c["metric"]): c for c in data["comparisons"]}
    assert len(rows) == 4
    for (workload, metric), row in rows.items():
        if row["how"] == "on":
            assert row["result"] == data["runs"][workload]["on"]["prefix"]["computed_fraction"]
            assert row["met"] is (row["result"] <= 0.25)
        else:
            assert row["result"] is None and row["met"] is None and row["off"] is None
    assert data["agreement"] == {"system-prompt": None, "multi-turn": None}
    assert "hit rate" in proc.stdout and "TTFT p99" in proc.stdout and "cache on" in proc.stdout
