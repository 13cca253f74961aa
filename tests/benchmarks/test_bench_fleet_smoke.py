"""Smoke test of scripts/bench_fleet.py --quick on a tiny checkpoint: both parts — scaling (1 executor x 2 threads,
then 2 x 1, each behind one scheduler) and failover (2 executors, one SIGKILLed once every stream has started) —
against real server processes, and JSON whose counts add up. The failover run must lose no stream: every one
completes, with no error, the clean run's tokens (greedy).

No timing assertions (the machine is shared and noisy); only structure, counts and tokens.
"""
from __future__ import annotations

import json

N, OUT, STREAMS, F_IN, F_OUT, KILL_AFTER = 8, 8, 4, 16, 128, 2  # the --quick preset


def test_bench_fleet_quick(tiny_checkpoint, tmp_path, run_bench):
    model_dir = tiny_checkpoint("llama")
    out = tmp_path / "results" / "fleet.json"  # the parent dir does not exist yet: the script creates it
    proc = run_bench("bench_fleet", "--quick", "--model", str(model_dir), "--out", str(out), timeout=120)
    data = json.loads(out.read_text())

    assert data["benchmark"] == "bench_fleet" and data["ok"] is True
    cfg = data["config"]
    assert (cfg["num_requests"], cfg["output_len"], cfg["failover_streams"], cfg["failover_input_len"],
            cfg["failover_output_len"], cfg["kill_after_tokens"]) == (N, OUT, STREAMS, F_IN, F_OUT, KILL_AFTER)
    assert cfg["parts"] == ["scaling", "failover"] and data["machine"]["cpu_count"] >= 1

    scaling = data["scaling"]
    assert list(scaling["runs"]) == ["1x2", "2x1"] and scaling["all_exact_output_len"] is True
    for name, side in scaling["runs"].items():
        executors = int(name.split("x")[0])
        assert (side["executors"], side["threads"]) == (executors, int(name.split("x")[1]))
        assert side["requests"] == side["completed"] == side["exact_output_len"] == N and side["failed"] == 0
        assert side["output_tokens"] == N * OUT
        for key in ("request_throughput", "output_throughput", "duration_s"):
            assert side[key] > 0, (name, key)
        for metric in ("ttft_ms", "tpot_ms"):
            assert side[metric]["n"] == N and 0 <= side[metric]["p50"] <= side[metric]["p99"], (name, metric)
        work = side["executor_work"]
        assert len(work) == executors and sum(w["requests"] for w in work) == N  # one cache per request
        assert sum(w["tokens_sampled"] for w in work) == N * OUT
        codes = side["servers"]["exit_codes"]
        assert set(codes) == {"scheduler", *(f"executor-{i}" for i in range(executors))}
        assert all(c == 0 for c in codes.values()), codes  # SIGTERM -> clean drain
    ratio = scaling["ratios"]["2x1"]
    assert ratio["baseline"] == "1x2"
    for key in ("request_throughput", "output_throughput", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99",
                "duration_s"):
        assert ratio[key] > 0, key

    f = data["failover"]
    assert f["killed"] is True and f["clean_on_scaling_fleet"] is True
    assert f["all_completed"] is True and f["clean_all_completed"] is True
    assert f["identical_to_clean"] is True and f["agreement_with_clean"]["compared"] == STREAMS
    kill = f["kill"]
    assert kill["streams_finished_before"] == 0 and kill["tokens_streamed_before"] >= STREAMS * KILL_AFTER
    victim = kill["index"]
    codes = f["runs"]["failover"]["servers"]["exit_codes"]
    assert codes[f"executor-{victim}"] == -9 and codes["scheduler"] == 0
    assert all(c == 0 for k, c in codes.items() if k not in ("scheduler", f"executor-{victim}")), codes
    states = {e["address"]: e["state"] for e in f["executor_states_after"]}
    assert states.pop(kill["address"]) == "STATE_UNREACHABLE" and set(states.values()) == {"STATE_SERVING"}

    s = f["summary"]
    assert s["unknown"] == 0 and s["moved"]["streams"] + s["stayed"]["streams"] == STREAMS
    assert s["moved"]["streams"] >= 1 and s["moved_matches_victim_running"] is True
    assert s["all_completed"] is True and s["moved"]["errors"] == s["stayed"]["errors"] == 0
    streams = f["per_stream"]
    assert [v["index"] for v in streams] == list(range(STREAMS))
    for v in streams:
        assert v["completed"] and v["identical_to_clean"] and v["error"] is None, v
        assert v["tokens_before_kill"] >= KILL_AFTER and v["next_token_after_kill_ms"] >= 0, v
        if v["moved"]:
            assert v["preemptions"] >= 1 and v["resume_after_kill_ms"] >= v["next_token_after_kill_ms"]
            assert KILL_AFTER <= v["tokens_before_kill"] <= v["tokens_before_resume"] < F_OUT
            assert v["recomputed_tokens"] == F_IN + v["tokens_before_resume"]
        else:
            assert v["preemptions"] == 0 and v["recomputed_tokens"] == 0 and v["resume_after_kill_ms"] is None
    moved = [v for v in streams if v["moved"]]
    assert s["recomputed_tokens"] == sum(v["recomputed_tokens"] for v in moved) > len(moved) * F_IN
    assert s["recomputed_prompt_tokens"] == len(moved) * F_IN
    assert s["executor_extra_tokens"] > 0  # the work lost with the victim (exact value: racy by a step)
    for name in ("clean", "failover"):
        run = f["runs"][name]
        assert run["requests"] == run["completed"] == run["exact_output_len"] == STREAMS, name
    assert f["ratios"]["duration_s"] > 0 and f["ratios"]["output_throughput"] > 0

    assert "out tok/s" in proc.stdout and "TPOT p99" in proc.stdout and "kill->resume" in proc.stdout
    assert "tokens identical to the clean run (greedy): 4/4" in proc.stdout
