"""Smoke test of `python -m benchmarks prefix --modes on,events,events-stalled`: real executor + scheduler
processes on the tiny checkpoint, the executor publishing KV events on ZMQ in the events modes, read by the
benchmark's own subscriber (and, in events-stalled, beside one that never reads). Checks that events flowed to
the reader without a gap, that every request finished with its full output in every mode, and that the table
and JSON carry the ratios against the run without events. No timing assertions (the machine is shared)."""
from __future__ import annotations

import pytest


@pytest.mark.long  # a benchmark's smoke run (minutes in all): scripts/test --long
def test_prefix_kv_events_modes(model_dir, run_bench):
    questions, out = 4, 16
    proc, data = run_bench("prefix", "--model", str(model_dir), "--workloads", "system-prompt", "--modes",
                           "on,events,events-stalled", "--system-tokens", "48", "--questions", str(questions),
                           "--question-tokens", "8", "--output-len", str(out), "--turns", "1", "--concurrency", "2",
                           "--warmup", "1", timeout=240)
    assert data["all_exact_output_len"] is True
    runs = data["runs"]["system-prompt"]
    assert runs["on"]["kv_events"] is None  # events off: nobody subscribed
    for mode, subscribers in (("events", ["active"]), ("events-stalled", ["active", "stalled"])):
        run = runs[mode]
        assert run["completed"] == questions and run["servers"]["exit_codes"] == {"scheduler": 0, "executor": 0}
        assert "--kv-events-endpoint" in run["servers"]["executor_command"]
        ev = run["kv_events"]
        # every request stores blocks (its question's and its output's), each in some batch the reader got
        assert ev["subscribers"] == subscribers and ev["batches"] >= 1 and ev["events"] >= questions, ev
        assert ev["gaps"] == 0, ev  # a subscriber that never reads costs the reader nothing
    rows = {r["mode"]: r for r in data["kv_events"]}
    assert set(rows) == {"on", "events", "events-stalled"} and rows["on"]["tok_s_ratio"] == 1.0
    assert all(rows[m]["tok_s_ratio"] > 0 and rows[m]["tpot_ratio"] > 0 for m in ("events", "events-stalled"))
    assert "KV events on ZMQ" in proc.stdout and "1/TPOT vs on" in proc.stdout
