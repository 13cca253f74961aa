"""Fleet benchmark: one scheduler over several executors, as a client sees it — (1) scaling: the same workload on
one executor with T threads and on N executors sharing the same cores, (2) failover: an executor SIGKILLed under
a batch of long streams, and what the streams saw.

Workloads: prompts of exactly the given length, token ids drawn with a fixed seed from the model's regular
vocabulary (benchmarks/workloads.py, as bench_serving draws them); every request greedy, `ignore_eos`, exactly
its output length, streamed through the scheduler's Generate. Every executor's KV pool is sized for a whole run
(`--kv-blocks`; one size for all), so that no request is preempted for lack of room — on its own executor, or on
the survivor after a failover.

1. Scaling (--configs, default `1x2,2x1`: EXECUTORSxTHREADS). For each configuration, fresh processes: that many
   `python -m executor_service --threads THREADS` and one `python -m scheduler --executor ... --executor ...`.
   --warmup untimed requests (other prompts), then --num-requests requests, closed loop with --concurrency in
   flight (as bench_serving), the configurations one after the other, never sharing the CPU. Per configuration:
   request and output-token throughput, TTFT / TPOT p50 and p99 (as bench_serving measures them), the requests
   each executor got (its `caches_created`) and its busy share, the cores each process used; then every
   configuration's ratio to the first (throughputs: higher is better; latencies: lower is better).
2. Failover (--failover-executors x --failover-threads, default 2 x 1). Two runs on fleets of that shape, each:
   warm-up, then --failover-streams requests of --failover-input-len prompt tokens and --failover-output-len
   output tokens, all at once. The clean run ends there; it runs on the scaling configuration of the same shape
   after its timed run when there is one (other prompts: nothing of them is cached), else on a fresh fleet. The
   failover run always gets a fresh fleet. In it, once every
   stream has streamed --kill-after-tokens tokens, the executor that GetModelInfo shows running the most
   requests (ties: the first) is SIGKILLed, and the streams are followed to their end. Per stream
   (benchmarks/fleet_failover.py says exactly how): the largest gap between consecutive token messages, kill ->
   next token, kill -> resume (the first token computed after the move), whether it paused, whether it moved
   (usage.preemptions), the tokens recomputed (moved streams: prompt + tokens streamed before the resume); for
   the run: every stream completed with no error and exactly its length, how many gave the clean run's tokens,
   the executors' extra work (their tokens processed beyond a clean run's) as a cross-check of the recompute.

The scheduler's and this client's CPU time are part of the cost: on a 2-core machine they compete with the
executors' threads (the "cores" column says how much each used, "other cores" how busy the rest of the machine
was: above ~0.2 the timings are disturbed). The script fails (exit 1) when a request failed or did not produce
exactly its length, or when the failover run lost a stream.

Output: tables on stdout, JSON (--out, default bench_results/bench_fleet.json: config, machine, model, per
configuration every metric, per-executor work and per-request records; the failover runs, per-stream views and
the summaries).

    python scripts/bench_fleet.py                                # SmolLM2 fp32: 32 x (128 in, 64 out); 16 x (128, 128)
    python scripts/bench_fleet.py --parts failover --failover-streams 32
    python scripts/bench_fleet.py --quick --model /tmp/tiny-llama
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shlex
from pathlib import Path
from typing import Any

from benchmarks import runtime
from benchmarks.cli import add_process_args, apply_preset, make_log, parser
from benchmarks.cpu import CpuMeter
from benchmarks.fleet_client import failover_run, scaling_run
from benchmarks.fleet_failover import analyse
from benchmarks.fleet_report import failover_payload, print_failover, print_scaling, scaling_payload
from benchmarks.fleet_servers import FleetServers, start_fleet
from benchmarks.report import machine_info, model_json, write_json
from benchmarks.request_metrics import aggregate, agreement
from benchmarks.serving_tandem import has_flag
from benchmarks.workloads import kv_blocks, model_vocabulary, vocabulary_prompts
from models.config import ModelConfig

PARTS = ("scaling", "failover")
DEFAULTS = {"configs": "1x2,2x1", "num_requests": 32, "input_len": 128, "output_len": 64, "concurrency": 32,
            "warmup": 2, "failover_streams": 16, "failover_input_len": 128, "failover_output_len": 128,
            "kill_after_tokens": 8}
# The tiny model decodes in milliseconds: long streams keep the kill inside them.
QUICK = {"configs": "1x2,2x1", "num_requests": 8, "input_len": 16, "output_len": 8, "concurrency": 8, "warmup": 1,
         "failover_streams": 4, "failover_input_len": 16, "failover_output_len": 128, "kill_after_tokens": 2}

log = make_log("bench_fleet")


def parse_configs(text: str, ap: argparse.ArgumentParser) -> list[tuple[int, int]]:
    """`1x2,2x1` -> [(1, 2), (2, 1)]: (executors, threads each)."""
    out = []
    for item in (v.strip() for v in text.split(",") if v.strip()):
        try:
            n, t = (int(x) for x in item.lower().split("x"))
        except ValueError:
            ap.error(f"--configs: expected EXECUTORSxTHREADS items such as 2x1, got {item!r}")
        if n < 1 or t < 1:
            ap.error(f"--configs: executors and threads must be >= 1, got {item!r}")
        out.append((n, t))
    if not out:
        ap.error("--configs: give at least one EXECUTORSxTHREADS")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = parser(__doc__, epilog="Method and how to read the output: see the module docstring "
                                "(head -45 benchmarks/fleet.py).")
    ap.add_argument("--model", type=Path, default=None,
                    help="HF model directory (default: SmolLM2-135M-Instruct via scripts/prepare_default_model.py)")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma list of scaling, failover (default both)")
    ap.add_argument("--configs", default=None,
                    help="scaling: EXECUTORSxTHREADS comma list, ratios against the first "
                         f"(default {DEFAULTS['configs']})")
    for name, text in (("num-requests", "scaling: timed requests"), ("input-len", "scaling: prompt tokens"),
                       ("output-len", "scaling: generated tokens per request, exactly"),
                       ("concurrency", "scaling: requests in flight (closed loop)"),
                       ("warmup", "untimed requests before each timed run"),
                       ("failover-streams", "failover: concurrent streams"),
                       ("failover-input-len", "failover: prompt tokens"),
                       ("failover-output-len", "failover: generated tokens per stream, exactly"),
                       ("kill-after-tokens", "failover: kill once every stream has streamed this many tokens")):
        key = name.replace("-", "_")
        ap.add_argument(f"--{name}", type=int, default=None, help=f"{text} (default {DEFAULTS[key]})")
    ap.add_argument("--failover-executors", type=int, default=2, help="failover: executors (default 2)")
    ap.add_argument("--failover-threads", type=int, default=1, help="failover: threads per executor (default 1)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts (default 0)")
    add_process_args(ap, "for every executor, after the script's own --threads, --kv-blocks, --log-level WARNING")
    ap.add_argument("--out", type=Path, default=Path("bench_results/bench_fleet.json"),
                    help="JSON results file (default bench_results/bench_fleet.json)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: scaling 8 x (16 in, 8 out), failover 4 streams x (16 in, 128 out) killed after "
                         "2 tokens, warmup 1 (explicit flags still win)")
    args = ap.parse_args(argv)
    apply_preset(args, QUICK if args.quick else DEFAULTS)
    args.part_list = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not args.part_list or any(p not in PARTS for p in args.part_list):
        ap.error(f"--parts: expected a comma list of {', '.join(PARTS)}, got {args.parts!r}")
    args.config_list = parse_configs(args.configs, ap)
    if min(args.num_requests, args.input_len, args.output_len, args.concurrency, args.failover_streams,
           args.failover_input_len, args.failover_output_len, args.kill_after_tokens) < 1 or args.warmup < 0:
        ap.error("sizes must be >= 1 (--warmup >= 0)")
    if args.kill_after_tokens >= args.failover_output_len:
        ap.error("--kill-after-tokens must be below --failover-output-len (the kill must land mid-stream)")
    if args.failover_executors < 2 or args.failover_threads < 1:
        ap.error("--failover-executors must be >= 2 (one is killed), --failover-threads >= 1")
    if has_flag(shlex.split(args.executor_args), "--threads", "--kv-blocks", "--kv-memory-fraction"):
        ap.error("--executor-args: threads come from --configs / --failover-threads, the KV pool from the workload")
    return args


def executor_flags(args, sequences: int, tokens: int) -> list[str]:
    """Every executor's flags after --threads: a KV pool for `sequences` of `tokens`, quiet logs, then the
    user's --executor-args."""
    user = shlex.split(args.executor_args)
    flags = ["--kv-blocks", str(kv_blocks(sequences, tokens))]
    return flags + ([] if has_flag(user, "--log-level") else ["--log-level", "WARNING"]) + user


