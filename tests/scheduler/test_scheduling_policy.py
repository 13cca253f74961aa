"""The scheduling policy driven step by step with no event loop and no network, against the in-process
executor (a tiny random Llama), with faults injected at the ExecutorClient seam. (The async engine over the
same seam: test_engine_recovery.py.)"""
from __future__ import annotations

import dataclasses

import pytest

from executor_service.in_process_client import InProcessExecutorClient
from scheduler.engine import executor_codec as codec
from scheduler.config import SchedulerConfig
from scheduler.executor.client import ExecutorUnreachable, is_kv_exhaustion
from scheduler.engine.policy import Failure, SchedulingPolicy
from scheduler.request import GenerateRequest, StoppingCriteria
from scheduler.sequence import Sequence, Status
from tandem.codec import kv_usage_from_pb
from tandem.errors import Overloaded, CapacityExceeded, RemoteError
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


class Clock:
    """A hand-driven clock for the policy: clock.now += seconds."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def new_policy(client, clock: Clock | None = None, **cfg) -> tuple[SchedulingPolicy, object]:
    info = client.info_now()
    return SchedulingPolicy(SchedulerConfig("in-process", **cfg), kv_usage_from_pb(info.kv),
                            info.max_batch_tokens, clock=clock or Clock()), info


def submit(policy: SchedulingPolicy, info, req: GenerateRequest) -> Sequence:
    policy.check_admissible(len(req.prompt_ids), req.stopping.max_new_tokens)
    seq = Sequence(req, policy.next_arrival(), info.eos_token_ids, info.max_seq_len,
                   codec.executor_sampling(req, info.eos_token_ids))
    policy.add(seq)
    return seq


def step(policy: SchedulingPolicy, client):
    """One step as scheduler/engine/engine.py takes it, synchronously: plan, release what the plan freed, run, apply."""
    plan = policy.schedule()
    ids = policy.releases.take()
    if ids:
        client.release_now(ids)
    shapes = [(i.start, i.count, i.is_final) for i in plan.items]  # is_final reads the sequence: before update
    resp = client.unified_decode_now(codec.step_to_pb(plan))
    return shapes, policy.update(plan, codec.item_results_from_pb(resp), kv_usage_from_pb(resp.kv)).emitted


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
    (cache_id,) = policy.releases.take()
    assert client.release_now([cache_id]).released == 1
    kv = client.info_now().kv
    assert (kv.free_blocks, kv.active_caches) == (total, 0)


def test_executor_loss_requeues_for_recompute_with_the_same_tokens(client, reference):
    faulty = FaultyExecutorClient(client, step_faults={3: Fault("unavailable")})
    policy, info = new_policy(client, max_batch_tokens=64, prefill_chunk=64)
    a, b = submit(policy, info, request("a")), submit(policy, info, request("b"))
    for _ in range(3):  # prefill both, then two decode steps
        step(policy, faulty)
    held = {a.cache_id, b.cache_id}
    assert len(held) == 2 and client.info_now().kv.active_caches == 2
    before = (list(a.output_ids), list(b.output_ids))

    plan = policy.schedule()
    with pytest.raises(ExecutorUnreachable):
        faulty.unified_decode_now(codec.step_to_pb(plan))
    assert policy.executor_lost() == 2  # what the loop does on no answer: nothing ends

    assert not policy.running and policy.waiting == [a, b] and not any(s.finished for s in (a, b))
    assert (a.cache_id, a.num_cached, b.cache_id, b.num_cached) == ("", 0, "", 0)
    assert (a.output_ids, b.output_ids) == before and a.preemptions == b.preemptions == 1  # outputs kept
    # the old executor's, if it returns
    assert not policy.releases.has_pending and set(policy.releases.take_stale()) == held
    client.release_now(list(held))
    assert client.info_now().kv.free_blocks == policy.kv.total_blocks

    # the executor is back: both are recomputed (prompt + outputs so far) and end with the clean run's tokens
    emitted = []
    while policy.has_work:
        emitted += step(policy, client)[1]
    assert a.output_ids == reference and b.output_ids == reference
    assert len(emitted) == 2 * (NEW - len(before[0]))  # only the tokens not streamed before: no duplicate


def test_resource_exhausted_preempts_the_youngest_and_replans(client, reference):
    faulty = FaultyExecutorClient(client, step_faults={2: Fault("status", "RESOURCE_EXHAUSTED",
                                                                        message="KV cache full: injected")})
    policy, info = new_policy(client, max_batch_tokens=64, prefill_chunk=64)
    a, b = submit(policy, info, request("a")), submit(policy, info, request("b"))
    step(policy, faulty)
    step(policy, faulty)
    plan = policy.schedule()
    with pytest.raises(RemoteError) as err:
        faulty.unified_decode_now(codec.step_to_pb(plan))
    assert policy.step_failed(plan, err.value, is_kv_exhaustion(err.value)) == []
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
    error = RemoteError("INVALID_ARGUMENT", "bad")
    failed = policy.step_failed(plan, error, kv_full=False)
    assert failed == [Failure(a, error)] and a.finished and not policy.has_work
    assert policy.releases.take() == [held]  # nothing of the step was written; the cache goes


def test_an_item_that_failed_alone_ends_its_request_and_frees_its_cache(client, reference):
    faulty = FaultyExecutorClient(client, item_faults={(2, 0): "NOT_FOUND"})
    policy, info = new_policy(client)
    a, b = submit(policy, info, request("a")), submit(policy, info, request("b"))
    step(policy, faulty)
    step(policy, faulty)
    held = a.cache_id
    plan = policy.schedule()
    resp = faulty.unified_decode_now(codec.step_to_pb(plan))
    outcome = policy.update(plan, codec.item_results_from_pb(resp), kv_usage_from_pb(resp.kv))
    (failure,) = outcome.failed
    assert failure.seq is a and failure.error.status_name == "NOT_FOUND" and a.finished
    assert [e.seq for e in outcome.emitted] == [b] and policy.running == [b]
    assert policy.releases.take() == [held]  # its cache is as it was: released
    client.release_now([held])
    while policy.has_work:
        step(policy, client)
    assert b.output_ids == reference


# ------------------------------------------------------------------ time in the queue (a hand-driven clock)

def test_a_request_not_admitted_in_time_ends_resource_exhausted_saying_why(client):
    clock = Clock()
    policy, info = new_policy(client, clock, max_queue_time_s=60)
    total = policy.kv.total_blocks
    policy.kv = dataclasses.replace(policy.kv, free_blocks=1)  # another client of the executor holds the rest
    a, b = submit(policy, info, request("a")), submit(policy, info, request("b"))
    plan = policy.schedule()
    assert plan.items == [] and "elsewhere" in policy.wait_reason and f"{total - 1} elsewhere" in policy.wait_reason
    clock.now += 59.9
    assert policy.expire_waiting() == []
    clock.now += 0.1
    expired = policy.expire_waiting()
    assert [f.seq for f in expired] == [a, b] and all(isinstance(f.error, CapacityExceeded) for f in expired)
    assert str(expired[0].error).startswith("not admitted within 60 s (--max-queue-time-s): it needs 1 KV blocks but only 0 can be "
                                            f"given to it: of the executor's {total} blocks 1 are free")
    assert str(expired[1].error).startswith("not admitted within 60 s (--max-queue-time-s): 1 requests ahead of it in the queue; the "
                                            "first of them waits because it needs 1 KV blocks")
    assert a.finished and b.finished and not policy.has_work and not policy.releases.has_pending


def test_queue_time_ends_only_requests_never_admitted_and_restarts_after_the_executor_returns(client):
    """A request admitted once (then requeued: the executor lost, or preempted) may have streamed tokens: the
    queue-time bound never ends it. One never admitted waits the bound, not counting the executor's outage."""
    clock = Clock()
    policy, info = new_policy(client, clock, max_queue_time_s=10)
    a = submit(policy, info, request("a"))
    step(policy, client)  # admitted
    clock.now += 30
    policy.executor_lost()  # requeued
    b = submit(policy, info, request("b"))
    assert policy.waiting == [a, b] and policy.expire_waiting() == []
    clock.now += 9
    policy.restart_queue_clocks()  # the executor is back: the outage does not count
    clock.now += 9
    assert policy.expire_waiting() == []
    clock.now += 100
    expired = policy.expire_waiting()
    assert [f.seq for f in expired] == [b] and policy.waiting == [a]  # a, admitted before, is never ended so
    assert isinstance(expired[0].error, Overloaded) and expired[0].error.reason == "queue_time"
    client.release_now(policy.releases.take_stale())


def test_requests_whose_adapter_is_gone_after_a_restart_end_not_found(client):
    policy, info = new_policy(client)
    base = submit(policy, info, request("base"))
    gone = Sequence(dataclasses.replace(request("gone"), adapter="alpha"), policy.next_arrival(), (), 1000)
    policy.add(gone)
    (failure,) = policy.drop_missing_adapters({"beta"})
    assert failure.seq is gone and failure.error.__class__.__name__ == "AdapterNotFound"
    assert "'alpha' is no longer loaded" in str(failure.error) and policy.waiting == [base]
