"""One pass of the scheduler's loop is one RPC in steady state (real executor and scheduler processes, tiny
llama): finished requests' caches are released inside the next step call (release_cache_ids), the step call
renews the session, so while requests run the executor sees only step calls — counted on both sides of the
line from their Prometheus metrics (the executor's per-method RPC counts, the scheduler's step calls)."""
from __future__ import annotations

import concurrent.futures as cf

import pytest

from tandem.generate.v1 import generate_pb2 as pb
from tests.e2e.test_prometheus_metrics import delta, scrape
from tests.grpc_harness import start_for, start_scheduler_for
from tests.scheduler_client import collect, ids_request, wait_kv_free

# (prompt length, max_new_tokens): every request ends at another pass, while others still run
LENGTHS = [(6, 6), (9, 10), (12, 14), (7, 18), (10, 22), (8, 26), (11, 30), (5, 40)]
# An anchor runs from before the first of them until well after the last, so the loop never goes idle in
# between however late a loaded machine delivers the eight (an idle loop releases with a call of its own).
ANCHOR_NEW = 160
_RPC = 'tandem:executor_rpc_duration_seconds_count{{method="{}"}}'


@pytest.fixture(scope="module")
def executor(request, model_dir):
    return start_for(request, model_dir, "--kv-blocks", "256", "--metrics-port", "0")


@pytest.fixture(scope="module")
def scheduler(request, executor):
    return start_scheduler_for(request, executor.address, "--metrics-port", "0")


def _fixed(ids: list[int], new: int) -> pb.GenerateRequest:
    # min_new_tokens = max: EOS is banned to the end, so every pass is one decode step (no bursts) and
    # each request ends at its own pass
    return ids_request(ids, new, stopping=pb.StoppingCriteria(max_new_tokens=new, min_new_tokens=new))


def _run(scheduler) -> None:
    anchor = scheduler.stub.Generate(_fixed([1, 7, 9, 11], ANCHOR_NEW), timeout=120)
    first = next(anchor)  # running now: the loop has work until it ends
    assert first.token_ids

    def send(n: int) -> pb.Usage:
        prompt_len, new = LENGTHS[n]
        ids = [1] + [5 + (11 * n + i) % 380 for i in range(prompt_len - 1)]
        return collect(scheduler.stub, _fixed(ids, new)).usage

    with cf.ThreadPoolExecutor(len(LENGTHS)) as pool:
        usages = list(pool.map(send, range(len(LENGTHS))))
    assert [u.completion_tokens for u in usages] == [n for _, n in LENGTHS]
    rest = [t for msg in anchor for t in msg.token_ids]
    assert len(first.token_ids) + len(rest) == ANCHOR_NEW


def test_a_pass_is_one_rpc_in_steady_state(scheduler, executor):
    before_e, before_s = scrape(executor), scrape(scheduler)
    _run(scheduler)
    kv = wait_kv_free(executor.stub)  # every finished request's cache was released
    assert kv.active_caches == 0
    after_e, after_s = scrape(executor), scrape(scheduler)
    rpcs = {m: delta(after_e, before_e, _RPC.format(m))
            for m in ("UnifiedDecode", "Decode", "ReleaseCache", "KeepAlive", "CreateCache", "GetInfo")}
    step_calls = delta(after_s, before_s, f'tandem:scheduler_steps_total{{executor="{executor.address}"}}')
    assert step_calls >= ANCHOR_NEW, (step_calls, rpcs)
    assert rpcs["UnifiedDecode"] + rpcs["Decode"] == step_calls, rpcs
    # 9 requests ended; their caches rode with the step calls that followed. A ReleaseCache of its own only
    # for the anchor, the last (no step call follows it: the scheduler is idle then); no KeepAlive while
    # stepping.
    assert rpcs["ReleaseCache"] <= 1, rpcs
    assert rpcs["KeepAlive"] == 0, rpcs
    # CreateCache: prefix lookups when the requests arrived (not per pass); nothing else the loop sends
    assert rpcs["CreateCache"] <= len(LENGTHS) + 1, rpcs
    others = rpcs["ReleaseCache"] + rpcs["KeepAlive"] + rpcs["CreateCache"]
    print(f"\n{step_calls:.0f} passes with a step call; RPCs: {rpcs}; "
          f"{(step_calls + others) / step_calls:.3f} RPCs per pass")
    assert (step_calls + others) / step_calls < 1.25