def stop(fleet: FleetServers | None) -> dict[str, int] | None:
    return None if fleet is None else fleet.stop()


def run_scaling(args, model_dir: Path, prompts, warmup, flags: list[str], clean: tuple | None = None
                ) -> tuple[dict[str, Any], tuple[Any, dict[str, Any]] | None]:
    """Each configuration on fresh servers; returns the sides by name, in --configs order. clean: (prompts,
    warm-up prompts) of the failover's clean run, made on the configuration of the failover's shape once its
    timed run is over (a fleet launch saved; its prefix cache holds only the scaling prompts); then also returns
    that run and its servers' JSON."""
    sides: dict[str, Any] = {}
    clean_run = clean_host = None
    for n, threads in args.config_list:
        name = f"{n}x{threads}"
        fleet = None
        try:
            fleet = start_fleet(model_dir, n, threads, flags, shlex.split(args.scheduler_args), log)
            meter = CpuMeter({**fleet.pids(), "client": os.getpid()})
            run = asyncio.run(scaling_run(fleet.address, fleet.executor_addresses, prompts, warmup, args.output_len,
                                          args.concurrency, args.request_timeout, meter))
            if any(r.error for r in run.records):
                log(f"{name}: a request failed\n{fleet.log_tails()}")
            hosts_clean = clean is not None and (n, threads) == (args.failover_executors, args.failover_threads)
            if hosts_clean:
                clean_run = failover_streams(args, fleet, *clean, kill=False)
            servers = fleet.describe()
        finally:
            codes = stop(fleet)
        if hosts_clean:
            clean_host = {**servers, "exit_codes": codes, "scaling_config": name}
        side = aggregate(name, run.records, run.t0, run.duration, None, None, args.output_len)
        side.update(executors=n, threads=threads, cpu=run.cpu, executor_work=run.executors,
                    servers={**servers, "exit_codes": codes}, model_info=run.model_info)
        log(f"{name}: {len(run.records)} requests in {run.duration:.2f}s; requests per executor "
            f"{'/'.join(str(w['requests']) for w in run.executors)}")
        sides[name] = side
    return sides, (clean_run, clean_host) if clean_run else None


