"""Speculative decoding with a draft model (executor --draft-model), both servers as real processes.

A tiny Llama drafting for itself (its own checkpoint as --draft-model) in a draft pool of 8 blocks (128 tokens), one
executor for the module, schedulers with `--speculative draft_model` and `off`. Covered: outputs (greedy, seeded
sampling, top logprobs) identical to `off`; greedy guesses all accepted (usage, and the scheduler's
tandem:spec_decode_*_by_method{method="draft_model"} counters); a sequence too long for the draft pool gets no
drafts and finishes right (GetInfo draft_model.items_without_drafts); finished and cancelled requests free their
draft caches (live_caches back to 0). In process: tests/executor/test_draft_model.py (another draft model, LRU
eviction, validation, a draft model of another vocabulary refused)."""
from __future__ import annotations

import concurrent.futures as cf
import random
import time

import pytest

from tandem.common.v1 import common_pb2 as cpb
from tandem.executor.v1 import executor_pb2 as epb
from tandem.generate.v1 import generate_pb2 as pb
from tests.e2e.test_prometheus_metrics import scrape
from tests.grpc_harness import start_for, start_scheduler_for
from tests.scheduler_client import cancel_stream, collect, ids_request, wait_kv_free


@pytest.fixture(scope="module")
def executor(request, model_dir):
    """The served model drafting for itself (every greedy guess right) in a draft pool of 8 blocks (128 tokens)."""
    return start_for(request, model_dir, "--kv-blocks", "128", "--draft-model", str(model_dir),
                     "--draft-kv-blocks", "8")


@pytest.fixture(scope="module")
def off(request, executor):
    return start_scheduler_for(request, executor.address, "--speculative", "off")


@pytest.fixture(scope="module")
def drafting(request, executor):
    return start_scheduler_for(request, executor.address, "--speculative", "draft_model", "--metrics-port", "0")


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 400) for _ in range(n - 1)]


def requests() -> list[pb.GenerateRequest]:
    """Greedy, seeded sampling, and top logprobs; prompts with nothing to copy (random tokens)."""
    stop = pb.StoppingCriteria(max_new_tokens=24, ignore_eos=True)
    return [ids_request(prompt(12, 1), 24, stopping=stop),
            ids_request(prompt(20, 2), 24, stopping=stop, top_logprobs=3),
            ids_request(prompt(9, 3), 24, stopping=stop,
                        sampling=cpb.SamplingParams(temperature=0.9, top_k=40, seed=11)),
            ids_request(prompt(15, 4), 24, stopping=stop,
                        sampling=cpb.SamplingParams(temperature=0.7, top_p=0.9, seed=12, presence_penalty=0.3))]


def run_all(stub, reqs):
    with cf.ThreadPoolExecutor(len(reqs)) as pool:
        return list(pool.map(lambda r: collect(stub, r), reqs))


def draft_info(executor) -> epb.DraftModelInfo:
    return executor.stub.GetInfo(epb.GetInfoRequest()).draft_model


def wait_no_draft_caches(executor, timeout: float = 15.0) -> epb.DraftModelInfo:
    deadline = time.monotonic() + timeout
    while True:
        info = draft_info(executor)
        if info.live_caches == 0:
            return info
        assert time.monotonic() < deadline, f"draft caches still held: {info}"
        time.sleep(0.02)


def test_outputs_equal_to_no_speculation_and_greedy_guesses_all_accepted(executor, off, drafting):
    info = executor.stub.GetInfo(epb.GetInfoRequest())
    assert "draft_model" in info.capabilities and info.draft_model.kv_pool.blocks == 8
    reqs = requests()
    got, want = run_all(drafting.stub, reqs), run_all(off.stub, reqs)
    for n, (g, w) in enumerate(zip(got, want)):
        assert g.token_ids == w.token_ids, f"request {n}"
        assert g.text == w.text and g.finish_reason == w.finish_reason
        for a, b in zip(g.logprobs, w.logprobs):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t.token_id for t in a.top_logprobs] == [t.token_id for t in b.top_logprobs]
        assert w.usage.drafted_tokens == 0
    greedy = got[:2]  # the model's own greedy guesses: every one accepted
    assert all(g.usage.drafted_tokens > 0 and g.usage.accepted_tokens == g.usage.drafted_tokens for g in greedy)
    m = scrape(drafting)
    total = sum(g.usage.drafted_tokens for g in got)
    assert m['tandem:spec_decode_draft_tokens_by_method_total{method="draft_model"}'] == total
    assert m['tandem:spec_decode_accepted_tokens_by_method_total{method="draft_model"}'] == sum(
        g.usage.accepted_tokens for g in got)
    after = wait_no_draft_caches(executor)  # finished requests freed theirs
    assert after.draft_tokens >= total and after.caches_freed >= len(reqs)
    wait_kv_free(executor.stub)


def test_sequence_too_long_for_the_draft_pool_gets_no_drafts(executor, off, drafting):
    before = draft_info(executor).items_without_drafts
    req = ids_request(prompt(140, 6), 12, stopping=pb.StoppingCriteria(max_new_tokens=12, ignore_eos=True))
    got = collect(drafting.stub, req)  # 140 tokens: more than the draft pool's 128 slots
    assert len(got.token_ids) == 12 and got.usage.drafted_tokens == 0
    assert draft_info(executor).items_without_drafts > before
    assert collect(off.stub, req).token_ids == got.token_ids
    wait_no_draft_caches(executor)
    wait_kv_free(executor.stub)


def test_cancelled_request_frees_its_draft_cache(executor, drafting):
    call = drafting.stub.Generate(ids_request(prompt(10, 20), 200, stopping=pb.StoppingCriteria(
        max_new_tokens=200, ignore_eos=True)))
    for _ in range(4):
        next(call)  # running, and drafting
    assert draft_info(executor).live_caches >= 1
    freed = draft_info(executor).caches_freed
    cancel_stream(call)
    after = wait_no_draft_caches(executor)
    assert after.caches_freed > freed
    wait_kv_free(executor.stub)
