"""Serving benchmark: concurrent streamed requests of exact lengths through the scheduler's OpenAI-compatible
front (a real executor + scheduler), a closed loop, then transformers' generate on the same prompts
(--baseline hf,hf-serial) in the same run. Method and metrics: docs/benchmarks.md."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import time
from pathlib import Path
from typing import Any

from benchmarks import openai_client
from benchmarks.baselines import HfBaseline
from benchmarks.cli import (add_process_args, add_sizes, choices, has_flag, make_log, parse, parser,
                            serving_setup, stack)
from benchmarks.flops import FlopModel
from benchmarks.measure import CpuMeter, cores_text
from benchmarks.report import format_table, machine_info, model_json, write_json
from benchmarks.request_metrics import Record, aggregate, agreement, exact
from benchmarks.workloads import kv_blocks, model_vocabulary, vocabulary_prompts

BASELINES = ("hf", "hf-serial")
QUICK = {"num_requests": 4, "input_len": 16, "output_len": 8, "concurrency": 2, "warmup": 1,
         "hf_serial_requests": 0}
DEFAULTS = {"num_requests": 32, "input_len": 128, "output_len": 64, "concurrency": 32, "warmup": 2,
            "hf_serial_requests": 8}
THROUGHPUT = [("name", "side"), ("completed", "done"), ("exact_output_len", "exact len"), ("duration_s", "duration s"),
              ("request_throughput", "req/s", 3), ("output_throughput", "out tok/s", 1),
              ("total_token_throughput", "total tok/s", 1), ("gflops", "GFLOP/s", 1),
              ("tandem_over_side", "tandem/side", 2), ("cores", "cores"), ("other_cores", "other cores")]
LATENCY = [("name", "side")] + [(f"{m}_{s}", f"{label} {s}", 1) for m, label in (
    ("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")) for s in ("mean", "p50", "p99")]
log = make_log("bench_serving")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = parser("serving", __doc__,
                "4 requests, input 16, output 8, concurrency 2, warmup 1, every hf-serial request timed")
    add_sizes(ap, DEFAULTS, {"input-len": "prompt tokens per request", "output-len": "generated tokens, exactly",
                             "num-requests": "timed requests",
                             "concurrency": "requests in flight (closed loop)",
                             "warmup": "untimed requests first (baselines: one untimed generate, unless 0)",
                             "hf-serial-requests": "hf-serial: time only the first K prompts and extrapolate the "
                                                   "duration to all (0 = all)"})
    ap.add_argument("--baseline", default="", help="comma list run after Tandem on the same prompts: hf (batched "
                    "generate), hf-serial (one request at a time); default none")
    ap.add_argument("--hf-batch-size", type=int, default=None, help="prompts per generate call of the hf baseline "
                    "(default: --concurrency)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    add_process_args(ap)
    args = parse(ap, argv, QUICK, DEFAULTS)
    if min(args.input_len, args.output_len, args.num_requests, args.concurrency) < 1 or args.warmup < 0:
        ap.error("--input-len, --output-len, --num-requests and --concurrency must be >= 1, --warmup >= 0")
    args.baselines = choices(args.baseline, BASELINES, "--baseline") if args.baseline else []
    args.hf_batch_size = max(1, min(args.hf_batch_size or args.concurrency, args.num_requests))
    return args


def run_tandem(args, url: str, prompts: list[list[int]], warmup: list[list[int]], pids: dict[str, int]
               ) -> tuple[list[Record], dict[str, Any]]:
    """The warm-up, then the timed run with the processes' CPU use around it."""
    if warmup:
        warm = asyncio.run(openai_client.run(url, warmup, args.output_len, args.concurrency, args.request_timeout))
        if any(r.error for r in warm):
            raise RuntimeError(f"warm-up request failed: {next(r.error for r in warm if r.error)}")
    meter = CpuMeter(pids)
    meter.start()
    records = asyncio.run(openai_client.run(url, prompts, args.output_len, args.concurrency, args.request_timeout))
    return records, meter.stop()


def run_baselines(args, model_dir: Path, prompts: list[list[int]], tandem: list[Record], flops: float | None
                  ) -> list[dict[str, Any]]:
    """transformers on the same prompts, the servers stopped (the phases never share the CPU)."""
    pad = json.loads((model_dir / "config.json").read_text()).get("pad_token_id") or 0
    hf, sides = HfBaseline(model_dir, pad_id=int(pad), log=log), []
    for name in args.baselines:
        k = args.num_requests if name == "hf" else min(args.hf_serial_requests or args.num_requests, args.num_requests)
        meter = CpuMeter({"client": os.getpid()})
        meter.start()
        recs = hf.run(name, prompts[:k], args.hf_batch_size if name == "hf" else 1, args.output_len, args.warmup > 0)
        side = aggregate(name, recs, flops_per_request=flops, output_len=args.output_len)
        side.update(cpu=meter.stop(), timed_requests=k, agreement_with_tandem=agreement(recs, tandem))
        side["duration_s"] *= args.num_requests / k  # hf-serial: extrapolated to every request (rates: measured)
        sides.append(side)
        log(f"{name}: {side['output_throughput']:.1f} output tok/s")
    return sides


