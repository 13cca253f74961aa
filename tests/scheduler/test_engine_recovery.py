"""The async engine over fault-injecting clients at the ExecutorClient seam (tests/faulty_executor_client.py
around the in-process executor, a tiny random Llama): recovery by recompute after the executor's loss, its
restart or the loss of our session; the retry window; per-item failures; errors that are not KV exhaustion;
slow control calls; sessions (open, renew, close) and executors without them."""
from __future__ import annotations

import dataclasses

import asyncio

import pytest

from executor_service.in_process_client import InProcessExecutorClient
from scheduler.executor.client import ExecutorUnreachable
from scheduler.request import FinishReason, GenerateRequest, StoppingCriteria
from scheduler.text.tokenizer import ModelTokenizer
from tandem.errors import RemoteError
from tandem.sampling_params import SamplingParams
from tests.executor_driver import make_executor
from tests.faulty_executor_client import Fault, FaultyExecutorClient
from tests.scheduler.engine_harness import Running, collect, tokens, until

NEW = 10
PROMPTS = {"a": [5, 17, 33, 8, 91, 120, 7, 64, 3, 250, 11, 42], "b": [1, 300, 22, 9, 41],
           "c": [7, 7, 100, 200, 31, 4, 90]}
SEEDED = SamplingParams(temperature=0.9, top_k=50, seed=7)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return ModelTokenizer(model_dir)


@pytest.fixture
def client(model_dir):
    return InProcessExecutorClient(make_executor(model_dir, kv_blocks=64))


def request(rid: str, sampling: SamplingParams = SamplingParams(), new: int = NEW, **stop) -> GenerateRequest:
    return GenerateRequest(rid, tuple(PROMPTS[rid[0]]), StoppingCriteria(new, ignore_eos=True, **stop), sampling)


async def clean_run(client, tokenizer, requests: list[GenerateRequest]) -> dict[str, list[int]]:
    async with Running(client, tokenizer) as engine:
        outs = [engine.submit(r)[1] for r in requests]
        return {r.request_id: tokens(await collect(o)) for r, o in zip(requests, outs)}


def scenario(coro) -> None:
    asyncio.run(coro)


# ------------------------------------------------------------------ recovery by recompute

def test_a_restarted_executor_recomputes_every_request_to_the_same_tokens(client, tokenizer):
    """Down mid-stream, then back as a new instance (every cache gone): the running requests, and one that
    arrived during the outage, end with exactly the tokens of a clean run; nothing fails, nothing repeats."""
    async def run():
        reqs = [request("a"), request("b", SEEDED)]
        want = await clean_run(client, tokenizer, reqs + [request("c")])
        faulty = FaultyExecutorClient(client, step_faults={3: Fault("unavailable")}, sessions=True,
                                      instance_id="first")
        box = Running(faulty, tokenizer)
        async with box as engine:
            first_session = engine.session.id
            outs = {r.request_id: engine.submit(r)[1] for r in reqs}
            await until(lambda: not engine.up, "the executor's loss")
            assert box.health == [False] and engine.policy.running == []
            assert len(engine.policy.waiting) == 2  # requeued, not failed
            outs["c"] = engine.submit(request("c"))[1]  # queued during the outage
            faulty.restart()
            faulty.down = False
            got = {rid: await collect(o) for rid, o in outs.items()}
            assert box.health == [False, True]
            assert engine.session.id and engine.session.id != first_session
            assert list(faulty.live_sessions) == [engine.session.id]
        for rid, events in got.items():
            assert events[-1].finish_reason is FinishReason.LENGTH, events[-1]
            assert tokens(events) == want[rid], rid  # the same tokens, each once
        assert got["a"][-1].usage.preemptions == 1  # the recompute shows in usage
    scenario(run())


def test_a_forgotten_session_is_recovered_like_a_restart(client, tokenizer):
    """The lease ran out (the executor forgot our session and its caches): the next step is NOT_FOUND; the
    scheduler opens a new session and recomputes, with the same tokens."""
    async def run():
        want = await clean_run(client, tokenizer, [request("a"), request("b", SEEDED)])
        faulty = FaultyExecutorClient(client, sessions=True, instance_id="same")
        faulty.before_step[3] = faulty.expire_sessions
        async with Running(faulty, tokenizer) as engine:
            first_session = engine.session.id
            outs = {r.request_id: engine.submit(r)[1] for r in (request("a"), request("b", SEEDED))}
            got = {rid: tokens(await collect(o)) for rid, o in outs.items()}
            assert engine.session.id not in ("", first_session)
        assert got == want
    scenario(run())


