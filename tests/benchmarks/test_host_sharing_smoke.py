"""Smoke test of `python -m benchmarks host_sharing --quick` on the tiny checkpoint: real executor processes (one
and two per layout, pinned with --cpu-cores or not), sane JSON. No timing assertions (shared, noisy machine)."""
from __future__ import annotations

import os

import pytest


@pytest.mark.long  # a benchmark's smoke run (minutes in all): scripts/test --long
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to share")
def test_host_sharing_quick(model_dir, run_bench):
    cores = ",".join(map(str, sorted(os.sched_getaffinity(0))[:2]))
    proc, data = run_bench("host_sharing", "--quick", "--model", str(model_dir), "--cores", cores, timeout=600)
    rows = {r["layout"]: r for r in data["rows"]}
    assert set(rows) == {"1xN", "2xhalf-pinned", "2xhalf", "2xN"}
    assert [rows[k]["executors"] for k in ("1xN", "2xhalf-pinned", "2xhalf", "2xN")] == [1, 2, 2, 2]
    assert [rows[k]["threads"] for k in ("1xN", "2xhalf-pinned", "2xhalf", "2xN")] == [2, 1, 1, 2]
    for r in rows.values():
        assert r["tokens"] == 2 * 16 and r["tok_s"] > 0 and r["cpu_s"] > 0, r
    assert rows["1xN"]["vs_1xN"] == "1.00x" and "tok/s" in proc.stdout
