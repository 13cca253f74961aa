"""One scheduler, several executors (real processes, tiny llama): 32 concurrent requests give transformers'
greedy tokens and every executor gets work; the same long system prompt is computed on one executor and
reused from the second request on; an adapter request lands only where the adapter is; an executor of
another model is refused while the others serve; an executor SIGKILLed mid-run loses no stream (each
finishes with exactly the tokens of a clean run, no error), and once restarted it gets new requests."""
from __future__ import annotations

import concurrent.futures as cf
import socket
import time

import pytest

from tandem.executor.v1 import executor_pb2 as epb
from tandem.generate.v1 import generate_pb2 as pb
from tests.grpc_harness import start_executor, start_for, start_scheduler_for
from tests.hf_reference import HfReference
from tests.lora_fixtures import make_peft_adapter
from tests.scheduler_client import collect, ids_request, wait_kv_free

BLOCK = 16
SYSTEM = [1] + [5 + (i * 29) % 383 for i in range(159)]  # 160 tokens: 10 blocks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sampled(executor) -> int:
    return executor.stub.GetMetrics(epb.GetMetricsRequest()).tokens_sampled


class Fleet:
    """Executor A (fixed port: it is killed and restarted), executor B (holds adapter "alpha"), a scheduler
    driving both."""

    def __init__(self, request, model, adapters) -> None:
        self.model, self.port = model, _free_port()
        self.a = start_executor(model, "--port", str(self.port), "--kv-blocks", "96")
        request.addfinalizer(lambda: self.a.close())
        self.b = start_for(request, model, "--kv-blocks", "96", "--adapter-root", str(adapters),
                           "--adapter", f"alpha={adapters / 'alpha'}")
        self.scheduler = start_scheduler_for(request, self.a.address, "--executor", self.b.address)

    def states(self) -> list[int]:
        return [e.state for e in self.scheduler.stub.GetModelInfo(pb.GetModelInfoRequest()).executors]


@pytest.fixture(scope="module")
def fleet(request, model_dir, tmp_path_factory) -> Fleet:
    adapters = tmp_path_factory.mktemp("fleet-adapters")
    make_peft_adapter(model_dir, adapters / "alpha", r=8, alpha=16, seed=3)
    return Fleet(request, model_dir, adapters)


def test_requests_spread_over_the_executors_and_give_transformers_greedy_tokens(fleet, model_dir):
    info = fleet.scheduler.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert [e.address for e in info.executors] == [fleet.a.address, fleet.b.address]
    assert all(e.state == pb.ExecutorStatus.STATE_SERVING for e in info.executors)
    assert info.executor == f"{fleet.a.address},{fleet.b.address}"
    before = (_sampled(fleet.a), _sampled(fleet.b))
    prompts = [[1, 40 + n, 7 * n % 300 + 3, 9, 200 + n] for n in range(32)]
    with cf.ThreadPoolExecutor(32) as pool:
        got = list(pool.map(lambda p: collect(fleet.scheduler.stub, ids_request(p, 6)), prompts))
    ref = HfReference(model_dir)
    assert [g.token_ids for g in got] == [ref.greedy(p, 6)[0] for p in prompts]
    after = (_sampled(fleet.a), _sampled(fleet.b))
    assert after[0] > before[0] and after[1] > before[1], "every executor should have received work"


def test_a_shared_system_prompt_is_computed_on_one_executor_and_reused(fleet):
    hits = []
    for n in range(20):
        got = collect(fleet.scheduler.stub, ids_request(SYSTEM + [300 + n, 11, 12], 3))
        hits.append(got.usage.cached_tokens)
    assert hits[0] == 0 and all(h >= 0.9 * len(SYSTEM) for h in hits[1:]), hits
    stored = [e.stub.GetMetrics(epb.GetMetricsRequest()).prefix_cache.hit_tokens for e in (fleet.a, fleet.b)]
    assert min(stored) < len(SYSTEM) <= max(stored)  # the reuse happened on one of them


def test_a_prefix_another_client_cached_is_found_through_the_executors_kv_events(request, fleet):
    system = [1] + [9 + (i * 31) % 377 for i in range(95)]  # 96 tokens: 6 blocks
    only_b = start_scheduler_for(request, fleet.b.address)  # another client caches it on B
    collect(only_b.stub, ids_request(system + [5, 6], 2))
    before = _sampled(fleet.a)
    deadline = time.monotonic() + 10  # (the BlocksStored events reach the fleet's scheduler asynchronously)
    while True:
        got = collect(fleet.scheduler.stub, ids_request(system + [7, 8], 2))
        if got.usage.cached_tokens or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert got.usage.cached_tokens == len(system) and _sampled(fleet.a) == before  # routed to B, which had it


