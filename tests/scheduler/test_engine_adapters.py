"""The engine with LoRA adapters under the executor's limits: never more distinct adapters in a step than
max_adapters_on_device (the others wait, in arrival order), and after a restart the limits it comes back with
(token budget, adapters loaded) are adopted, failing only the requests whose adapter is gone."""
from __future__ import annotations

import asyncio

import pytest

from executor_service.in_process_client import InProcessExecutorClient
from scheduler.request import GenerateRequest, StoppingCriteria
from scheduler.text.tokenizer import ModelTokenizer
from tandem.errors import AdapterNotFound
from tests.executor_driver import greedy_run, make_executor
from tests.faulty_executor_client import Fault, FaultyExecutorClient
from tests.lora_fixtures import make_peft_adapter
from tests.scheduler.engine_harness import Running, collect, tokens, until

NEW = 8
PROMPT = (1, 5, 9, 33, 44, 100, 7, 250, 17, 3, 99, 8, 8, 120, 64, 31, 200, 11, 40, 41)  # 20 tokens


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> tuple[tuple[str, object], ...]:
    root = tmp_path_factory.mktemp("adapters")
    return (("alpha", make_peft_adapter(model_dir, root / "alpha", r=4, alpha=8, seed=1)),
            ("beta", make_peft_adapter(model_dir, root / "beta", r=4, alpha=8, seed=2)))


@pytest.fixture(scope="module")
def references(model_dir, adapters) -> dict[str, list[int]]:
    ex = make_executor(model_dir, kv_blocks=64, adapters=adapters)
    return {name: greedy_run(ex, list(PROMPT), NEW, adapter=name)[1] for name in ("", "alpha", "beta")}


@pytest.fixture
def client(model_dir, adapters):
    # one adapter's weights on the device at a time: this executor rejects a call that names two
    return InProcessExecutorClient(make_executor(model_dir, kv_blocks=64, adapters=adapters,
                                                 max_adapters_on_device=1))


def request(rid: str, adapter: str) -> GenerateRequest:
    return GenerateRequest(rid, PROMPT, StoppingCriteria(NEW, ignore_eos=True), adapter=adapter)


def test_steps_never_use_more_adapters_than_the_executor_has_slots(client, model_dir, references):
    async def run():
        faulty = FaultyExecutorClient(client, max_adapters_on_device=1)
        jobs = [("a", "alpha"), ("b", "beta"), ("c", "alpha"), ("d", ""), ("e", "beta")]
        async with Running(faulty, ModelTokenizer(model_dir)) as engine:
            outs = {rid: engine.submit(request(rid, name))[1] for rid, name in jobs}
            got = {rid: tokens(await collect(out)) for rid, out in outs.items()}
        for rid, name in jobs:
            assert got[rid] == references[name], rid
        assert all(len({i.adapter for i in s.items if i.adapter}) <= 1 for s in faulty.sent)
        # arrival order: beta waits for alpha's slot; the base-model request d, behind it, waits too
        first_beta = next(n for n, s in enumerate(faulty.sent) if any(i.adapter == "beta" for i in s.items))
        first_d = next(n for n, s in enumerate(faulty.sent) if any(i.adapter == "" for i in s.items))
        assert first_d >= first_beta
    asyncio.run(run())


def test_an_executor_back_with_other_limits_and_without_an_adapter(client, model_dir, references):
    async def run():
        faulty = FaultyExecutorClient(client, step_faults={2: Fault("unavailable")}, instance_id="first")
        async with Running(faulty, ModelTokenizer(model_dir)) as engine:
            outs = {rid: engine.submit(request(rid, name))[1] for rid, name in (("a", ""), ("b", "alpha"))}
            await until(lambda: not engine.up, "the executor's loss")
            faulty.restart()
            faulty.hidden_adapters, faulty.max_batch_tokens = {"alpha"}, 8  # back without alpha, 8 tokens a call
            faulty.max_adapters_on_device = 1
            faulty.down = False
            a, b = tokens(await collect(outs["a"])), (await collect(outs["b"]))[-1]
            assert (engine.planner.max_batch_tokens, engine.planner.max_adapters) == (8, 1)
        assert a == references[""]  # recomputed in chunks of at most 8 tokens
        assert isinstance(b, AdapterNotFound) and "'alpha' is no longer loaded" in str(b)
        after = faulty.sent[2:]
        assert after and all(sum(len(i.token_ids) for i in s.items) <= 8 for s in after)
    asyncio.run(run())
