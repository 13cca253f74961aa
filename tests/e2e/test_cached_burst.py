"""A burst of prompts the prefix cache already holds, through the whole stack (real executor and scheduler
processes, tiny llama): every request of the second burst reuses all but the last token of its block-aligned
prompt (usage.cached_tokens), the executor runs exactly one prompt token per request for it (GetMetrics'
tokens_processed), and the streams are token for token those of the cold burst."""
from __future__ import annotations

import concurrent.futures as cf

import pytest

from tandem.executor.v1 import executor_pb2 as epb
from tandem.generate.v1 import generate_pb2 as pb
from tests.grpc_harness import start_for, start_scheduler_for
from tests.scheduler_client import collect, ids_request, wait_kv_free

N, BLOCKS, NEW = 8, 4, 6
STOP = pb.StoppingCriteria(max_new_tokens=NEW, ignore_eos=True)
PROMPTS = [[1] + [3 + (n * 53 + i * 31) % 397 for i in range(BLOCKS * 16 - 1)] for n in range(N)]  # 64 tokens


@pytest.fixture(scope="module")
def stack(request, model_dir):
    executor = start_for(request, model_dir, "--kv-blocks", "256")
    # (no drafts: their tokens would count among those computed)
    return executor, start_scheduler_for(request, executor.address, "--speculative", "off")


def _burst(scheduler) -> list[tuple[list[int], pb.Usage]]:
    with cf.ThreadPoolExecutor(N) as pool:
        got = list(pool.map(lambda p: collect(scheduler.stub, ids_request(p, 0, stopping=STOP)), PROMPTS))
    return [(g.token_ids, g.usage) for g in got]


def _processed(executor) -> int:
    return executor.stub.GetMetrics(epb.GetMetricsRequest()).tokens_processed


def test_a_cached_burst_computes_one_prompt_token_per_request(stack):
    executor, scheduler = stack
    cold = _burst(scheduler)
    assert all(u.cached_tokens == 0 and u.completion_tokens == NEW for _, u in cold)
    wait_kv_free(executor.stub)
    before = _processed(executor)
    again = _burst(scheduler)
    processed = _processed(executor) - before
    assert [u.cached_tokens for _, u in again] == [len(p) - 1 for p in PROMPTS]
    assert [u.preemptions for _, u in again] == [0] * N
    # one prompt token each, then the NEW - 1 tokens fed back while decoding
    assert processed == N * (1 + NEW - 1), processed
    assert [ids for ids, _ in again] == [ids for ids, _ in cold]  # the same greedy streams
    kv = wait_kv_free(executor.stub)
    assert kv.active_caches == 0
