"""An asyncio client of Tandem's Generate service: streamed greedy requests of an exact output length,
closed loop (N in flight) or open loop (given arrival times), each request's timings in a Record."""
from __future__ import annotations

import asyncio
import time
from typing import Callable

import grpc

from benchmarks.request_metrics import Record
from tandem.common.v1 import common_pb2 as cpb
from tandem.generate.v1 import generate_pb2 as gpb
from tandem.generate.v1 import generate_pb2_grpc as gpb_grpc


def generate_request(index: int, prompt: list[int], output_len: int, tag: str) -> gpb.GenerateRequest:
    return gpb.GenerateRequest(
        request_id=f"bench-{tag}-{index}", token_ids=gpb.TokenIds(ids=prompt),
        sampling=cpb.SamplingParams(),  # temperature 0: greedy
        stopping=gpb.StoppingCriteria(max_new_tokens=output_len, ignore_eos=True))


async def send_one(stub: gpb_grpc.GenerateServiceStub, rec: Record, prompt: list[int], output_len: int,
                   tag: str, timeout: float, on_tokens: Callable[[Record], None] | None = None) -> Record:
    """on_tokens(rec): called after each message that carried tokens (e.g. to act once every stream has
    started), on the event loop, before the next message is read."""
    req = generate_request(rec.index, prompt, output_len, tag)
    rec.start = time.perf_counter()
    try:
        async for msg in stub.Generate(req, timeout=timeout):
            t = time.perf_counter()
            if msg.token_ids:
                rec.messages.append((t, len(msg.token_ids)))
                rec.output_ids.extend(msg.token_ids)
                if on_tokens is not None:
                    on_tokens(rec)
            if msg.finish_reason:
                rec.finish_reason = gpb.FinishReason.Name(msg.finish_reason)
            if msg.HasField("usage"):
                u = msg.usage
                rec.usage = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                             "cached_tokens": u.cached_tokens, "preemptions": u.preemptions}
    except grpc.aio.AioRpcError as exc:
        rec.error = f"{exc.code().name}: {exc.details()}"
    rec.end = time.perf_counter()
    return rec


async def closed_loop(stub, prompts: list[list[int]], output_len: int, concurrency: int, tag: str,
                      timeout: float) -> list[Record]:
    records = [Record(i, len(p)) for i, p in enumerate(prompts)]
    todo = iter(range(len(prompts)))

    async def client() -> None:
        for i in todo:  # one shared iterator: each finished request starts the next one
            await send_one(stub, records[i], prompts[i], output_len, tag, timeout)

    await asyncio.gather(*(client() for _ in range(min(concurrency, len(prompts)))))
    return records


async def open_loop(stub, prompts: list[list[int]], output_len: int, arrivals: list[float],
                    cap: int | None, tag: str, timeout: float) -> list[Record]:
    records = [Record(i, len(p)) for i, p in enumerate(prompts)]
    slots = asyncio.Semaphore(cap) if cap else None
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        records[i].arrival = time.perf_counter()
        if slots is None:
            await send_one(stub, records[i], prompts[i], output_len, tag, timeout)
            return
        async with slots:
            await send_one(stub, records[i], prompts[i], output_len, tag, timeout)

    tasks = []
    for i, offset in enumerate(arrivals):
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(i)))
    await asyncio.gather(*tasks)
    return records
