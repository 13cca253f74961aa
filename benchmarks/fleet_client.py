"""The fleet benchmark's client: a timed closed-loop run against one scheduler over several executors (with each
executor's counters around it, to see how the router spread the work), and a batch of concurrent streams during
which one executor may be SIGKILLed once every stream has produced its first tokens."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc

from benchmarks.cpu import CpuMeter
from benchmarks.prefix_client import executor_snapshot
from benchmarks.request_metrics import Record
from benchmarks.serving_client import closed_loop, send_one
from benchmarks.serving_tandem import model_info_dict
from tandem.executor.v1 import executor_pb2 as epb
from tandem.executor.v1 import executor_pb2_grpc as epb_grpc
from tandem.generate.v1 import generate_pb2 as gpb
from tandem.generate.v1 import generate_pb2_grpc as gpb_grpc

# The executor operations that run the model (the others are bookkeeping, or long-lived like an event stream).
MODEL_OPS = ("unified_decode", "prefill", "decode", "forward_verify")


@dataclass
class ScalingRun:
    records: list[Record]
    cpu: dict[str, Any]
    t0: float  # the first request's start (perf_counter)
    duration: float  # first start to last end, s
    executors: list[dict[str, Any]]  # per executor: what it did during the timed run (executor_work)
    model_info: dict[str, Any]


@dataclass
class FailoverRun:
    records: list[Record]
    t0: float
    duration: float
    model_info: dict[str, Any]
    before: list[dict[str, Any]]  # every executor's snapshot after the warm-up
    after: list[dict[str, Any] | None]  # after the run (None: the killed one)
    kill: dict[str, Any] | None = None  # None: a clean run
    cpu: dict[str, Any] = field(default_factory=dict)  # CpuMeter over the streams (a killed process counts None)
    states_after: list[dict[str, Any]] = field(default_factory=list)  # GetModelInfo.executors after the run


async def snapshot(address: str) -> dict[str, Any]:
    """One executor's counters (GetMetrics), caches created included: one per request routed there."""
    async with grpc.aio.insecure_channel(address) as ch:
        m = await epb_grpc.ExecutorServiceStub(ch).GetMetrics(epb.GetMetricsRequest(), timeout=30)
    snap = executor_snapshot(m)
    snap["caches_created"] = m.caches_created
    return snap