def print_report(sides: list[dict[str, Any]], header: list[str], bad: int) -> None:
    print("\n".join(header) + "\n")
    rows = [{**s, "cores": cores_text(s["cpu"], ("executor", "scheduler", "client")),
             "other_cores": s["cpu"]["other_cores"],
             **{f"{m}_{st}": s[f"{m}_ms"][st] for m in ("ttft", "tpot", "itl", "e2el")
                for st in ("mean", "p50", "p99")}}
            for s in sides]
    print(format_table(rows, THROUGHPUT))
    print("\ncores: executor/scheduler/client (tandem) or this process (baselines), CPU s per wall s; other cores: "
          "the rest of the machine meanwhile (above ~0.2 the timings were disturbed). tandem/side: tandem output "
          "tok/s / the side's.\n")
    print(format_table(rows, LATENCY))
    print("\nms; TTFT = first token, TPOT = (E2E - TTFT) / (tokens - 1) per request, ITL = per token, E2EL = end "
          "to end.")
    for s in sides[1:]:
        a = s.get("agreement_with_tandem")
        if a:
            print(f"{s['name']}: {a['identical']}/{a['compared']} requests generated the same tokens as tandem "
                  f"(mean common prefix {a['mean_common_prefix']:.1f})")
    if bad:
        print(f"ERROR: {bad} tandem requests failed or did not produce exactly the output length (see stderr)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads, model_dir, cfg = serving_setup(args)
    if args.input_len + args.output_len > cfg.max_position_embeddings:
        raise SystemExit(f"error: --input-len + --output-len is past the model's {cfg.max_position_embeddings}")
    flop_model = FlopModel.from_config(cfg)
    flops = flop_model.request(args.input_len, args.output_len)
    allowed = model_vocabulary(model_dir, cfg)
    prompts = vocabulary_prompts(args.num_requests, args.input_len, allowed, args.seed, stream=0)
    warmup = vocabulary_prompts(args.warmup, args.input_len, allowed, args.seed, stream=1)
    mode = f"closed loop, {args.concurrency} in flight"
    log(f"model {model_dir}; {args.num_requests} x ({args.input_len} in, {args.output_len} out), {mode}")
    user = shlex.split(args.executor_args)
    flags = ["--threads", str(threads)] + ([] if has_flag(user, "--kv-blocks", "--kv-memory-fraction") else [
        "--kv-blocks", str(kv_blocks(args.concurrency + max(args.warmup, 1),
                                     args.input_len + args.output_len))]) + user  # a pool for the whole run
    t = time.perf_counter()
    with stack(model_dir, flags, shlex.split(args.scheduler_args)) as servers:
        url = servers[1].http_url
        pids = {"client": os.getpid(), **{s.name: s.proc.pid for s in servers}}
        log(f"serving at {url} (ready in {time.perf_counter() - t:.1f}s)")
        records, cpu = run_tandem(args, url, prompts, warmup, pids)
        if any(r.error for r in records):
            log(f"a request failed; scheduler log tail:\n{servers[1].log(4000)}\nexecutor:\n{servers[0].log(4000)}")
        codes = {s.name: s.stop() for s in reversed(servers)}
    tandem = aggregate("tandem", records, flops_per_request=flops, output_len=args.output_len) | {"cpu": cpu}
    bad = [r for r in records if not exact(r, args.output_len)]
    for r in bad[:5]:
        log(f"request {r.index}: error {r.error}, {r.output_len} tokens, usage {r.usage}, finish {r.finish_reason}")
    sides = [tandem] + (run_baselines(args, model_dir, prompts, records, flops) if args.baselines else [])
    for s in sides:
        s["tandem_over_side"] = tandem["output_throughput"] / s["output_throughput"] if s["output_throughput"] else None
    print_report(sides, [f"model: {model_dir.name} ({cfg.architecture})  threads: {threads}",
                         f"workload: {args.num_requests} requests x ({args.input_len} prompt, "
                         f"{args.output_len} output tokens), {mode}, seed {args.seed}; tandem = {url}"], len(bad))
    config = {k: v for k, v in vars(args).items() if k != "out"} | {"threads": threads, "mode": mode}
    results = {"benchmark": "bench_serving", "config": config, "machine": machine_info("cpu"),
               "model": model_json(model_dir, cfg) | {"flops_per_request": flops},
               "servers": {s.name: {"address": s.address, "pid": s.proc.pid, "command": s.args} for s in servers}
               | {"http_url": url, "exit_codes": codes},
               "all_exact_output_len": not bad, "sides": {s["name"]: s for s in sides},
               "ratios": {s["name"]: {"tandem_over_side": s["tandem_over_side"]} for s in sides[1:]}}
    log(f"wrote {write_json(args.out, results)}")
    return 1 if bad else 0