def test_an_adapter_request_lands_only_where_the_adapter_is(fleet):
    before = _sampled(fleet.a)
    with cf.ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda n: collect(fleet.scheduler.stub, ids_request([1, 60 + n, 61], 5, adapter="alpha")),
                            range(6)))
    assert all(len(g.token_ids) == 5 for g in got)
    assert _sampled(fleet.a) == before  # A lacks "alpha": nothing ran there
    assert list(fleet.scheduler.stub.GetModelInfo(pb.GetModelInfoRequest()).adapters) == ["alpha"]


def test_an_executor_of_another_model_is_refused_while_the_others_serve(request, fleet, tiny_checkpoint):
    other = start_for(request, tiny_checkpoint("qwen2"), "--kv-blocks", "32")
    scheduler = start_scheduler_for(request, fleet.a.address, "--executor", other.address)
    warm = _sampled(other)  # (its own warm-up forward)
    info = scheduler.stub.GetModelInfo(pb.GetModelInfoRequest())
    refused = info.executors[1]
    assert info.executors[0].state == pb.ExecutorStatus.STATE_SERVING
    assert refused.state == pb.ExecutorStatus.STATE_REFUSED and "another model" in refused.reason
    got = [collect(scheduler.stub, ids_request([1, 70 + n, 71], 4)) for n in range(4)]
    assert all(len(g.token_ids) == 4 for g in got)
    assert _sampled(other) == warm


def test_an_executor_sigkilled_mid_run_loses_no_stream_and_rejoins_once_restarted(fleet):
    stop = pb.StoppingCriteria(max_new_tokens=100, ignore_eos=True)
    reqs = [ids_request([1, 90 + n, 17, 5 * n + 2], 0, stopping=stop) for n in range(8)]
    with cf.ThreadPoolExecutor(8) as pool:
        clean = list(pool.map(lambda r: collect(fleet.scheduler.stub, r), reqs))
    calls = [fleet.scheduler.stub.Generate(r, timeout=120) for r in reqs]
    firsts = [next(c) for c in calls]  # every stream is running, on both executors
    fleet.a.process.kill()  # SIGKILL mid-run: its caches are gone with it
    moved = 0
    for want, first, call in zip(clean, firsts, calls):
        rest = list(call)  # no error: a pause at most
        ids = list(first.token_ids) + [t for m in rest for t in m.token_ids]
        assert ids == want.token_ids  # exactly the clean run's tokens: none lost, none repeated
        moved += rest[-1].usage.preemptions  # recomputed elsewhere (the ones that were on A)
    assert moved > 0, "no stream was running on the killed executor"
    assert pb.ExecutorStatus.STATE_UNREACHABLE in fleet.states()
    fleet.a = start_executor(fleet.model, "--port", str(fleet.port), "--kv-blocks", "96")
    deadline = time.monotonic() + 30
    while fleet.states()[0] != pb.ExecutorStatus.STATE_SERVING:
        assert time.monotonic() < deadline, "the restarted executor did not rejoin"
        time.sleep(0.2)
    with cf.ThreadPoolExecutor(8) as pool:
        again = list(pool.map(lambda n: collect(fleet.scheduler.stub, ids_request([1, 120 + n, 3], 6)), range(8)))
    assert all(len(g.token_ids) == 6 for g in again)
    assert _sampled(fleet.a) > 0, "the restarted executor should get new requests"
    wait_kv_free(fleet.a.stub)
    wait_kv_free(fleet.b.stub)


def test_an_executor_not_up_at_startup_joins_once_it_serves(request, fleet):
    port = _free_port()
    scheduler = start_scheduler_for(request, fleet.b.address, "--executor", f"127.0.0.1:{port}")
    info = scheduler.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert [e.state for e in info.executors] == [pb.ExecutorStatus.STATE_SERVING, pb.ExecutorStatus.STATE_UNREACHABLE]
    assert info.executors[1].reason  # why: not serving yet
    assert len(collect(scheduler.stub, ids_request([1, 5, 6], 3)).token_ids) == 3  # B serves meanwhile
    late = start_for(request, fleet.model, "--port", str(port), "--kv-blocks", "64")
    deadline = time.monotonic() + 30
    while scheduler.stub.GetModelInfo(pb.GetModelInfoRequest()).executors[1].state != pb.ExecutorStatus.STATE_SERVING:
        assert time.monotonic() < deadline, "the late executor did not join"
        time.sleep(0.2)
    warm = _sampled(late)
    with cf.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda n: collect(scheduler.stub, ids_request([1, 140 + n, 3], 4)), range(8)))
    assert all(len(g.token_ids) == 4 for g in got) and _sampled(late) > warm
