"""The scheduling policy driven step by step with no event loop and no network, against the in-process
executor (a tiny random Llama), and the engine over fault-injecting clients at the ExecutorClient seam."""
from __future__ import annotations

import asyncio

import pytest

from executor_service.in_process_client import InProcessExecutorClient
from scheduler import codec
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.executor_client import ExecutorUnreachable
from scheduler.policy import SchedulingPolicy
from scheduler.request import Delta, FinishReason, GenerateRequest, StoppingCriteria
from scheduler.sequence import Sequence, Status
from scheduler.tokenizer import ModelTokenizer
from tandem.codec import kv_usage_from_pb
from tandem.errors import RemoteError, TandemError
from tests.executor_driver import greedy_run, make_executor
from tests.faulty_executor_client import Fault, FaultyExecutorClient

PROMPT = [5, 17, 33, 8, 91, 120, 7, 64, 3, 250, 11, 42]  # 12 tokens
NEW = 6


@pytest.fixture
def client(model_dir):
    return InProcessExecutorClient(make_executor(model_dir, kv_blocks=64))


@pytest.fixture(scope="module")
def reference(model_dir) -> list[int]:
    """The greedy continuation of PROMPT, by the executor driven directly (itself checked against transformers)."""
    _, tokens, _ = greedy_run(make_executor(model_dir, kv_blocks=64), PROMPT, NEW)
    return tokens


def request(rid: str = "r", prompt=PROMPT, new: int = NEW) -> GenerateRequest:
    return GenerateRequest(rid, tuple(prompt), StoppingCriteria(new, ignore_eos=True))


def new_policy(client, **cfg) -> tuple[SchedulingPolicy, object]:
    info = client.info_now()
    return SchedulingPolicy(SchedulerConfig("in-process", **cfg), kv_usage_from_pb(info.kv),
                            info.max_batch_tokens), info


def submit(policy: SchedulingPolicy, info, req: GenerateRequest) -> Sequence:
    policy.check_admissible(len(req.prompt_ids), req.stopping.max_new_tokens)
    seq = Sequence(req, policy.next_arrival(), info.eos_token_ids, info.max_seq_len,
                   codec.executor_sampling(req, info.eos_token_ids))
    policy.add(seq)
    return seq


def step(policy: SchedulingPolicy, client):
    """One step as scheduler/engine.py takes it, synchronously: plan, release what the plan freed, run, apply."""
    plan = policy.schedule()
    ids = policy.take_releases()
    if ids:
        client.release_now(ids)
    shapes = [(i.start, i.count, i.is_final) for i in plan.items]  # is_final reads the sequence: before update
    resp = client.unified_decode_now(codec.step_to_pb(plan))
    return shapes, policy.update(plan, codec.item_results_from_pb(resp), kv_usage_from_pb(resp.kv))


def test_one_request_admission_chunked_prefill_decode_finish(client, reference):
    policy, info = new_policy(client, max_batch_tokens=16, prefill_chunk=5, max_running=4)
    total = policy.kv.total_blocks
    seq = submit(policy, info, request())
    assert policy.waiting == [seq] and seq.status is Status.WAITING

    shapes, tokens = [], []
    while policy.has_work:
        planned, emitted = step(policy, client)
        shapes.append(planned)
        tokens += [e.token.token_id for e in emitted]
        if len(shapes) == 1:  # admitted on the first step
            assert policy.running == [seq] and seq.status is Status.RUNNING and seq.cache_id
    # three prompt chunks of at most 5 tokens, the last one sampling; then one decode token per step
    assert shapes[:3] == [[(0, 5, False)], [(5, 5, False)], [(10, 2, True)]]
    assert shapes[3:] == [[(12 + k, 1, True)] for k in range(NEW - 1)]
    assert tokens == reference and seq.output_ids == reference
    assert seq.finished and not policy.running and not policy.waiting

    # the finished sequence's cache is the loop's to release; then the pool is whole again
    (cache_id,) = policy.take_releases()
    assert client.release_now([cache_id]).released == 1
    kv = client.info_now().kv
    assert (kv.free_blocks, kv.active_caches) == (total, 0)


