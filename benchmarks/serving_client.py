"""An asyncio client of Tandem's Generate service: streamed greedy requests of an exact output length,
closed loop (N in flight) or open loop (given arrival times), each request's timings in a Record.

A prompt is token ids (used as is) or a str: one user chat message, rendered by the scheduler with the
model's chat template, as an OpenAI chat request's `messages` are (benchmarks/openai_client.py)."""
from __future__ import annotations

import time
from typing import Callable, Union

import grpc

from benchmarks import request_loops as loops
from benchmarks.request_metrics import Record
from tandem.common.v1 import common_pb2 as cpb
from tandem.generate.v1 import generate_pb2 as gpb
from tandem.generate.v1 import generate_pb2_grpc as gpb_grpc

Prompt = Union[list[int], str]


def chat(text: str) -> gpb.ChatMessages:
    return gpb.ChatMessages(messages=[gpb.ChatMessage(role="user", content=text)])


def generate_request(index: int, prompt: Prompt, output_len: int, tag: str) -> gpb.GenerateRequest:
    source = {"messages": chat(prompt)} if isinstance(prompt, str) else {"token_ids": gpb.TokenIds(ids=prompt)}
    return gpb.GenerateRequest(
        request_id=f"bench-{tag}-{index}", **source,
        sampling=cpb.SamplingParams(),  # temperature 0: greedy
        stopping=gpb.StoppingCriteria(max_new_tokens=output_len, ignore_eos=True))


async def send_one(stub: gpb_grpc.GenerateServiceStub, rec: Record, prompt: Prompt, output_len: int,
                   tag: str, timeout: float, on_tokens: Callable[[Record], None] | None = None) -> Record:
    """on_tokens(rec): called after each message that carried tokens (e.g. to act once every stream has
    started), on the event loop, before the next message is read. rec.prompt_len becomes
    usage.prompt_tokens (a chat prompt's length is known only once rendered)."""
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
                rec.prompt_len = u.prompt_tokens
    except grpc.aio.AioRpcError as exc:
        rec.error = f"{exc.code().name}: {exc.details()}"
    rec.end = time.perf_counter()
    return rec


def _records(prompts: list[Prompt]) -> list[Record]:
    return [Record(i, 0 if isinstance(p, str) else len(p)) for i, p in enumerate(prompts)]


async def closed_loop(stub, prompts: list[Prompt], output_len: int, concurrency: int, tag: str,
                      timeout: float) -> list[Record]:
    records = _records(prompts)
    await loops.closed_loop(len(prompts), concurrency,
                            lambda i: send_one(stub, records[i], prompts[i], output_len, tag, timeout))
    return records


async def open_loop(stub, prompts: list[Prompt], output_len: int, arrivals: list[float],
                    cap: int | None, tag: str, timeout: float) -> list[Record]:
    records = _records(prompts)
    await loops.open_loop(records, arrivals, cap,
                          lambda i: send_one(stub, records[i], prompts[i], output_len, tag, timeout))
    return records