def failover_streams(args, fleet: FleetServers, prompts, warmup, kill: bool) -> Any:
    """The batch of streams on a running fleet, with or without the kill."""
    meter = CpuMeter({**fleet.pids(), "client": os.getpid()})
    run = asyncio.run(failover_run(fleet.address, fleet.executor_addresses, prompts, warmup, args.failover_output_len,
                                   args.kill_after_tokens, args.request_timeout, fleet.sigkill if kill else None,
                                   meter))
    if kill and run.kill is None:
        log("WARNING: every stream ended before all had streamed --kill-after-tokens tokens: no kill happened")
    if any(r.error for r in run.records):
        log(f"{'failover' if kill else 'clean'} run: a stream failed\n{fleet.log_tails()}")
    log(f"{'failover' if kill else 'clean'} run: {len(run.records)} streams in {run.duration:.2f}s")
    return run


def run_failover(args, model_dir: Path, prompts, warmup, flags: list[str], kill: bool) -> tuple[Any, dict[str, Any]]:
    """The batch of streams on a fresh fleet; returns the run and the servers' JSON."""
    fleet = None
    try:
        fleet = start_fleet(model_dir, args.failover_executors, args.failover_threads, flags,
                            shlex.split(args.scheduler_args), log)
        run = failover_streams(args, fleet, prompts, warmup, kill)
        servers = fleet.describe()
    finally:
        codes = stop(fleet)
    return run, {**servers, "exit_codes": codes}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runtime.exit_on_sigterm()
    model_dir = runtime.model_dir(args.model)
    cfg = ModelConfig.from_dir(model_dir)
    longest = max(args.input_len + args.output_len, args.failover_input_len + args.failover_output_len)
    if longest > cfg.max_position_embeddings:
        raise SystemExit(f"error: {longest} tokens per request is past the model's {cfg.max_position_embeddings}")
    allowed = model_vocabulary(model_dir, cfg)
    log(f"model {model_dir}; parts {', '.join(args.part_list)}")
    results: dict[str, Any] = {"benchmark": "bench_fleet", "machine": machine_info("cpu"),
                               "model": model_json(model_dir, cfg)}
    results["config"] = {k: getattr(args, k) for k in (
        "configs", "num_requests", "input_len", "output_len", "concurrency", "warmup", "failover_executors",
        "failover_threads", "failover_streams", "failover_input_len", "failover_output_len", "kill_after_tokens",
        "seed", "executor_args", "scheduler_args", "quick")}
    results["config"].update(model=str(model_dir), parts=args.part_list)
    header = f"model: {model_dir.name}  ({cfg.architecture})  machine: {os.cpu_count()} CPUs"
    ok = True

    # every pool holds what any run of this invocation puts on one executor: the configurations stay alike, and
    # the scaling fleet of the failover's shape can host its clean run
    sequences, tokens = [], []
    if "scaling" in args.part_list:
        sequences.append(args.concurrency + max(args.warmup, 1))
        tokens.append(args.input_len + args.output_len)
    if "failover" in args.part_list:  # the survivor takes every stream
        sequences.append(args.failover_streams + max(args.warmup, 1))
        tokens.append(args.failover_input_len + args.failover_output_len)
    flags = executor_flags(args, max(sequences), max(tokens))
    f_prompts = vocabulary_prompts(args.failover_streams, args.failover_input_len, allowed, args.seed, stream=3)
    f_warm = vocabulary_prompts(args.warmup, args.failover_input_len, allowed, args.seed, stream=4)
    clean = None
    if "scaling" in args.part_list:
        prompts = vocabulary_prompts(args.num_requests, args.input_len, allowed, args.seed, stream=0)
        warm = vocabulary_prompts(args.warmup, args.input_len, allowed, args.seed, stream=1)
        sides, clean = run_scaling(args, model_dir, prompts, warm, flags,
                                   (f_prompts, f_warm) if "failover" in args.part_list else None)
        results["scaling"] = scaling_payload(sides, args.output_len)
        print_scaling(header, args, results["scaling"])
        ok &= results["scaling"]["all_exact_output_len"]

    if "failover" in args.part_list:
        clean_run, clean_servers = clean or run_failover(args, model_dir, f_prompts, f_warm, flags, kill=False)
        failed, servers = run_failover(args, model_dir, f_prompts, f_warm, flags, kill=True)
        view = analyse(failed, args.failover_output_len) if failed.kill else None
        agree = agreement(failed.records, clean_run.records)
        results["failover"] = failover_payload(args, clean_run, failed, view, agree, clean_servers, servers)
        results["failover"]["clean_on_scaling_fleet"] = clean is not None
        print_failover(header, args, results["failover"])
        out = results["failover"]
        ok &= out["killed"] and out["all_completed"] and out["clean_all_completed"]

    results["ok"] = bool(ok)
    path = write_json(args.out, results)
    log(f"wrote {path}")
    return 0 if ok else 1
