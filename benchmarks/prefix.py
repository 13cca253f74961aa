"""Prefix-caching benchmark: the same workloads against real executor + scheduler processes with the executor's
automatic prefix cache on and off, streamed through the scheduler's Generate service.

Workloads (benchmarks/prefix_workloads.py; prompts are token ids from the model's regular vocabulary, fixed seed;
every request asks for exactly --output-len tokens: greedy, `stopping.ignore_eos`):
- system-prompt: a --system-tokens system prompt shared by --questions distinct questions of --question-tokens
  tokens each, closed loop with --concurrency requests in flight;
- multi-turn: --conversations conversations of --turns turns, --concurrency conversations in flight; turn t
  re-sends the whole conversation so far: the same system prompt, every earlier user message (--question-tokens)
  and answer (the ids the model streamed), then the new user message. A conversation's turns are sequential.

Modes (--modes): `on` starts the executor with its defaults (the cache on), `off` with --no-prefix-caching
(MODE_EXECUTOR_ARGS). Every (workload, mode) run gets fresh server processes, with one KV pool size for both
modes, large enough that nothing has to be evicted for lack of room (--kv-blocks to change it); --warmup
untimed requests with unrelated prompts run first, then the timed workload between two GetMetrics snapshots of
the executor.

Per run: request and token throughput, TTFT / TPOT / E2EL (mean, p50, p99; as bench_serving measures them) and
for multi-turn the TTFT of turns >= 3; prompt tokens sent, cached (usage.cached_tokens of each response) and
computed (sent - cached); the hit rate (the executor's prefix-cache hit tokens / query tokens when its
GetMetrics has them, else cached / sent); the executor's tokens processed minus the decode tokens (what it really
ran). Then the issue's targets, each met or not: system-prompt mean TTFT >= 4x lower and request throughput
>= 2x higher with the cache on; multi-turn prompt tokens computed <= 25 % of those sent (cache on) and mean TTFT
of turns >= 3 >= 3x lower. Also how many requests generated the same tokens in both modes. The script fails
(exit 1) when a request failed or did not produce exactly --output-len tokens.

Output: tables on stdout, JSON (--out, default bench_results/bench_prefix.json: config, machine, model, per run
every metric, the executor counters and the per-request records, the comparisons).

    python scripts/bench_prefix.py                        # SmolLM2 fp32, both workloads, cache on and off
    python scripts/bench_prefix.py --workloads multi-turn --modes on
    python scripts/bench_prefix.py --quick --model /tmp/tiny-llama
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import time
from pathlib import Path
from typing import Any

from benchmarks import runtime
from benchmarks.cli import add_process_args, apply_preset, make_log, parser
from benchmarks.cpu import CpuMeter
from benchmarks.prefix_client import TimedRun, timed_run
from benchmarks.prefix_report import bad_records, compare, print_report, summarize_run
from benchmarks.prefix_workloads import WORKLOADS, Prompts, Shape, kv_pool_blocks, make_prompts
from benchmarks.report import machine_info, model_json, write_json
from benchmarks.request_metrics import agreement
from benchmarks.serving_tandem import has_flag
from benchmarks.workloads import model_vocabulary
from models.kv_cache import DEFAULT_BLOCK_SIZE
from tandem import server_process

# The executor's extra arguments in each mode (after --threads, --kv-blocks, --log-level; before --executor-args).
MODE_EXECUTOR_ARGS: dict[str, list[str]] = {"on": [], "off": ["--no-prefix-caching"]}
DEFAULTS = {"system_tokens": 1000, "questions": 64, "question_tokens": 32, "conversations": 16, "turns": 6,
            "output_len": 64, "concurrency": 8, "warmup": 2}
QUICK = {"system_tokens": 64, "questions": 4, "question_tokens": 8, "conversations": 2, "turns": 3,
         "output_len": 8, "concurrency": 2, "warmup": 1}

log = make_log("bench_prefix")


def comma_choices(text: str, choices: tuple[str, ...], flag: str, ap: argparse.ArgumentParser) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in values if v not in choices]
    if not values or unknown:
        ap.error(f"{flag}: expected a comma list of {', '.join(choices)}, got {text!r}")
    return list(dict.fromkeys(values))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = parser(__doc__, epilog="Method: see the module docstring (head -40 benchmarks/prefix.py).")
    ap.add_argument("--model", type=Path, default=None,
                    help="HF model directory served by the executor (default: SmolLM2-135M-Instruct via "
                         "scripts/prepare_default_model.py)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help=f"comma list of workloads to run, of {', '.join(WORKLOADS)} (default both)")
    ap.add_argument("--modes", default=",".join(MODE_EXECUTOR_ARGS),
                    help="comma list of cache modes, on (executor defaults) and off (--no-prefix-caching); "
                         "default on,off; the comparisons need both")
    for name, text in (("system-tokens", "tokens of the system prompt every prompt starts with"),
                       ("questions", "system-prompt: requests, each its own question"),
                       ("question-tokens", "tokens of a question / of a multi-turn user message"),
                       ("conversations", "multi-turn: conversations"), ("turns", "multi-turn: turns per conversation"),
                       ("output-len", "generated tokens per request, exactly"),
                       ("concurrency", "system-prompt: requests in flight; multi-turn: conversations in flight"),
                       ("warmup", "untimed requests (unrelated prompts) before each timed run")):
        key = name.replace("-", "_")
        ap.add_argument(f"--{name}", type=int, default=None, help=f"{text} (default {DEFAULTS[key]})")
    ap.add_argument("--kv-blocks", type=int, default=None,
                    help="the executor's KV pool in blocks, both modes (default: each workload's in-flight "
                         "requests plus every distinct block it writes, so that nothing is evicted for lack of room)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of the executor (default: every usable core)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts (default 0)")
    add_process_args(ap, "in both modes, after the mode's own")
    ap.add_argument("--out", type=Path, default=Path("bench_results/bench_prefix.json"),
                    help="JSON results file (default bench_results/bench_prefix.json)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: system prompt 64, 4 questions of 8, 2 conversations x 3 turns, output 8, "
                         "concurrency 2, warmup 1 (explicit flags still win)")
    args = ap.parse_args(argv)
    apply_preset(args, QUICK if args.quick else DEFAULTS)
    args.workload_list = comma_choices(args.workloads, WORKLOADS, "--workloads", ap)
    args.mode_list = comma_choices(args.modes, tuple(MODE_EXECUTOR_ARGS), "--modes", ap)
    if min(args.questions, args.question_tokens, args.conversations, args.turns, args.output_len,
           args.concurrency) < 1 or min(args.system_tokens, args.warmup) < 0:
        ap.error("--questions, --question-tokens, --conversations, --turns, --output-len and --concurrency must be "
                 ">= 1; --system-tokens and --warmup >= 0")
    if args.kv_blocks is not None and args.kv_blocks < 1:
        ap.error("--kv-blocks must be >= 1")
    if has_flag(shlex.split(args.executor_args), "--kv-blocks", "--kv-memory-fraction", "--threads"):
        ap.error("--executor-args: give --kv-blocks and --threads as this script's own flags")
    return args


def executor_args(args, mode: str, workload: str, shape: Shape, threads: int) -> list[str]:
    blocks = args.kv_blocks or kv_pool_blocks(shape, workload, args.concurrency, DEFAULT_BLOCK_SIZE)
    extra = ["--threads", str(threads), "--kv-blocks", str(blocks)]
    user = shlex.split(args.executor_args)
    if not has_flag(user, "--log-level"):
        extra += ["--log-level", "WARNING"]
    return extra + MODE_EXECUTOR_ARGS[mode] + user


def run_mode(args, model_dir: Path, workload: str, mode: str, shape: Shape, prompts: Prompts,
             threads: int) -> tuple[TimedRun, dict[str, Any]]:
    """Fresh executor + scheduler, the timed run, servers stopped; returns the run and the servers' JSON."""
    executor = scheduler = None
    try:
        t = time.perf_counter()
        executor = server_process.launch_executor(model_dir, *executor_args(args, mode, workload, shape, threads))
        scheduler = server_process.launch_scheduler(executor.address, *shlex.split(args.scheduler_args))
        servers: dict[str, Any] = {
            "executor": {"address": executor.address, "pid": executor.proc.pid, "command": executor.args},
            "scheduler": {"address": scheduler.address, "pid": scheduler.proc.pid, "command": scheduler.args}}
        log(f"{workload}, cache {mode}: servers ready in {time.perf_counter() - t:.1f}s")
        meter = CpuMeter({"client": os.getpid(), "executor": executor.proc.pid, "scheduler": scheduler.proc.pid})
        run = asyncio.run(timed_run(scheduler.address, executor.address, workload, prompts, args.output_len,
                                    args.concurrency, args.request_timeout, meter))
        failed = [r for r in run.records if r.error]
        if failed:
            log(f"{len(failed)} requests failed (first: {failed[0].error}); scheduler log tail:\n"
                f"{scheduler.log(4000)}\nexecutor log tail:\n{executor.log(4000)}")
        servers["exit_codes"] = {"scheduler": scheduler.stop(), "executor": executor.stop()}
        log(f"{workload}, cache {mode}: {len(run.records)} requests in {run.duration:.2f}s")
        return run, servers
    finally:
        for s in (scheduler, executor):
            if s is not None:
                s.stop()


