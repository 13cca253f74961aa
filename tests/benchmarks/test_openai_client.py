"""benchmarks/openai_client.py against the real tiny stack (executor + scheduler with --http-port 0): the
records of closed- and open-loop runs have the exact output length, the same output ids as gRPC Generate
gives for the same chat, sane timings (no timing assertions beyond order), usage, and an error record for a
refused request."""
from __future__ import annotations

import asyncio

import pytest

from benchmarks import openai_client
from tandem.generate.v1 import generate_pb2 as pb
from tests.grpc_harness import start_for, start_scheduler_for
from tests.scheduler_client import collect

PROMPTS = ["hello world", "the quick brown fox", "hi there", "once upon a time"]
OUTPUT_LEN = 8


@pytest.fixture(scope="module")
def scheduler(request, model_dir):
    executor = start_for(request, model_dir, "--kv-blocks", "64")
    return start_scheduler_for(request, executor.address, "--http-port", "0")


def _grpc_ids(stub, prompt: str) -> list[int]:
    req = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=prompt)]),
                             stopping=pb.StoppingCriteria(max_new_tokens=OUTPUT_LEN, ignore_eos=True))
    return collect(stub, req).token_ids


def test_records_of_closed_and_open_loops(scheduler):
    url = scheduler.process.http_url

    async def run():
        async with openai_client.make_client(url, concurrency=2) as client:
            closed = await openai_client.closed_loop(client, PROMPTS, OUTPUT_LEN, 2, "t", timeout=60)
            opened = await openai_client.open_loop(client, PROMPTS, OUTPUT_LEN, [0.0, 0.01, 0.02, 0.03], 2, "t",
                                                   timeout=60)
            bad = await openai_client.send_one(client, openai_client.Record(0, 0), "hi", 4, "t", 60, model="nope")
        return closed, opened, bad

    closed, opened, bad = asyncio.run(run())
    want = [_grpc_ids(scheduler.stub, p) for p in PROMPTS]
    for records in (closed, opened):
        for ids, rec in zip(want, records):
            assert rec.error is None, rec.error
            assert rec.output_len == OUTPUT_LEN and rec.output_ids == ids
            assert rec.finish_reason == "length"
            assert rec.usage["completion_tokens"] == OUTPUT_LEN and rec.prompt_len == rec.usage["prompt_tokens"] > 0
            m = rec.metrics()
            assert 0 < m["ttft"] <= m["latency"] and len(m["itl"]) == OUTPUT_LEN - 1
            assert rec.start <= rec.messages[0][0] <= rec.messages[-1][0] <= rec.end
    assert all(r.arrival is not None for r in opened)
    assert bad.error.startswith("HTTP 404:") and "nope" in bad.error and not bad.messages
