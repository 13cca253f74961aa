"""The serving benchmark's Tandem phase: start an executor and a scheduler (unless --target names one), draw
the prompts from the served model's vocabulary, stream the warm-up and timed requests through each --backend
(benchmarks/serving_backends.py), stop the servers."""
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
from benchmarks import openai_client, serving_client
from benchmarks.serving_backends import chat_texts, phase_order, pooled_cpu, run_phase
from benchmarks.workloads import kv_blocks, model_vocabulary, prompt_vocabulary, vocabulary_prompts
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
    prompts: list[list[int]]  # as the model sees them (chat prompts: rendered by the scheduler's Tokenize)
    records: list[Record]  # gRPC's (all its phases)
    model_info: dict[str, Any]
    cpu: dict[str, Any]
    executor_metrics: dict[str, Any] | None
    t0: float
    duration: float
    backends: dict[str, dict[str, Any]]  # per --backend: records, t0, duration (its phases summed), cpu
    phases: list[dict[str, Any]]  # the timed phases in run order: round, backend, t0_s, duration_s
    http_url: str | None
    chat: bool  # prompts sent as one user chat message (the text of the random ids) rather than ids


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
                # chat prompts: the template's tokens, and re-tokenized text may take more ids than it came from
                prompt_max = args.input_len * 2 + 64 if "openai-chat" in args.backends else args.input_len
                extra += ["--kv-blocks", str(kv_blocks(in_flight + max(args.warmup, 1),
                                                       prompt_max + args.output_len))]
            if (len(args.backends) > 1 or args.rounds > 1) and not has_flag(ex_args, "--no-prefix-caching"):
                extra += ["--no-prefix-caching"]  # later phases reuse the prompts: no KV cache hits across them
            if not has_flag(ex_args, "--log-level"):
                extra += ["--log-level", "WARNING"]
            t = time.perf_counter()
            executor = server_process.launch_executor(model_dir, *extra, *ex_args)
            http = ["--http-port", "0"] if "openai-chat" in args.backends else []
            scheduler = server_process.launch_scheduler(executor.address, *http, *shlex.split(args.scheduler_args))
            address = scheduler.address
            servers = {"executor": {"address": executor.address, "pid": executor.proc.pid, "command": executor.args},
                       "scheduler": {"address": address, "pid": scheduler.proc.pid, "command": scheduler.args,
                                     "http_url": scheduler.http_url}}
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
        prompts: list = vocabulary_prompts(args.num_requests, args.input_len, allowed, args.seed, stream=0)
        warmup_prompts: list = vocabulary_prompts(args.warmup, args.input_len, allowed, args.seed, stream=1)
        http_url = scheduler.http_url if scheduler is not None else args.target_http
        chat = "openai-chat" in args.backends
        if chat:  # both backends send the same chat text (serving_backends.py); baselines get its rendered ids
            if not http_url:
                raise RuntimeError("--backend openai-chat: the scheduler serves no HTTP front")
            prompts, warmup_prompts = chat_texts(http_url, prompts), chat_texts(http_url, warmup_prompts)
            rendered = rendered_ids(address, prompts)
        records_by, model_info, ex_metrics, phases = asyncio.run(
            tandem_load(address, http_url, prompts, warmup_prompts, args, pids,
                        executor.address if executor else None))
        backends = {}
        for b, recs in records_by.items():
            mine = [p for p in phases if p["backend"] == b]
            backends[b] = {"records": recs, "t0": min(p["t0"] for p in mine),
                           "duration": sum(p["duration_s"] for p in mine), "cpu": pooled_cpu([p["cpu"] for p in mine])}
            log(f"{b}: {len(recs)} requests in {backends[b]['duration']:.2f}s ({len(mine)} phases)")
        t_first = min(p["t0"] for p in phases)
        for p in phases:
            p["t0_s"] = p.pop("t0") - t_first
            p["other_cores"] = p.pop("cpu")["other_cores"]
        records = backends["grpc"]["records"]
        if executor is not None and any(r.error for b in backends.values() for r in b["records"]):
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
    grpc_side = backends["grpc"]
    return TandemRun(address, servers, allowed, rendered if chat else prompts, records, model_info, grpc_side["cpu"],
                     ex_metrics, grpc_side["t0"], grpc_side["duration"], backends, phases, http_url, chat)


