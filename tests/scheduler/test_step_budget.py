"""The step's token budget (--max-batch-tokens): unset, it follows the executor's device — 512 on a CPU (prompts
arriving together spread over steps of one --prefill-chunk, so the first ones start decoding while the others
prefill), 2048 elsewhere — never below --max-running and always within the executor's own limit; given, it is
used as it is. Also through the command line, and after an executor comes back (reconfigure)."""
from __future__ import annotations

import pytest

from scheduler.__main__ import parse_args
from scheduler.config import SchedulerConfig, step_tokens_default
from scheduler.engine.policy import SchedulingPolicy
from tandem.kv_usage import KvUsage

KV = KvUsage(free_blocks=100, total_blocks=100, block_size=16)


def budget(device: str, executor_limit: int = 8192, **cfg) -> int:
    return SchedulingPolicy(SchedulerConfig("x", **cfg), KV, executor_limit, device=device).planner.max_batch_tokens


def test_unset_it_follows_the_device():
    assert budget("cpu") == 512
    assert budget("cuda:0") == budget("cuda") == 2048
    assert budget("") == 2048  # (an executor that names no device: the larger budget, as before)
    assert step_tokens_default("cpu", 64) == 512


def test_never_below_max_running_and_within_the_executors_limit():
    assert budget("cpu", max_running=600) == 600
    assert budget("cpu", executor_limit=300) == 300
    assert budget("cuda:0", executor_limit=1024) == 1024


def test_given_it_is_used_on_any_device():
    assert budget("cpu", max_batch_tokens=4096) == 4096
    assert budget("cuda:0", max_batch_tokens=256) == 256


def test_an_executor_back_on_another_device_changes_it():
    policy = SchedulingPolicy(SchedulerConfig("x"), KV, 8192, device="cuda:0")
    policy.reconfigure(KV, 8192, 0, "cpu")
    assert policy.planner.max_batch_tokens == 512


def test_the_flag():
    assert parse_args(["--executor", "127.0.0.1:1"]).max_batch_tokens is None
    assert parse_args(["--executor", "127.0.0.1:1", "--max-batch-tokens", "1024"]).max_batch_tokens == 1024
    with pytest.raises(ValueError, match="--max-batch-tokens must be >= 1"):
        SchedulerConfig("x", max_batch_tokens=0).validate()
