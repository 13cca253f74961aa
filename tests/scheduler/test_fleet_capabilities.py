"""A fleet mid-upgrade (in process: two in-process executors behind the fault-injecting client, one hiding a
capability as an older build would): a constrained request goes only to an executor that applies token masks
(one that does not would drop allowed_tokens as an unknown field and sample unconstrained), plain requests
still use both, the fleet's info lists what any serving executor can do, and with no capable executor the
request is refused (FAILED_PRECONDITION) rather than run unconstrained."""
from __future__ import annotations

import asyncio
import re

import pytest

from executor_service.in_process_client import InProcessExecutorClient
from scheduler.config import SchedulerConfig
from scheduler.fleet.fleet import Fleet
from scheduler.structured.grammar import ConstraintKind, ConstraintSpec
from scheduler.request import FinishReason, GenerateRequest, StoppingCriteria
from scheduler.text.tokenizer import ModelTokenizer
from tandem.capabilities import TOKEN_MASKS
from tandem.errors import Unsupported
from tests.executor_driver import make_executor
from tests.faulty_executor_client import FaultyExecutorClient
from tests.scheduler.engine_harness import collect, tokens
from scheduler.engine.executor_codec import executor_info_from_pb

WORDS = r"[a-z]{2,6}( [a-z]{2,6}){1,3}\."


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return ModelTokenizer(model_dir)


def client(model_dir, address: str, hidden: set[str]) -> FaultyExecutorClient:
    return FaultyExecutorClient(InProcessExecutorClient(make_executor(model_dir, kv_blocks=64)), address=address,
                                hidden_capabilities=hidden)


async def serve(clients: list[FaultyExecutorClient], tokenizer, work) -> object:
    """A fleet over clients with its loops running; work(fleet) is awaited; every block free afterwards."""
    fleet = Fleet(SchedulerConfig(clients[0].address, reconnect_interval_s=0.01), tokenizer, executor_info_from_pb(clients[0].info_now()))
    for c in clients:
        fleet.add(c, executor_info_from_pb(c.info_now()))
    await fleet.start()
    task = asyncio.create_task(fleet.run())
    try:
        return await work(fleet)
    finally:
        await fleet.drain(0)
        task.cancel()
        for c in clients:
            kv = c.info_now().kv
            assert (kv.active_caches, kv.free_blocks) == (0, kv.total_blocks), f"{c.address}: KV blocks leaked"


def test_constrained_requests_go_only_to_an_executor_that_applies_masks(model_dir, tokenizer):
    old, new = client(model_dir, "old", {TOKEN_MASKS}), client(model_dir, "new", set())

    async def work(fleet):
        assert TOKEN_MASKS in fleet.info.capabilities  # some serving executor can: the servicer accepts it
        words = fleet.grammars.compile(ConstraintSpec(ConstraintKind.REGEX, WORDS))
        constrained = [GenerateRequest(f"c{k}", (1, 5 + k, 9, 30 + k), StoppingCriteria(40), constraint=words)
                       for k in range(4)]
        plain = [GenerateRequest(f"p{k}", (1, 50 + k, 7), StoppingCriteria(12, ignore_eos=True)) for k in range(8)]
        outs = [fleet.submit(r)[1] for r in constrained + plain]
        return [await collect(o) for o in outs]

    results = asyncio.run(serve([old, new], tokenizer, work))
    for events in results[:4]:
        assert events[-1].finish_reason is FinishReason.STOP, events[-1]  # the grammar completed
        assert re.fullmatch(WORDS, "".join(e.text for e in events)), "".join(e.text for e in events)
    assert all(len(tokens(events)) == 12 for events in results[4:])
    masked = lambda c: [i for s in c.sent for i in s.items if i.allowed_tokens]  # noqa: E731
    assert masked(new) and not masked(old)  # every mask went to the executor that applies it
    assert old.sent, "the older executor should still serve plain requests"


def test_without_a_capable_executor_a_constrained_request_is_refused(model_dir, tokenizer):
    clients = [client(model_dir, "old-a", {TOKEN_MASKS}), client(model_dir, "old-b", {TOKEN_MASKS})]

    async def work(fleet):
        assert TOKEN_MASKS not in fleet.info.capabilities
        words = fleet.grammars.compile(ConstraintSpec(ConstraintKind.REGEX, WORDS))
        with pytest.raises(Unsupported, match="token_masks"):
            fleet.submit(GenerateRequest("c", (1, 5, 9), StoppingCriteria(8), constraint=words))
        plain = fleet.submit(GenerateRequest("p", (1, 5, 9), StoppingCriteria(4, ignore_eos=True)))[1]
        return await collect(plain)

    assert len(tokens(asyncio.run(serve(clients, tokenizer, work)))) == 4