def rendered_ids(address: str, texts: list[str]) -> list[list[int]]:
    """The prompt ids Generate uses for each text sent as one user chat message (the Tokenize RPC)."""
    with grpc.insecure_channel(address) as ch:
        stub = gpb_grpc.GenerateServiceStub(ch)
        return [list(stub.Tokenize(gpb.TokenizeRequest(messages=serving_client.chat(t)), timeout=30).token_ids)
                for t in texts]


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


async def tandem_load(address: str, http_url: str | None, prompts: list, warmup_prompts: list, args,
                      pids: dict[str, int], executor_address: str | None
                      ) -> tuple[dict[str, list[Record]], dict[str, Any], dict[str, Any] | None, list[dict[str, Any]]]:
    """Warm-up through every backend, then the timed phases (phase_order); returns each backend's records
    (all its phases), GetModelInfo, the executor's work during the timed phases, and the phases (round,
    backend, t0, duration_s, cpu)."""
    ex_channel = grpc.aio.insecure_channel(executor_address) if executor_address else None
    ex_stub = epb_grpc.ExecutorServiceStub(ex_channel) if ex_channel else None
    http = openai_client.make_client(http_url, args.concurrency or len(prompts)) \
        if "openai-chat" in args.backends else None
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            await asyncio.wait_for(channel.channel_ready(), timeout=60)
            stub = gpb_grpc.GenerateServiceStub(channel)
            info = await stub.GetModelInfo(gpb.GetModelInfoRequest(), timeout=30)
            for backend in args.backends if warmup_prompts else ():
                t = time.perf_counter()
                n = args.concurrency or len(warmup_prompts)
                warm = (await serving_client.closed_loop(stub, warmup_prompts, args.output_len, n, "warmup",
                                                         args.request_timeout) if backend == "grpc" else
                        await openai_client.closed_loop(http, warmup_prompts, args.output_len, n, "warmup",
                                                        args.request_timeout))
                bad = [r.error for r in warm if r.error]
                if bad:
                    raise RuntimeError(f"{backend} warm-up request failed: {bad[0]}")
                log(f"{backend} warm-up: {len(warm)} requests in {time.perf_counter() - t:.1f}s")
            ex_before = executor_totals(await ex_stub.GetMetrics(epb.GetMetricsRequest(), timeout=30)) \
                if ex_stub else None
            t_start = time.perf_counter()
            records: dict[str, list[Record]] = {b: [] for b in args.backends}
            phases = []
            for r, backend in phase_order(args.backends, args.rounds):
                meter = CpuMeter(pids)
                meter.start()
                recs = await run_phase(backend, stub, http, prompts, args, f"{backend}-r{r}")
                cpu = meter.stop()
                t0 = min(x.start for x in recs)
                phases.append({"round": r, "backend": backend, "t0": t0,
                               "duration_s": max(x.end for x in recs) - t0, "cpu": cpu})
                records[backend] += recs
                log(f"round {r} {backend}: {len(recs)} requests in {phases[-1]['duration_s']:.1f}s")
            wall = time.perf_counter() - t_start
            ex_metrics = None
            if ex_stub is not None:
                ex_after = executor_totals(await ex_stub.GetMetrics(epb.GetMetricsRequest(), timeout=30))
                ex_metrics = executor_delta(ex_before, ex_after, wall)
    finally:
        if ex_channel is not None:
            await ex_channel.close()
        if http is not None:
            await http.aclose()
    return records, model_info_dict(info), ex_metrics, phases


def model_info_dict(info: gpb.GetModelInfoResponse) -> dict[str, Any]:
    from google.protobuf import json_format
    return json_format.MessageToDict(info, preserving_proto_field_name=True)
