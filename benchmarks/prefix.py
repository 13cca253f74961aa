"""Prefix-caching benchmark: a shared system prompt with many questions, and multi-turn conversations that re-send
their history, through the scheduler's OpenAI front against fresh executor + scheduler processes per (workload,
mode), with the executor's prefix cache on and off. Method: docs/benchmarks.md."""
from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import executor_metrics, openai_client
from benchmarks.cli import (add_process_args, add_sizes, choices, has_flag, make_log, parse, parser,
                            serving_setup, stack)
from benchmarks.measure import CpuMeter, cores_text, summarize
from benchmarks.report import format_table, machine_info, model_json, write_json
from benchmarks.request_metrics import Record, agreement, aggregate, exact
from benchmarks.workloads import KV_SLACK_BLOCKS, model_vocabulary, vocabulary_prompts
from models.kv.paged_cache import DEFAULT_BLOCK_SIZE
from tandem.ceil_div import ceil_div

WORKLOADS = ("system-prompt", "multi-turn")
MODE_EXECUTOR_ARGS: dict[str, list[str]] = {"on": [], "off": ["--no-prefix-caching"]}
DEFAULTS = {"system_tokens": 1000, "questions": 64, "question_tokens": 32, "conversations": 16, "turns": 6,
            "output_len": 64, "concurrency": 8, "warmup": 2}
QUICK = {"system_tokens": 64, "questions": 4, "question_tokens": 8, "conversations": 2, "turns": 3,
         "output_len": 8, "concurrency": 2, "warmup": 1}
LATE_TURN = 3  # multi-turn: TTFT is also compared over the turns from this one on
SKIPPED = "not sent: an earlier turn of its conversation failed"
RUN_COLUMNS = [("workload", "workload"), ("mode", "cache"), ("completed", "done"), ("duration_s", "duration s"),
               ("request_throughput", "req/s", 3), ("output_throughput", "out tok/s", 1), ("hit_rate", "hit rate", 3),
               ("sent", "prompt sent"), ("computed", "computed"), ("computed_pct", "computed %", 1),
               ("processed", "executor prompt"), ("ttft_mean", "TTFT mean", 1), ("ttft_p99", "TTFT p99", 1),
               ("late_mean", f"TTFT t>={LATE_TURN}", 1), ("tpot_mean", "TPOT mean", 1), ("e2el_mean", "E2EL mean", 1),
               ("cores", "cores"), ("other_cores", "other cores")]
log = make_log("bench_prefix")