def test_a_restart_without_sessions_is_seen_by_the_instance_id(client, tokenizer):
    """An executor without sessions restarts between two steps (no transport error seen): the step is
    NOT_FOUND (unknown caches), GetInfo shows a new instance id, and the requests are recomputed."""
    async def run():
        want = await clean_run(client, tokenizer, [request("a")])
        faulty = FaultyExecutorClient(client, instance_id="first")
        faulty.before_step[3] = faulty.restart
        async with Running(faulty, tokenizer) as engine:
            assert engine.session.id == ""  # OpenSession UNIMPLEMENTED: the anonymous session
            seq, out = engine.submit(request("a"))
            assert tokens(await collect(out)) == want["a"]
            assert engine.info.instance_id == faulty.instance_id and seq.preemptions == 1
    scenario(run())


def test_a_step_answering_after_the_executor_was_declared_lost_is_not_applied(client, tokenizer):
    """A handler's GetInfo sees a new instance id while a step is in flight: the plan is requeued at once, and
    the step's late answer must not add a token (it would be a duplicate after the recompute)."""
    async def run():
        want = await clean_run(client, tokenizer, [request("a")])
        faulty = FaultyExecutorClient(client, step_faults={3: Fault("late", delay_s=0.3)}, instance_id="first")
        async with Running(faulty, tokenizer) as engine:
            _, out = engine.submit(request("a"))
            await until(lambda: faulty.steps >= 4, "the late step in flight")
            faulty.instance_id = "second"
            await engine.refresh_info()  # as GetModelInfo does
            assert not engine.up
            got = tokens(await collect(out))
            faulty.restart()  # the first instance's caches go with it
        assert got == want["a"]
    scenario(run())


def test_requests_end_unavailable_when_the_executor_does_not_return_in_time(client, tokenizer):
    async def run():
        faulty = FaultyExecutorClient(client, step_faults={2: Fault("unavailable")})
        box = Running(faulty, tokenizer, executor_retry_s=0.2)
        async with box as engine:
            _, out = engine.submit(request("a"))
            events = await collect(out)
            err = events[-1]
            assert isinstance(err, ExecutorUnreachable) and "did not serve again within 0.2 s" in str(err)
            with pytest.raises(ExecutorUnreachable, match="did not serve again"):  # new ones fail at once now
                engine.submit(request("b"))
            faulty.down = False  # it comes back later: the scheduler serves again
            await until(lambda: engine.up, "the executor's return")
            assert box.health == [False, True]
            assert len(tokens(await collect(engine.submit(request("c"))[1]))) == NEW
    scenario(run())


def test_an_executor_back_with_another_model_fails_the_queue_clearly(client, tokenizer):
    async def run():
        faulty = FaultyExecutorClient(client, step_faults={2: Fault("unavailable")})
        async with Running(faulty, tokenizer) as engine:
            _, out = engine.submit(request("a"))
            await until(lambda: not engine.up, "the executor's loss")
            was = engine.info
            engine.info = dataclasses.replace(was, vocab_size=was.vocab_size + 1)  # as if it served another model
            faulty.down = False
            err = (await collect(out))[-1]
            assert "another vocabulary size" in str(err) and "restart the scheduler" in str(err)
            with pytest.raises(ExecutorUnreachable, match="another vocabulary size"):
                engine.submit(request("b"))
            assert not engine.up
            engine.info = was  # the right one is back
            await until(lambda: engine.up, "the fitting executor")
    scenario(run())


def test_a_slow_or_failing_getinfo_never_fails_streams_or_the_loop(client, tokenizer):
    """GetInfo answering DEADLINE_EXCEEDED (an executor under load) or INTERNAL inside the loop (after a KV
    exhaustion) is retried: the stream completes, the executor is never declared lost."""
    async def run():
        want = await clean_run(client, tokenizer, [request("a")])
        faulty = FaultyExecutorClient(client, step_faults={
            2: Fault("status", "RESOURCE_EXHAUSTED", message="KV cache full: injected")},
            info_faults=["DEADLINE_EXCEEDED", "INTERNAL"])
        box = Running(faulty, tokenizer)
        async with box as engine:
            _, out = engine.submit(request("a"))
            assert tokens(await collect(out)) == want["a"]
            await engine.refresh_info()  # the second injected error
            assert engine.up and box.health == [] and not faulty.info_faults
    scenario(run())


# ------------------------------------------------------------------ per-item results and error kinds

def test_an_item_that_fails_alone_ends_only_its_request(client, tokenizer):
    async def run():
        want = await clean_run(client, tokenizer, [request("b")])
        # step 2 (decoding): item 0 (request a) is NOT_FOUND, as an adapter unloaded meanwhile would be
        faulty = FaultyExecutorClient(client, item_faults={(2, 0): "NOT_FOUND"})
        async with Running(faulty, tokenizer) as engine:
            (_, out_a), (_, out_b) = engine.submit(request("a")), engine.submit(request("b"))
            err = (await collect(out_a))[-1]
            assert isinstance(err, RemoteError) and err.status_name == "NOT_FOUND" and "injected" in str(err)
            assert tokens(await collect(out_b)) == want["b"]
            assert engine.up and engine.policy.preemptions == 0
    scenario(run())