def test_unavailable_executor_leaves_the_policy_consistent(client, reference):
    faulty = FaultyExecutorClient(client, step_faults={3: Fault("unavailable")})
    policy, info = new_policy(client, max_batch_tokens=64, prefill_chunk=64)
    a, b = submit(policy, info, request("a")), submit(policy, info, request("b"))
    for _ in range(3):  # prefill both, then two decode steps
        step(policy, faulty)
    held = {a.cache_id, b.cache_id}
    assert len(held) == 2 and client.info_now().kv.active_caches == 2

    plan = policy.schedule()
    with pytest.raises(ExecutorUnreachable):
        faulty.unified_decode_now(codec.step_to_pb(plan))
    lost = policy.executor_lost()  # what the loop does on no answer

    assert set(lost) == {a, b} and all(s.finished for s in lost)
    assert not policy.running and not policy.waiting and not policy.has_work
    assert set(policy.take_releases()) == held  # still held by the executor: released once it is back
    assert (a.cache_id, b.cache_id) == ("", "")
    client.release_now(list(held))
    assert client.info_now().kv.free_blocks == policy.kv.total_blocks

    # the policy serves again: a new request runs to the same tokens
    c = submit(policy, info, request("c"))
    while policy.has_work:
        step(policy, client)
    assert c.output_ids == reference


def test_resource_exhausted_preempts_the_youngest_and_replans(client, reference):
    faulty = FaultyExecutorClient(client, step_faults={2: Fault("status", "RESOURCE_EXHAUSTED")})
    policy, info = new_policy(client, max_batch_tokens=64, prefill_chunk=64)
    a, b = submit(policy, info, request("a")), submit(policy, info, request("b"))
    step(policy, faulty)
    step(policy, faulty)
    plan = policy.schedule()
    with pytest.raises(RemoteError) as err:
        faulty.unified_decode_now(codec.step_to_pb(plan))
    assert policy.step_failed(plan, err.value, err.value.status_name) == []
    assert policy.running == [a] and policy.waiting == [b] and b.preemptions == 1 and b.cache_id == ""
    while policy.has_work:
        step(policy, faulty)
    assert a.output_ids == reference and b.output_ids == reference  # b recomputed, same tokens


def test_a_rejected_step_fails_its_requests_with_the_status(client):
    policy, info = new_policy(client)
    a = submit(policy, info, request("a"))
    step(policy, client)
    held = a.cache_id
    plan = policy.schedule()
    failed = policy.step_failed(plan, RemoteError("INVALID_ARGUMENT", "bad"), "INVALID_ARGUMENT")
    assert failed == [a] and a.finished and not policy.has_work
    assert policy.take_releases() == [held]  # nothing of the step was written; the cache goes


# ------------------------------------------------------------------ the async loop over the same seam

@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return ModelTokenizer(model_dir)


async def _collect(output) -> list[Delta | TandemError]:
    events = []
    while True:
        event = await asyncio.wait_for(output.events.get(), 30)
        events.append(event)
        if isinstance(event, TandemError) or event.finish_reason is not None:
            return events


def _tokens(events) -> list[int]:
    return [t.token_id for e in events if isinstance(e, Delta) for t in e.tokens]


def test_engine_survives_an_executor_that_goes_away_and_comes_back(client, tokenizer, reference):
    async def scenario():
        faulty = FaultyExecutorClient(client, step_faults={2: Fault("unavailable"), 5: Fault("late", delay_s=0.05)})
        cfg = SchedulerConfig("faulty", reconnect_interval_s=0.01)
        engine = Engine(cfg, faulty, tokenizer, client.info_now())
        loop_task = asyncio.create_task(engine.run())
        try:
            _, out_a = engine.submit(request("a"))
            events = await _collect(out_a)
            assert isinstance(events[-1], ExecutorUnreachable)  # lost mid-stream: an UNAVAILABLE status
            assert not engine.up and not engine.policy.has_work
            faulty.down = False  # the executor is back
            while not engine.up:
                await asyncio.sleep(0.01)
            _, out_b = engine.submit(request("b"))
            events = await _collect(out_b)  # its step 5 answers late: a pause, the same tokens
            assert events[-1].finish_reason is FinishReason.LENGTH and _tokens(events) == reference
            for _ in range(100):  # a's cache was released after the reconnect, b's after its finish
                if client.info_now().kv.active_caches == 0:
                    break
                await asyncio.sleep(0.01)
            kv = client.info_now().kv
            assert (kv.active_caches, kv.free_blocks) == (0, kv.total_blocks)
        finally:
            await engine.drain(0)
            loop_task.cancel()

    asyncio.run(scenario())
