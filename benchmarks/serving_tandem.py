"""The serving benchmark's Tandem phase: start an executor and a scheduler (unless --target names one), draw
the prompts from the served model's vocabulary, stream the warm-up and timed requests, stop the servers."""
from __future__ import annotations

import asyncio
import os
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from tandem import server_process
from benchmarks.cli import make_log
from benchmarks.cpu import CpuMeter
from benchmarks.request_metrics import Record
from benchmarks.serving_client import closed_loop, open_loop
from benchmarks.workloads import (kv_blocks, model_vocabulary, poisson_arrivals, prompt_vocabulary,
                                  vocabulary_prompts)
from tandem.executor.v1 import executor_pb2 as epb
from tandem.executor.v1 import executor_pb2_grpc as epb_grpc
from tandem.generate.v1 import generate_pb2 as gpb
from tandem.generate.v1 import generate_pb2_grpc as gpb_grpc

log = make_log("bench_serving")


@dataclass
class TandemRun:
    """What the Tandem phase measured, and the prompts the baselines reuse."""
    address: str
    servers: dict[str, Any]
    allowed: np.ndarray  # the token ids prompts are drawn from
    prompts: list[list[int]]
    records: list[Record]
    model_info: dict[str, Any]
    cpu: dict[str, Any]
    executor_metrics: dict[str, Any] | None
    t0: float
    duration: float


