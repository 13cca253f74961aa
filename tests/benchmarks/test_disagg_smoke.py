"""`python -m benchmarks disagg --quick` on a tiny checkpoint, real processes: the roles part (prefill + decode
executors vs two `both`, decoding streams beside long prompts) and the migration part (SIGTERM: streams move
with their KV; SIGKILL: recomputed), losing no stream, with the same tokens on both paths. No timing
assertions (shared, noisy machine)."""
from __future__ import annotations

import pytest


@pytest.mark.long  # a benchmark's smoke run (minutes in all): scripts/test --long
def test_disagg_quick(model_dir, run_bench):
    proc, data = run_bench("disagg", "--quick", "--model", str(model_dir), timeout=300)
    disagg, both = data["roles"]
    assert disagg["config"] == "prefill + decode" and both["config"] == "both + both"
    assert disagg["errors"] == both["errors"] == 0
    assert disagg["transfers"] > 0 and disagg["transfer_kib"] > 0  # every request's KV moved once
    assert both["transfers"] == 0  # no role: nothing moves
    migrate, recompute = data["migration"]
    assert migrate["errors"] == recompute["errors"] == 0
    assert migrate["migrated"] > 0 and migrate["recomputed_tokens"] == 0
    assert recompute["migrated"] == 0 and recompute["recomputed_tokens"] > 0
    assert data["migration_tokens_identical"] is True
    assert "ITL p99" in proc.stdout and "pause p50 ms" in proc.stdout