def executor_work(before: dict[str, Any], after: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """What one executor did between two snapshots: requests routed there (caches created), tokens processed
    and sampled, model steps, and the share of the wall time its model was busy."""
    ops = {k: after["ops"][k][1] - before["ops"].get(k, (0, 0.0))[1] for k in MODEL_OPS if k in after["ops"]}
    steps = after["ops"].get("unified_decode", (0, 0.0))[0] - before["ops"].get("unified_decode", (0, 0.0))[0]
    return {"requests": after["caches_created"] - before["caches_created"],
            "tokens_processed": after["tokens_processed"] - before["tokens_processed"],
            "tokens_sampled": after["tokens_sampled"] - before["tokens_sampled"],
            "steps": steps, "busy_share": sum(ops.values()) / 1e3 / wall_s if wall_s > 0 else None}


async def _warm_up(stub, prompts: list[list[int]], output_len: int, timeout: float) -> None:
    if prompts:
        warm = await closed_loop(stub, prompts, output_len, len(prompts), "warmup", timeout)
        bad = [r.error for r in warm if r.error]
        if bad:
            raise RuntimeError(f"warm-up request failed: {bad[0]}")


async def scaling_run(address: str, executors: list[str], prompts: list[list[int]], warmup: list[list[int]],
                      output_len: int, concurrency: int, timeout: float, meter: CpuMeter) -> ScalingRun:
    """Warm-up (untimed), every executor's counters, the timed closed loop, the counters again."""
    async with grpc.aio.insecure_channel(address) as channel:
        await asyncio.wait_for(channel.channel_ready(), timeout=60)
        stub = gpb_grpc.GenerateServiceStub(channel)
        info = model_info_dict(await stub.GetModelInfo(gpb.GetModelInfoRequest(), timeout=30))
        await _warm_up(stub, warmup, output_len, timeout)
        before = await asyncio.gather(*(snapshot(a) for a in executors))
        t = time.perf_counter()
        meter.start()
        records = await closed_loop(stub, prompts, output_len, concurrency, "timed", timeout)
        cpu = meter.stop()
        wall = time.perf_counter() - t
        after = await asyncio.gather(*(snapshot(a) for a in executors))
    t0 = min(r.start for r in records)
    work = [executor_work(b, a, wall) for b, a in zip(before, after)]
    return ScalingRun(records, cpu, t0, max(r.end for r in records) - t0, work, info)


def busiest(executors: list[Any], addresses: list[str]) -> int:
    """The index (in `addresses`) of the executor running the most requests per GetModelInfo; ties: the first."""
    running = {e.address: e.running for e in executors}
    counts = [running.get(a, 0) for a in addresses]
    return max(range(len(addresses)), key=lambda i: (counts[i], -i))


async def failover_run(address: str, executors: list[str], prompts: list[list[int]], warmup: list[list[int]],
                       output_len: int, kill_after: int, timeout: float, kill: Callable[[int], float] | None,
                       meter: CpuMeter) -> FailoverRun:
    """Every prompt streamed at once. With `kill` (index -> instant of the SIGKILL): once every stream has
    `kill_after` tokens, the executor running the most of them is killed; the streams are then followed to
    their end. Without it, the same procedure with no kill (the clean run)."""
    records = [Record(i, len(p)) for i, p in enumerate(prompts)]
    started = asyncio.Event()

    def progress(_: Record) -> None:
        if all(r.output_len >= kill_after for r in records):
            started.set()

    async with grpc.aio.insecure_channel(address) as channel:
        await asyncio.wait_for(channel.channel_ready(), timeout=60)
        stub = gpb_grpc.GenerateServiceStub(channel)
        info = model_info_dict(await stub.GetModelInfo(gpb.GetModelInfoRequest(), timeout=30))
        await _warm_up(stub, warmup, output_len, timeout)
        before = list(await asyncio.gather(*(snapshot(a) for a in executors)))
        meter.start()
        streams = asyncio.ensure_future(asyncio.gather(
            *(send_one(stub, r, prompts[r.index], output_len, "failover", timeout, on_tokens=progress)
              for r in records)))
        kill_info = None
        if kill is not None:
            waiter = asyncio.ensure_future(started.wait())
            await asyncio.wait({waiter, streams}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if started.is_set():
                kill_info = await _kill_busiest(stub, executors, kill, records)
        await streams
        cpu = meter.stop()
        dead = kill_info["index"] if kill_info else None
        after = list(await asyncio.gather(*(snapshot(a) for i, a in enumerate(executors) if i != dead)))
        if dead is not None:
            after.insert(dead, None)
        states = model_info_dict(await stub.GetModelInfo(gpb.GetModelInfoRequest(), timeout=30)).get("executors", [])
    t0 = min(r.start for r in records)
    return FailoverRun(records, t0, max(r.end for r in records) - t0, info, before, after, kill_info, cpu, states)


async def _kill_busiest(stub, executors: list[str], kill: Callable[[int], float],
                        records: list[Record]) -> dict[str, Any]:
    """Picks the victim from GetModelInfo, takes its counters (its work until the kill), kills it."""
    status = (await stub.GetModelInfo(gpb.GetModelInfoRequest(), timeout=30)).executors
    victim = busiest(status, executors)
    at_kill = await snapshot(executors[victim])
    t_kill = kill(victim)
    return {"index": victim, "address": executors[victim], "t": t_kill,
            "running": {e.address: e.running for e in status}, "waiting": {e.address: e.waiting for e in status},
            "streams_finished_before": sum(1 for r in records if r.end and r.end < t_kill),
            "tokens_streamed_before": sum(r.output_len for r in records), "victim_counters": at_kill}
