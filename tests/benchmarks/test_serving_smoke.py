"""Smoke tests of the benchmarks that load the stack through the scheduler's OpenAI front (`serving`, `prefix`,
`spec`) and of that one client: real executor + scheduler processes on the tiny checkpoint, JSON whose counts add
up. No timing assertions (the machine is shared and noisy)."""
from __future__ import annotations

import asyncio

import pytest

from benchmarks import openai_client
from tests.grpc_harness import start_for, start_scheduler_for

N, INPUT_LEN, OUTPUT_LEN = 4, 16, 8


@pytest.mark.long  # a benchmark's smoke run (minutes in all): scripts/test --long
def test_serving_quick_with_both_baselines(model_dir, run_bench):
    proc, data = run_bench("serving", "--quick", "--model", str(model_dir), "--baseline", "hf,hf-serial", timeout=180)
    assert data["servers"]["http_url"].startswith("http://127.0.0.1:") and data["all_exact_output_len"] is True
    assert data["servers"]["exit_codes"] == {"scheduler": 0, "executor": 0}  # SIGTERM -> clean drain
    assert set(data["sides"]) == {"tandem", "hf", "hf-serial"}
    for name, side in data["sides"].items():
        assert side["requests"] == side["completed"] == side["exact_output_len"] == N, name
        assert side["output_tokens"] == N * OUTPUT_LEN and side["gflops"] > 0 and side["output_throughput"] > 0
        assert side["itl_ms"]["n"] == N * (OUTPUT_LEN - 1), name  # one ITL value per token after the first
        assert all(r["ttft_ms"] > 0 and r["latency_ms"] >= r["ttft_ms"] for r in side["per_request"]), name
    for r in data["sides"]["tandem"]["per_request"]:
        assert r["finish_reason"] == "length" and r["usage"]["prompt_tokens"] == INPUT_LEN
        assert r["usage"]["completion_tokens"] == OUTPUT_LEN == len(r["output_ids"])
    assert data["ratios"]["hf"]["tandem_over_side"] > 0
    assert data["sides"]["hf-serial"]["agreement_with_tandem"]["compared"] == N
    assert "out tok/s" in proc.stdout and "TTFT p99" in proc.stdout and "tandem/side" in proc.stdout


@pytest.mark.long  # a benchmark's smoke run (minutes in all): scripts/test --long
def test_prefix_both_workloads(model_dir, run_bench):
    s, q, questions, conversations, turns, out = 40, 8, 4, 3, 3, 4
    proc, data = run_bench("prefix", "--model", str(model_dir), "--modes", "on", "--system-tokens", str(s),
                           "--questions", str(questions), "--question-tokens", str(q), "--conversations",
                           str(conversations), "--turns", str(turns), "--output-len", str(out), "--concurrency", "2",
                           "--warmup", "0")
    assert data["all_exact_output_len"] is True
    expected = {"system-prompt": [s + q] * questions,
                "multi-turn": [s + t * q + (t - 1) * out for _ in range(conversations) for t in range(1, turns + 1)]}
    for workload, prompts in expected.items():
        run = data["runs"][workload]["on"]
        assert run["servers"]["exit_codes"] == {"scheduler": 0, "executor": 0}
        assert [r["prompt_len"] for r in run["per_request"]] == prompts
        for r in run["per_request"]:  # reuse is whole blocks (all but the last token when all are), never all
            cached = r["usage"]["cached_tokens"]
            assert (cached % 16 == 0 or cached == r["prompt_len"] - 1) and 0 <= cached < r["prompt_len"]
        p = run["prefix"]
        assert p["prompt_tokens_sent"] == sum(prompts) and 0.0 <= p["hit_rate"] <= 1.0
        assert p["prompt_tokens_computed"] == sum(prompts) - p["cached_tokens"]
        # the executor ran the prompt tokens not found in the cache (no preemption: the pool holds the workload)
        assert p["executor_prompt_tokens_processed"] == p["prompt_tokens_computed"]
    turns_seen = [(r["conversation"], r["turn"]) for r in data["runs"]["multi-turn"]["on"]["per_request"]]
    assert turns_seen == [(c, t) for c in range(conversations) for t in range(1, turns + 1)]
    assert data["runs"]["multi-turn"]["on"]["ttft_late_turns_ms"]["n"] == conversations
    measured = [c["metric"] for c in data["comparisons"] if c["ratio"] is not None]  # one mode: no on/off ratio
    assert measured == ["prompt tokens computed / sent (on)"]
    assert "hit rate" in proc.stdout and "cache on" in proc.stdout


@pytest.mark.long  # a benchmark's smoke run (minutes in all): scripts/test --long
def test_spec_off_and_on_agree(model_dir, run_bench):
    proc, data = run_bench("spec", "--model", str(model_dir), "--concurrency", "2", "--requests", "3",
                           "--output-len", "12", "--spec-args=--speculative ngram --ngram-min 1", timeout=180)
    assert [(c["workload"], c["concurrency"]) for c in data["cells"]] == [("copy", 2), ("chat", 2)]
    for c in data["cells"]:
        assert c["identical"] == c["compared"] == 3  # speculation never changes greedy output
        off, on = c["sides"]["off"], c["sides"]["on"]
        assert off["output_tokens"] == on["output_tokens"] > 0 and not off["errors"] and not on["errors"]
        usage = [r["usage"] for rs in c["records"]["on"] for r in rs]
        assert sum(u["drafted_tokens"] for u in usage) == c["drafted_tokens"]  # Prometheus agrees with usage
        assert sum(u["accepted_tokens"] for u in usage) == c["accepted_tokens"] <= c["drafted_tokens"]
    assert "on/off" in proc.stdout


@pytest.fixture(scope="module")
def http_url(request, model_dir):
    executor = start_for(request, model_dir, "--kv-blocks", "64")
    return start_scheduler_for(request, executor.address, "--http-port", "0").process.http_url


def test_client_token_ids_chat_and_errors(http_url):
    ids = [[5 + i, 6, 7, 8] for i in range(3)]
    recs = asyncio.run(openai_client.run(http_url, ids, OUTPUT_LEN, 2, 60.0))
    assert all(r.error is None and r.output_len == len(r.output_ids) == OUTPUT_LEN and r.finish_reason == "length"
               for r in recs)
    assert [r.usage["prompt_tokens"] for r in recs] == [4, 4, 4]
    chat = asyncio.run(openai_client.run(http_url, ["hello", "the quick brown fox"], OUTPUT_LEN, None, 60.0))
    assert all(r.output_len == OUTPUT_LEN and r.prompt_len > 2 for r in chat)
    assert all(r.start <= r.messages[0][0] <= r.end for r in chat)
    (bad,) = asyncio.run(openai_client.run(http_url, [[5] * 4], 100_000, 1, 60.0))
    assert bad.error.startswith("HTTP 400") and not bad.output_ids
    assert set(openai_client.counters(http_url, ["tandem:scheduler_steps_total"])) == {"tandem:scheduler_steps_total"}