def workload_lines(args, runs: dict[str, Any]) -> list[str]:
    lines = []
    if "system-prompt" in runs:
        lines.append(f"system-prompt: {args.system_tokens}-token system prompt + {args.questions} questions of "
                     f"{args.question_tokens} tokens, {args.output_len} out each, "
                     f"{min(args.concurrency, args.questions)} in flight")
    if "multi-turn" in runs:
        lines.append(f"multi-turn: {args.conversations} conversations x {args.turns} turns ({args.system_tokens}-token "
                     f"system prompt, user messages of {args.question_tokens}, answers of {args.output_len}), "
                     f"{min(args.concurrency, args.conversations)} conversations in flight")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads, model_dir, cfg = runtime.serving_setup(args)
    shape = Shape(args.system_tokens, args.questions, args.question_tokens, args.conversations, args.turns,
                  args.output_len)
    longest = max(shape.longest_prompt(w) for w in args.workload_list) + args.output_len
    if longest > cfg.max_position_embeddings:
        raise SystemExit(f"error: the longest request ({longest} tokens) is past the model's "
                         f"{cfg.max_position_embeddings} positions")
    allowed = model_vocabulary(model_dir, cfg)
    prompts = make_prompts(shape, allowed, args.seed, args.warmup)
    log(f"model {model_dir}; workloads {', '.join(args.workload_list)}; cache {', '.join(args.mode_list)}; "
        f"{threads} threads")

    runs: dict[str, dict[str, dict[str, Any]]] = {}
    records: dict[str, dict[str, list]] = {}
    bad = 0
    for workload in args.workload_list:
        runs[workload], records[workload] = {}, {}
        for mode in args.mode_list:
            run, servers = run_mode(args, model_dir, workload, mode, shape, prompts, threads)
            side = summarize_run(workload, mode, run, args.output_len)
            side["servers"] = servers
            runs[workload][mode], records[workload][mode] = side, run.records
            enabled = side["prefix"]["executor_prefix_caching"]
            if enabled is not None and enabled != (mode == "on"):
                log(f"WARNING: {workload}, cache {mode}: the executor reports prefix caching "
                    f"{'on' if enabled else 'off'} (see MODE_EXECUTOR_ARGS and --executor-args)")
            wrong = bad_records(run.records, args.output_len)
            for r in wrong[:5]:
                log(f"{workload}/{mode} request {r.index}: error {r.error}, {r.output_len} streamed tokens, "
                    f"usage {r.usage}, finish {r.finish_reason or '-'}")
            bad += len(wrong)
    agree = {w: agreement(r["on"], r["off"]) if {"on", "off"} <= set(r) else None for w, r in records.items()}
    comparisons = compare(runs)

    info = next(s["model_info"] for modes in runs.values() for s in modes.values())
    header = (f"model: {model_dir.name}  ({cfg.architecture}, {info.get('dtype', '?')} on {info.get('device', '?')})"
              f"  threads: {threads}  KV block {DEFAULT_BLOCK_SIZE} tokens")
    lines = workload_lines(args, runs)
    print_report(header, lines, runs, comparisons, agree, bad)

    config = {k: getattr(args, k) for k in ("system_tokens", "questions", "question_tokens", "conversations",
                                            "turns", "output_len", "concurrency", "warmup", "kv_blocks", "seed",
                                            "executor_args", "scheduler_args", "quick")}
    config.update(model=str(model_dir), workloads=args.workload_list, modes=args.mode_list, threads=threads,
                  block_size=DEFAULT_BLOCK_SIZE, mode_executor_args={m: MODE_EXECUTOR_ARGS[m] for m in args.mode_list},
                  prompt_vocabulary={"ids": int(allowed.size), "min": int(allowed.min()), "max": int(allowed.max())})
    results = {"benchmark": "bench_prefix", "config": config, "machine": machine_info("cpu"),
               "model": model_json(model_dir, cfg), "runs": runs, "comparisons": comparisons, "agreement": agree,
               "all_exact_output_len": bad == 0}
    path = write_json(args.out, results)
    log(f"wrote {path}")
    return 1 if bad else 0