def has_flag(args: list[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in args for f in flags)


def run_tandem(args, model_dir: Path | None, cfg: Any, threads: int) -> TandemRun:
    """cfg: the model's ModelConfig, or None (--target alone: the vocabulary comes from GetModelInfo)."""
    executor = scheduler = None
    servers: dict[str, Any] = {}
    try:
        if args.target:
            address = args.target
        else:
            ex_args = shlex.split(args.executor_args)
            in_flight = args.concurrency or args.num_requests
            extra = ["--threads", str(threads)]
            if not has_flag(ex_args, "--kv-blocks", "--kv-memory-fraction"):
                extra += ["--kv-blocks", str(kv_blocks(in_flight + max(args.warmup, 1),
                                                       args.input_len + args.output_len))]
            if not has_flag(ex_args, "--log-level"):
                extra += ["--log-level", "WARNING"]
            t = time.perf_counter()
            executor = server_process.launch_executor(model_dir, *extra, *ex_args)
            scheduler = server_process.launch_scheduler(executor.address, *shlex.split(args.scheduler_args))
            address = scheduler.address
            servers = {"executor": {"address": executor.address, "pid": executor.proc.pid, "command": executor.args},
                       "scheduler": {"address": address, "pid": scheduler.proc.pid, "command": scheduler.args}}
            log(f"executor {executor.address} and scheduler {address} ready in {time.perf_counter() - t:.1f}s")
        pids = {"client": os.getpid()}
        if executor is not None:
            pids.update(executor=executor.proc.pid, scheduler=scheduler.proc.pid)

        # prompts: the vocabulary from the model dir, or (with --target alone) from GetModelInfo
        if cfg is not None:
            allowed = model_vocabulary(model_dir, cfg)
        else:
            with grpc.insecure_channel(address) as ch:
                info = gpb_grpc.GenerateServiceStub(ch).GetModelInfo(gpb.GetModelInfoRequest(), timeout=30)
            allowed = prompt_vocabulary(model_dir, info.vocab_size, list(info.eos_token_ids))
        prompts = vocabulary_prompts(args.num_requests, args.input_len, allowed, args.seed, stream=0)
        warmup_prompts = vocabulary_prompts(args.warmup, args.input_len, allowed, args.seed, stream=1)

        meter = CpuMeter(pids)
        records, model_info, cpu, ex_metrics = asyncio.run(
            tandem_load(address, prompts, warmup_prompts, args, meter, executor.address if executor else None))
        t0 = min(r.start for r in records)
        duration = max(r.end for r in records) - t0
        log(f"tandem: {len(records)} requests in {duration:.2f}s")
        if executor is not None and any(r.error for r in records):
            log(f"a request failed; scheduler log tail:\n{scheduler.log(4000)}\nexecutor log tail:\n"
                f"{executor.log(4000)}")
        if executor is not None:
            codes = {"scheduler": scheduler.stop(), "executor": executor.stop()}
            log(f"servers stopped (exit codes: scheduler {codes['scheduler']}, executor {codes['executor']})")
            servers["exit_codes"] = codes
    finally:
        for s in (scheduler, executor):
            if s is not None:
                s.stop()
    return TandemRun(address, servers, allowed, prompts, records, model_info, cpu, ex_metrics, t0, duration)


def executor_totals(m: epb.GetMetricsResponse) -> dict[str, Any]:
    """Cumulative counters of the executor's GetMetrics: calls and total ms per operation and RPC."""
    return {"ops": {k: (v.count, v.count * v.mean_ms) for k, v in m.operations.items()},
            "rpcs": {k: (v.count, v.count * v.mean_ms) for k, v in m.rpcs.items()},
            "forward_passes": m.forward_passes, "tokens_processed": m.tokens_processed,
            "tokens_sampled": m.tokens_sampled}


def executor_delta(before: dict[str, Any], after: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """What the executor did during the timed run: calls, mean ms and busy share of the wall time per
    operation (model work, lock wait included) and per RPC (as its gRPC handler saw it). The wall time not
    covered by executor operations is the scheduler's planning, streaming and the loopback round trips."""
    out: dict[str, Any] = {"wall_s": wall_s}
    for group in ("ops", "rpcs"):
        out[group] = {}
        for k, (n, ms) in after[group].items():
            n0, ms0 = before[group].get(k, (0, 0.0))
            if n > n0:
                out[group][k] = {"calls": n - n0, "mean_ms": (ms - ms0) / (n - n0),
                                 "busy_share": (ms - ms0) / 1e3 / wall_s if wall_s > 0 else None}
    for k in ("forward_passes", "tokens_processed", "tokens_sampled"):
        out[k] = after[k] - before[k]
    return out


async def tandem_load(address: str, prompts: list[list[int]], warmup_prompts: list[list[int]], args,
                      meter: CpuMeter, executor_address: str | None
                      ) -> tuple[list[Record], dict[str, Any], dict[str, Any], dict[str, Any] | None]:
    ex_channel = grpc.aio.insecure_channel(executor_address) if executor_address else None
    ex_stub = epb_grpc.ExecutorServiceStub(ex_channel) if ex_channel else None
    async with grpc.aio.insecure_channel(address) as channel:
        await asyncio.wait_for(channel.channel_ready(), timeout=60)
        stub = gpb_grpc.GenerateServiceStub(channel)
        info = await stub.GetModelInfo(gpb.GetModelInfoRequest(), timeout=30)
        if warmup_prompts:
            t = time.perf_counter()
            warm = await closed_loop(stub, warmup_prompts, args.output_len, args.concurrency or len(warmup_prompts),
                                     "warmup", args.request_timeout)
            bad = [r.error for r in warm if r.error]
            if bad:
                raise RuntimeError(f"warm-up request failed: {bad[0]}")
            log(f"warm-up: {len(warm)} requests in {time.perf_counter() - t:.1f}s")
        ex_before = executor_totals(await ex_stub.GetMetrics(epb.GetMetricsRequest(), timeout=30)) if ex_stub else None
        t_start = time.perf_counter()
        meter.start()
        if args.request_rate is None:
            records = await closed_loop(stub, prompts, args.output_len, args.concurrency, "timed",
                                        args.request_timeout)
        else:
            arrivals = poisson_arrivals(len(prompts), args.request_rate, args.seed)
            records = await open_loop(stub, prompts, args.output_len, arrivals, args.concurrency, "timed",
                                      args.request_timeout)
        cpu = meter.stop()
        wall = time.perf_counter() - t_start
        ex_metrics = None
        if ex_stub is not None:
            ex_after = executor_totals(await ex_stub.GetMetrics(epb.GetMetricsRequest(), timeout=30))
            ex_metrics = executor_delta(ex_before, ex_after, wall)
            await ex_channel.close()
    return records, model_info_dict(info), cpu, ex_metrics


def model_info_dict(info: gpb.GetModelInfoResponse) -> dict[str, Any]:
    from google.protobuf import json_format
    return json_format.MessageToDict(info, preserving_proto_field_name=True)
