"""The executor's resident memory stays bounded under load (issue 47, docs/operations.md 'Memory'): a real
executor and scheduler on the tiny model, 2,000 short generations at concurrency 32 (prompts of varied lengths,
so the batches vary), RSS sampled from /proc (scripts/executor_rss.py's load). After a warm-up of 200 requests
the RSS may grow by at most RSS_GROWTH_MB. And the malloc bounds themselves: the idle trim runs only when no call
waits and at most once per interval; the flags refuse negative values."""
from __future__ import annotations

import pytest

from executor_service.malloc_tuning import IdleTrim, set_arena_max
from tests.conftest import load_script
from tests.grpc_harness import start_executor, start_scheduler

pytestmark = pytest.mark.fresh_process  # measures an executor's resident memory: a fresh interpreter's

REQUESTS = 2000
WARM_UP = 200
RSS_GROWTH_MB = 48  # measured: +0-4 MB after the warm-up with the defaults (docs/operations.md, 'Memory')


def test_rss_after_2000_requests_stays_within_its_bound(model_dir):
    rss = load_script("executor_rss")
    with start_executor(model_dir, "--kv-blocks", "128") as ex, start_scheduler(ex.address) as sch:
        assert "malloc: 2 arenas, trimmed when the model thread idles (at most every 10 s)" in ex.stderr()
        warm = rss.run_load(sch.address, ex.proc.pid, WARM_UP, 32, 2, 400, seed=1)
        assert not warm.failed, warm.failed[:3]
        warm_mb = max(mb for _, _, mb in warm.samples)
        load = rss.run_load(sch.address, ex.proc.pid, REQUESTS, 32, 2, 400, seed=2)
        assert (load.done, load.failed) == (REQUESTS, [])
        peak, end = max(mb for _, _, mb in load.samples), load.samples[-1][2]
        assert peak - warm_mb <= RSS_GROWTH_MB and end - warm_mb <= RSS_GROWTH_MB, \
            f"RSS after warm-up {warm_mb:.0f} MB, peak {peak:.0f} MB, end {end:.0f} MB"


def test_idle_trim_runs_when_idle_and_at_most_once_per_interval():
    now = [0.0]
    trim = IdleTrim(10.0, clock=lambda: now[0])
    trim.after_call(0)
    assert trim.trims == 0  # not before the first interval
    now[0] = 11.0
    trim.after_call(3)
    assert trim.trims == 0  # calls wait: never delay them
    trim.after_call(0)
    assert trim.trims == 1
    now[0] = 15.0
    trim.after_call(0)
    assert trim.trims == 1  # within the interval
    never = IdleTrim(0.0, clock=lambda: now[0])
    now[0] = 1e9
    never.after_call(0)
    assert never.trims == 0


def test_malloc_flags_refuse_negative_values():
    with pytest.raises(ValueError, match="--malloc-arena-max"):
        set_arena_max(-1)
    with pytest.raises(ValueError, match="--malloc-trim-s"):
        IdleTrim(-1.0)
    assert set_arena_max(0)  # glibc's default: nothing to set
