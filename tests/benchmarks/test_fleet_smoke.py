"""`python -m benchmarks fleet --quick` on a tiny checkpoint: scaling (1 executor x 2 threads, then 2 x 1) and
failover (2 executors, one SIGKILLed once every stream has started) against real server processes, losing no
stream; and the failover analysis on made-up records. No timing assertions (shared, noisy machine)."""
from __future__ import annotations

import pytest

from benchmarks.fleet_failover import stream_view
from benchmarks.request_metrics import Record

STREAMS, F_IN, F_OUT, KILL_AFTER = 4, 16, 128, 2  # the --quick preset


@pytest.mark.long  # a benchmark's smoke run (minutes in all): scripts/test --long
def test_fleet_quick(model_dir, run_bench):
    proc, data = run_bench("fleet", "--quick", "--model", str(model_dir), timeout=180)
    assert data["ok"] is True
    scaling = data["scaling"]
    assert list(scaling["runs"]) == ["1x2", "2x1"] and scaling["all_exact_output_len"] is True
    for name, side in scaling["runs"].items():
        assert side["requests"] == side["completed"] == side["exact_output_len"] == 8
        work = side["executor_work"]
        assert len(work) == side["executors"] and sum(w["requests"] for w in work) == 8
        assert sum(w["tokens_sampled"] for w in side["executor_work"]) == 8 * 8
        assert all(c == 0 for c in side["exit_codes"].values()), side["exit_codes"]  # SIGTERM -> clean drain
    assert all(v > 0 for v in scaling["ratios"]["2x1"].values())

    f = data["failover"]
    assert f["killed"] and f["clean_on_scaling_fleet"] and f["all_completed"] and f["clean_all_completed"]
    assert f["identical_to_clean"] is True  # greedy: the moved streams recomputed the same tokens
    victim = f["kill"]["index"]
    assert f["exit_codes"][f"executor-{victim}"] == -9 and f["exit_codes"]["scheduler"] == 0
    states = {e["address"]: e["state"] for e in f["executor_states_after"]}
    assert states.pop(f["kill"]["address"]) == "STATE_UNREACHABLE" and set(states.values()) == {"STATE_SERVING"}
    s = f["summary"]
    assert s["unknown"] == 0 and s["moved"]["streams"] >= 1 and s["moved_matches_victim_running"] is True
    assert s["moved"]["streams"] + s["stayed"]["streams"] == STREAMS
    for v in f["per_stream"]:
        assert v["completed"] and v["identical_to_clean"] and v["tokens_before_kill"] >= KILL_AFTER, v
        if v["moved"]:
            assert v["recomputed_tokens"] == F_IN + v["tokens_before_resume"] < F_IN + F_OUT
        else:
            assert v["recomputed_tokens"] == 0 and v["resume_after_kill_ms"] is None
    assert "kill->resume" in proc.stdout and "tokens identical to the clean run (greedy): 4/4" in proc.stdout


def record(times: list[float], preemptions: int) -> Record:
    rec = Record(0, 10, start=0.0, end=times[-1], messages=[(t, 1) for t in times], output_ids=list(range(len(times))),
                 finish_reason="length")
    rec.usage = {"prompt_tokens": 10, "completion_tokens": len(times), "preemptions": preemptions}
    return rec


def test_a_moved_stream_resumes_after_its_largest_gap_not_at_a_straggler():
    # tokens every 0.1 s; kill at 0.55; a straggler sampled before the kill arrives at 0.56; the move costs 2 s
    times = [0.1, 0.2, 0.3, 0.4, 0.5, 0.56, 2.56, 2.66]
    v = stream_view(record(times, preemptions=1), t_kill=0.55, output_len=len(times))
    assert v["moved"] and v["completed"] and v["paused"] and v["tokens_before_kill"] == 5
    assert v["next_token_after_kill_ms"] == pytest.approx(10) and v["resume_after_kill_ms"] == pytest.approx(2010)
    assert v["tokens_before_resume"] == 6 and v["recomputed_tokens"] == 16


def test_a_stream_that_stayed_recomputes_nothing():
    v = stream_view(record([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], preemptions=0), t_kill=0.35, output_len=6)
    assert v["moved"] is False and not v["paused"] and v["recomputed_tokens"] == 0 and v["resume_after_kill_ms"] is None