@dataclass(frozen=True)
class Prompts:
    """Token ids (so a shared prefix is the same ids in every request, whatever a tokenizer does at a boundary)."""
    system: list[int]
    questions: list[list[int]]  # system-prompt: prompt i is system + questions[i]
    users: list[list[list[int]]]  # multi-turn: [conversation][turn] -> the user message
    warmup: list[list[int]]  # sharing no prefix with the timed run


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = parser("prefix", __doc__,
                "system prompt 64, 4 questions of 8, 2 conversations x 3 turns, output 8, concurrency 2")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {', '.join(WORKLOADS)} (both)")
    ap.add_argument("--modes", default="on,off", help="comma list of on (executor defaults), off "
                    "(--no-prefix-caching)")
    add_sizes(ap, DEFAULTS, {"system-tokens": "tokens of the shared system prompt",
                             "questions": "system-prompt: requests, each its own question",
                             "question-tokens": "tokens of a question / a user message",
                             "conversations": "multi-turn: conversations",
                             "turns": "multi-turn: turns per conversation",
                             "output-len": "generated tokens per request, exactly",
                             "concurrency": "system-prompt: requests in flight; multi-turn: conversations in flight",
                             "warmup": "untimed requests (unrelated prompts) before each timed run"})
    ap.add_argument("--kv-blocks", type=int, default=None, help="the executor's KV pool, both modes (default: room "
                    "for every distinct block the workload writes, so nothing is evicted for lack of room)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    add_process_args(ap)
    args = parse(ap, argv, QUICK, DEFAULTS)
    args.workload_list = choices(args.workloads, WORKLOADS, "--workloads")
    args.mode_list = choices(args.modes, tuple(MODE_EXECUTOR_ARGS), "--modes")
    if min(args.questions, args.question_tokens, args.conversations, args.turns, args.output_len,
           args.concurrency) < 1 or min(args.system_tokens, args.warmup) < 0:
        ap.error("sizes must be >= 1 (--system-tokens and --warmup >= 0)")
    if has_flag(shlex.split(args.executor_args), "--kv-blocks", "--kv-memory-fraction", "--threads"):
        ap.error("--executor-args: give --kv-blocks and --threads as this benchmark's own flags")
    return args


def turn_len(args, turn: int) -> int:
    """Prompt tokens of turn `turn` (1-based): the system prompt, `turn` user messages, the turn - 1 answers."""
    return args.system_tokens + turn * args.question_tokens + (turn - 1) * args.output_len


def kv_pool_blocks(args, workload: str) -> int:
    """Room for every request in flight and every distinct block the workload writes (a smaller --kv-blocks
    measures reuse under eviction)."""
    longest = args.system_tokens + args.question_tokens if workload == "system-prompt" else turn_len(args, args.turns)
    per_request = ceil_div(longest + args.output_len, DEFAULT_BLOCK_SIZE)
    if workload == "system-prompt":
        distinct = ceil_div(args.system_tokens, DEFAULT_BLOCK_SIZE) + args.questions * (
            ceil_div(args.question_tokens + args.output_len, DEFAULT_BLOCK_SIZE) + 1)
    else:  # each conversation's last turn holds its earlier ones
        distinct = args.conversations * per_request
    return distinct + args.concurrency * per_request + KV_SLACK_BLOCKS


def make_prompts(args, allowed: np.ndarray) -> Prompts:
    draw = lambda n, length, stream: vocabulary_prompts(n, length, allowed, args.seed, stream)  # noqa: E731
    flat = draw(args.conversations * args.turns, args.question_tokens, 12)
    return Prompts(draw(1, args.system_tokens, 10)[0], draw(args.questions, args.question_tokens, 11),
                   [flat[c * args.turns:(c + 1) * args.turns] for c in range(args.conversations)],
                   draw(args.warmup, args.system_tokens + args.question_tokens, 13))


async def conversations(url: str, prompts: Prompts, args) -> list[Record]:
    """`concurrency` conversations in flight, each turn after the previous one: a turn's prompt is the previous
    turn's prompt + the exact ids it streamed back + the new user message (a true token prefix of the next)."""
    turns = args.turns
    records = [Record(c * turns + t, 0, tags={"conversation": c, "turn": t + 1})
               for c in range(args.conversations) for t in range(turns)]
    async with openai_client.make_client(url, args.concurrency) as client:
        async def conversation(c: int) -> None:
            history = list(prompts.system)
            for t, user in enumerate(prompts.users[c]):
                rec, prompt = records[c * turns + t], history + user
                rec.prompt_len = len(prompt)
                await openai_client.send(client, rec, prompt, args.output_len, args.request_timeout)
                if rec.error or len(rec.output_ids) != args.output_len:  # the conversation cannot go on
                    for later in records[c * turns + t + 1:(c + 1) * turns]:
                        later.error = SKIPPED
                    return
                history = prompt + rec.output_ids
        await openai_client.closed_loop(args.conversations, args.concurrency, conversation)
    return records


def prefix_stats(records: list[Record], work: dict[str, Any]) -> dict[str, Any]:
    """Prompt tokens sent / cached (each response's usage) / computed, the hit rate (the executor's hit / query
    tokens when its GetMetrics has them, else cached / sent), and the prompt tokens the executor really ran
    (tokens processed minus output - 1 decode tokens per request)."""
    ok = [r for r in records if r.error is None]
    sent, cached = sum(r.prompt_len for r in ok), sum((r.usage or {}).get("cached_tokens", 0) for r in ok)
    ex = work["prefix_cache"] or {}
    hit = next((k for k in ex if "hit" in k and "token" in k), None)  # found by name, whatever their final names
    query = next((k for k in ex if "quer" in k and "token" in k), None)
    ex_rate = ex[hit] / ex[query] if hit and query and ex[query] else None
    return {"prompt_tokens_sent": sent, "cached_tokens": cached, "prompt_tokens_computed": sent - cached,
            "computed_fraction": (sent - cached) / sent if sent else None, "executor_hit_rate": ex_rate,
            "hit_rate": ex_rate if ex_rate is not None else (cached / sent if sent else None),
            "executor_prefix_caching": ex.get("enabled"), "executor_prefix_cache": work["prefix_cache"],
            "executor_tokens_processed": work["tokens_processed"],
            "executor_prompt_tokens_processed": work["tokens_processed"] - sum(max(r.output_len - 1, 0) for r in ok)}


def run_mode(args, model_dir: Path, workload: str, mode: str, prompts: Prompts, threads: int
             ) -> tuple[dict[str, Any], list[Record]]:
    """Fresh executor + scheduler, warm-up, the timed workload between two executor snapshots, servers stopped."""
    flags = ["--threads", str(threads), "--kv-blocks", str(args.kv_blocks or kv_pool_blocks(args, workload)),
             *MODE_EXECUTOR_ARGS[mode], *shlex.split(args.executor_args)]
    with stack(model_dir, flags, shlex.split(args.scheduler_args)) as servers:
        url = servers[1].http_url
        if prompts.warmup:
            asyncio.run(openai_client.run(url, prompts.warmup, args.output_len, args.concurrency, args.request_timeout))
        before = executor_metrics.snapshot(servers[0].address)
        meter = CpuMeter({"client": os.getpid(), **{s.name: s.proc.pid for s in servers}})
        meter.start()
        t = time.perf_counter()
        if workload == "system-prompt":
            records = asyncio.run(openai_client.run(url, [prompts.system + q for q in prompts.questions],
                                                    args.output_len, args.concurrency, args.request_timeout))
        else:
            records = asyncio.run(conversations(url, prompts, args))
        cpu, wall = meter.stop(), time.perf_counter() - t
        work = executor_metrics.work(before, executor_metrics.snapshot(servers[0].address), wall)
        if any(r.error for r in records):
            log(f"a request failed; scheduler log tail:\n{servers[1].log(4000)}\nexecutor:\n{servers[0].log(4000)}")
        codes = {s.name: s.stop() for s in reversed(servers)}
    side = aggregate(f"{workload}/{mode}", records, output_len=args.output_len)
    late = [r.metrics()["ttft"] for r in records
            if r.tags.get("turn", 0) >= LATE_TURN and r.error is None and r.messages]
    side.update(workload=workload, mode=mode, cpu=cpu, prefix=prefix_stats(records, work), executor_work=work,
                ttft_late_turns_ms=summarize(late, 1e3) if workload == "multi-turn" else None,
                servers={"executor_command": servers[0].args, "exit_codes": codes})
    log(f"{workload}, cache {mode}: {len(records)} requests in {side['duration_s']:.2f}s")
    return side, records


def comparisons(runs: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The cache's effect where both modes ran: off/on for times (> 1: the cache helps), on/off for rates."""
    metrics = [("system-prompt", "mean TTFT ms (off/on)", lambda s: s["ttft_ms"]["mean"], True),
               ("system-prompt", "request throughput (on/off)", lambda s: s["request_throughput"], False),
               ("multi-turn", "mean TTFT ms (off/on)", lambda s: s["ttft_ms"]["mean"], True),
               ("multi-turn", f"mean TTFT turns >= {LATE_TURN} (off/on)",
                lambda s: (s["ttft_late_turns_ms"] or {}).get("mean"), True),
               ("multi-turn", "prompt tokens computed / sent (on)", lambda s: s["prefix"]["computed_fraction"], None)]
    rows = []
    for workload, metric, value, lower_better in metrics:
        modes = runs.get(workload, {})
        on, off = (value(modes[m]) if m in modes else None for m in ("on", "off"))
        ratio = on if lower_better is None else (off / on if lower_better else on / off) if on and off else None
        rows.append({"workload": workload, "metric": metric, "off": off, "on": on, "ratio": ratio})
    return [r for r in rows if r["workload"] in runs]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads, model_dir, cfg = serving_setup(args)
    if max(args.system_tokens + args.question_tokens, turn_len(args, args.turns)) + args.output_len > \
            cfg.max_position_embeddings:
        raise SystemExit(f"error: the longest request is past the model's {cfg.max_position_embeddings} positions")
    prompts = make_prompts(args, model_vocabulary(model_dir, cfg))
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    agree, bad = {}, 0
    for workload in args.workload_list:
        runs[workload], recs = {}, {}
        for mode in args.mode_list:
            runs[workload][mode], recs[mode] = run_mode(args, model_dir, workload, mode, prompts, threads)
            bad += sum(not exact(r, args.output_len) for r in recs[mode])
        agree[workload] = agreement(recs["on"], recs["off"]) if {"on", "off"} <= recs.keys() else None
    compare = comparisons(runs)
    print(f"model: {model_dir.name} ({cfg.architecture})  threads: {threads}  KV block {DEFAULT_BLOCK_SIZE} tokens")
    print(f"system-prompt: {args.system_tokens}-token system prompt + {args.questions} questions of "
          f"{args.question_tokens}; multi-turn: {args.conversations} conversations x {args.turns} turns; "
          f"{args.output_len} tokens out each, {args.concurrency} in flight\n")
    rows = []
    for s in (s for modes in runs.values() for s in modes.values()):
        p = s["prefix"]
        rows.append({**s, "hit_rate": p["hit_rate"], "sent": p["prompt_tokens_sent"],
                     "computed": p["prompt_tokens_computed"],
                     "computed_pct": None if p["computed_fraction"] is None else 100 * p["computed_fraction"],
                     "processed": p["executor_prompt_tokens_processed"], "other_cores": s["cpu"]["other_cores"],
                     "cores": cores_text(s["cpu"], ("executor", "scheduler", "client")),
                     "late_mean": (s["ttft_late_turns_ms"] or {}).get("mean"),
                     **{f"{m}_{st}": s[f"{m}_ms"][st] for m in ("ttft", "tpot", "e2el") for st in ("mean", "p99")}})
    print(format_table(rows, RUN_COLUMNS))
    print("\nms; hit rate: the executor's prefix-cache hit / query tokens (else usage.cached_tokens / prompt tokens); "
          "computed = sent - cached; executor prompt: prompt tokens the executor ran.\n")
    if compare:
        print(format_table(compare, [("workload", "workload"), ("metric", "metric"), ("off", "cache off", 3),
                                     ("on", "cache on", 3), ("ratio", "ratio / value", 3)]))
    for workload, a in agree.items():
        if a:
            print(f"{workload}: {a['identical']}/{a['compared']} requests generated the same tokens with the cache on "
                  f"and off")
    if bad:
        print(f"ERROR: {bad} requests failed or did not produce exactly the output length (see stderr)")
    config = {k: v for k, v in vars(args).items() if k != "out"} | {"threads": threads,
                                                                     "block_size": DEFAULT_BLOCK_SIZE}
    results = {"benchmark": "bench_prefix", "config": config, "machine": machine_info("cpu"),
               "model": model_json(model_dir, cfg), "runs": runs, "comparisons": compare,
               "agreement": agree, "all_exact_output_len": bad == 0}
    log(f"wrote {write_json(args.out, results)}")
    return 1 if bad else 0
