"""Recovery with real processes: the executor SIGKILLed mid-stream (mid-burst: multi-step decode is on) and
restarted on the same address — the streams pause and finish with exactly the tokens of a clean run (greedy
and seeded sampling), none repeated; no silent waits: a request whose KV is held by another client of the executor ends RESOURCE_EXHAUSTED
within --max-queue-time, saying why; and a scheduling loop that dies of a bug still shuts down in order."""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import socket

import grpc
import pytest

from scheduler.config import SchedulerConfig
from scheduler.engine.engine import Engine
from scheduler.server import serve_async
from tandem.common.v1 import common_pb2 as cpb
from tandem.executor.v1 import executor_pb2 as epb
from tandem.generate.v1 import generate_pb2 as pb
from tests.grpc_harness import start_executor, start_for, start_scheduler, start_scheduler_for
from tests.scheduler_client import collect, ids_request, rpc_error, wait_kv_free


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _requests() -> list[pb.GenerateRequest]:
    long = 200  # many bursts after the first token (>= 13 calls of <= 16 steps): the kill lands mid-stream
    return [ids_request([1, 7, 8, 9], long, stopping=pb.StoppingCriteria(max_new_tokens=long, ignore_eos=True)),
            ids_request([1, 300, 22, 9, 41], long, stopping=pb.StoppingCriteria(max_new_tokens=long, ignore_eos=True),
                        sampling=cpb.SamplingParams(temperature=0.9, top_k=40, seed=11)),
            ids_request([1, 50, 60], long - 40, stopping=pb.StoppingCriteria(max_new_tokens=long - 40,
                                                                              ignore_eos=True),
                        sampling=cpb.SamplingParams(temperature=0.7, seed=5), top_logprobs=2)]


def test_executor_sigkilled_mid_stream_and_restarted_streams_finish_with_the_same_tokens(tiny_checkpoint):
    model = tiny_checkpoint("llama")
    port = _free_port()
    executor = start_executor(model, "--port", str(port), "--kv-blocks", "64")
    scheduler = start_scheduler(executor.address)
    try:
        with cf.ThreadPoolExecutor(3) as pool:  # the clean run (batched together too: the same tokens)
            clean = list(pool.map(lambda r: collect(scheduler.stub, r), _requests()))
        # the streams decode in multi-step bursts (the default): the kill below lands inside one
        assert any(len(m.token_ids) > 1 for c in clean for m in c.messages)
        calls = [scheduler.stub.Generate(r, timeout=120) for r in _requests()]
        firsts = [next(c) for c in calls]  # every stream is running
        executor.process.kill()  # SIGKILL: its caches are gone with it
        executor = start_executor(model, "--port", str(port), "--kv-blocks", "64")
        for want, first, call in zip(clean, firsts, calls):
            rest = list(call)  # no error: a pause, then the rest
            got = [first] + rest
            ids = [t for m in got for t in m.token_ids]
            assert ids == want.token_ids  # exactly the clean run's tokens: none lost, none repeated
            assert "".join(m.text for m in got) == want.text
            # (logprobs to float rounding: a recomputed position comes out of a prefill, not a decode)
            assert [lp.logprob for m in got for lp in m.logprobs] == pytest.approx(
                [lp.logprob for lp in want.logprobs], abs=1e-4)
            assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert rest[-1].usage.preemptions >= 1  # it was recomputed on the new executor
        wait_kv_free(executor.stub)
    finally:
        scheduler.close()
        executor.close()


def test_a_request_whose_kv_is_held_elsewhere_ends_resource_exhausted_in_time(request, tiny_checkpoint):
    executor = start_for(request, tiny_checkpoint("llama"), "--kv-blocks", "8")  # 8 blocks x 16 tokens
    scheduler = start_scheduler_for(request, executor.address, "--max-queue-time", "1")
    held = executor.stub.Prefill(epb.PrefillRequest(token_ids=[1] * 100)).cache.cache_id  # 7 blocks
    wants_3_blocks = ids_request([1, 5, 6, 7] * 5, 20, stopping=pb.StoppingCriteria(max_new_tokens=20))
    err = rpc_error(lambda: list(scheduler.stub.Generate(wants_3_blocks, timeout=60)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
    assert "not admitted within 1 s" in err.details() and "7 elsewhere" in err.details(), err.details()

    executor.stub.ReleaseCache(epb.ReleaseCacheRequest(cache_ids=[held]))  # the other client is done
    assert collect(scheduler.stub, wants_3_blocks).usage.completion_tokens == 20
    wait_kv_free(executor.stub)


def test_a_scheduling_loop_that_fails_drains_and_exits_non_zero(request, model_dir, monkeypatch):
    executor = start_for(request, model_dir, "--kv-blocks", "16")

    async def broken_run(self) -> None:
        raise RuntimeError("a bug in the loop")

    monkeypatch.setattr(Engine, "run", broken_run)
    assert asyncio.run(serve_async(SchedulerConfig(executor.address, port=0, grace_s=5))) == 1
    wait_kv_free(executor.stub)