def test_a_cancel_during_a_step_that_then_fails_leaks_nothing(client, tokenizer):
    """The client of a goes away while a step runs, and that step then fails: a's cache is released, the
    failure ends only the requests still there, and the next request is served normally."""
    async def run():
        want = await clean_run(client, tokenizer, [request("b")])
        faulty = FaultyExecutorClient(client, step_faults={2: Fault("late-status", "INTERNAL", delay_s=0.2)})
        async with Running(faulty, tokenizer) as engine:
            seq_a, _ = engine.submit(request("a"))
            await until(lambda: faulty.steps >= 3, "the failing step in flight")
            engine.abort(seq_a)  # the client cancels mid-step
            await until(lambda: client.info_now().kv.active_caches == 0, "a's cache released")
            _, out_b = engine.submit(request("b"))
            assert tokens(await collect(out_b)) == want["b"]
        kv = client.info_now().kv
        assert (kv.free_blocks, kv.active_caches) == (kv.total_blocks, 0)
    scenario(run())


def test_a_message_size_error_is_not_taken_for_kv_exhaustion(client, tokenizer):
    async def run():
        faulty = FaultyExecutorClient(client, step_faults={1: Fault(
            "status", "RESOURCE_EXHAUSTED", message="Received message larger than max (70000000 vs. 67108864)")})
        async with Running(faulty, tokenizer) as engine:
            outs = [engine.submit(request(r))[1] for r in ("a", "b")]
            for out in outs:
                err = (await collect(out))[-1]
                assert isinstance(err, RemoteError) and err.status_name == "RESOURCE_EXHAUSTED"
                assert "larger than max" in str(err)
            assert engine.policy.preemptions == 0 and faulty.steps == 2  # failed once, no preemption loop
            assert len(tokens(await collect(engine.submit(request("c"))[1]))) == NEW
    scenario(run())


# ------------------------------------------------------------------ sessions

def test_the_session_is_named_on_every_call_renewed_when_idle_and_closed_last(client, tokenizer):
    async def run():
        faulty = FaultyExecutorClient(client, sessions=True, session_ttl_ms=60, instance_id="x")
        async with Running(faulty, tokenizer) as engine:
            assert list(faulty.live_sessions.values()) == ["tandem-scheduler test"]
            sid = engine.session.id
            await collect(engine.submit(request("a"))[1])
            await until(lambda: "KeepAlive" in faulty.calls, "a KeepAlive while idle")  # every 20 ms
            assert all(s.session_id == sid for s in faulty.sent)
        assert faulty.live_sessions == {}
        assert faulty.calls[-1] == "CloseSession" and "ReleaseCache" in faulty.calls
    scenario(run())


# ------------------------------------------------------------------ sampling registered with the cache

def test_sampling_travels_once_per_cache_with_registered_sampling(client, tokenizer):
    """With the capability, a final item carries sampling only when its cache has none yet or it changes
    (min_new_tokens lifts the EOS ban); prompt chunks never do. The tokens are those of a run that sends it
    on every item."""
    big_bias = SamplingParams(temperature=0.8, seed=3, logit_bias={i: 0.5 for i in range(40, 240)})
    reqs = [request("a", big_bias, min_new_tokens=4), request("b", SEEDED)]

    async def run():
        sent_always = FaultyExecutorClient(client)
        async with Running(sent_always, tokenizer, prefill_chunk=5) as engine:
            want = {r.request_id: tokens(await collect(engine.submit(r)[1])) for r in reqs}
        assert all(i.HasField("sampling") == i.is_final_chunk for s in sent_always.sent for i in s.items)

        registered = FaultyExecutorClient(client, registered_sampling=True)
        async with Running(registered, tokenizer, prefill_chunk=5) as engine:
            got = {r.request_id: tokens(await collect(engine.submit(r)[1])) for r in reqs}
        assert got == want
        carried = [(i.pos_offset, i.is_final_chunk) for s in registered.sent for i in s.items
                   if i.HasField("sampling")]
        a_len, b_len = len(PROMPTS["a"]), len(PROMPTS["b"])
        # a: its first final chunk (banned EOS), then the switch after min_new_tokens; b: its first final chunk
        assert sorted(carried) == sorted([(10, True), (a_len + 3, True), (0, True)])
        assert b_len == 5  # (b's prompt is one chunk: its first item is final)
    scenario(run())


# ------------------------------------------------------------------ shutdown

def test_drain_does_not_wait_without_bound_for_a_step_in_progress(client, tokenizer):
    async def run():
        faulty = FaultyExecutorClient(client, step_faults={1: Fault("late", delay_s=3600)})
        box = Running(faulty, tokenizer)
        engine = box.engine
        await engine.start()
        task = asyncio.create_task(engine.run())
        _, out = engine.submit(request("a"))
        await until(lambda: faulty.steps >= 2, "the hanging step")
        await asyncio.wait_for(engine.drain(0.05), 30)  # returns after the grace (at least a second)
        assert (await collect(out))[-1].finish_reason is FinishReason.ABORTED
        task.cancel()
    scenario(run())
