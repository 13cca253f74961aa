"""The prefix-caching benchmark's client: the timed run of one workload against a running scheduler (closed loop
of questions, or concurrent conversations whose turns follow each other), between two snapshots of the
executor's GetMetrics counters."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import grpc

from benchmarks.cpu import CpuMeter
from benchmarks.prefix_workloads import Prompts, question_prompts, turn_prompt
from benchmarks.request_metrics import Record
from benchmarks.serving_client import closed_loop, send_one
from benchmarks.serving_tandem import executor_totals, model_info_dict
from tandem.executor.v1 import executor_pb2 as epb
from tandem.executor.v1 import executor_pb2_grpc as epb_grpc
from tandem.generate.v1 import generate_pb2 as gpb
from tandem.generate.v1 import generate_pb2_grpc as gpb_grpc

_F = epb.KvUsage.DESCRIPTOR.fields[0]
SCALAR = {_F.CPPTYPE_INT32, _F.CPPTYPE_INT64, _F.CPPTYPE_UINT32, _F.CPPTYPE_UINT64, _F.CPPTYPE_FLOAT,
          _F.CPPTYPE_DOUBLE, _F.CPPTYPE_BOOL}
SKIPPED = "not sent: an earlier turn of its conversation failed"


@dataclass
class TurnRecord(Record):
    """A multi-turn request: which conversation, which turn (1-based)."""
    conversation: int = 0
    turn: int = 0

    def as_json(self, t0: float) -> dict[str, Any]:
        return {"conversation": self.conversation, "turn": self.turn, **super().as_json(t0)}


@dataclass
class TimedRun:
    """What one workload's timed run measured."""
    records: list[Record]
    cpu: dict[str, Any]
    executor_before: dict[str, Any]  # executor_snapshot() after the warm-up
    executor_after: dict[str, Any]
    t0: float  # the first request's start (perf_counter)
    duration: float  # first start to last end, s
    model_info: dict[str, Any]  # GetModelInfo (dtype, device, ...)


async def run_conversations(stub: gpb_grpc.GenerateServiceStub, system: list[int], users: list[list[list[int]]],
                            output_len: int, concurrency: int, timeout: float) -> list[TurnRecord]:
    """`concurrency` conversations in flight; each runs its turns one after the other (a turn's prompt holds
    the previous turn's answer) and a finished conversation starts the next. Records: conversation-major."""
    turns = len(users[0]) if users else 0
    records = [TurnRecord(c * turns + t, 0, conversation=c, turn=t + 1)
               for c in range(len(users)) for t in range(turns)]
    todo = iter(range(len(users)))

    async def client() -> None:
        for c in todo:  # one shared iterator: each finished conversation starts the next one
            history = list(system)
            for t, user in enumerate(users[c]):
                rec = records[c * turns + t]
                prompt = turn_prompt(history, user)
                rec.prompt_len = len(prompt)
                await send_one(stub, rec, prompt, output_len, f"mt{c}", timeout)
                if rec.error or len(rec.output_ids) != output_len:  # the rest of the conversation cannot follow
                    for later in records[c * turns + t + 1:(c + 1) * turns]:
                        later.error = SKIPPED
                    break
                history = prompt + rec.output_ids  # exactly the ids streamed: a true prefix of the next turn

    await asyncio.gather(*(client() for _ in range(min(concurrency, len(users)))))
    return records


def scalars(msg: Any) -> dict[str, int | float]:
    """The numeric and bool scalar fields of a message (by descriptor, so fields added later are picked up)."""
    return {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields
            if not f.is_repeated and f.cpp_type in SCALAR}


def executor_snapshot(m: epb.GetMetricsResponse) -> dict[str, Any]:
    """The executor's counters: forwards, tokens processed / sampled, calls and total ms per operation and RPC,
    KV usage, and GetMetricsResponse.prefix_cache (None on an executor whose contract has no such field)."""
    snap: dict[str, Any] = executor_totals(m)
    snap["kv"] = scalars(m.kv)
    snap["prefix_cache"] = scalars(m.prefix_cache) if "prefix_cache" in m.DESCRIPTOR.fields_by_name else None
    return snap


async def timed_run(address: str, executor_address: str, workload: str, prompts: Prompts, output_len: int,
                    concurrency: int, timeout: float, meter: CpuMeter) -> TimedRun:
    """Warm-up (untimed), executor snapshot, the timed workload, executor snapshot."""
    async with grpc.aio.insecure_channel(address) as channel, \
            grpc.aio.insecure_channel(executor_address) as ex_channel:
        await asyncio.wait_for(channel.channel_ready(), timeout=60)
        stub = gpb_grpc.GenerateServiceStub(channel)
        ex_stub = epb_grpc.ExecutorServiceStub(ex_channel)
        info = model_info_dict(await stub.GetModelInfo(gpb.GetModelInfoRequest(), timeout=30))
        if prompts.warmup:
            warm = await closed_loop(stub, prompts.warmup, output_len, concurrency, "warmup", timeout)
            bad = [r.error for r in warm if r.error]
            if bad:
                raise RuntimeError(f"warm-up request failed: {bad[0]}")
        before = executor_snapshot(await ex_stub.GetMetrics(epb.GetMetricsRequest(), timeout=30))
        meter.start()
        if workload == "system-prompt":
            records: list[Record] = await closed_loop(stub, question_prompts(prompts), output_len, concurrency,
                                                      "sys", timeout)
        else:
            records = await run_conversations(stub, prompts.system, prompts.users, output_len, concurrency, timeout)
        cpu = meter.stop()
        after = executor_snapshot(await ex_stub.GetMetrics(epb.GetMetricsRequest(), timeout=30))
    sent = [r for r in records if r.start]
    t0 = min((r.start for r in sent), default=time.perf_counter())
    duration = max((r.end for r in sent), default=t0) - t0
    return TimedRun(records, cpu, before, after, t0, duration, info)
