"""Speculative-decoding benchmark: n-gram drafts verified inside the batch (scheduler --speculative ngram) against
the same stack without them, on a copy-heavy and a plain chat workload, at several concurrencies.

Method: one executor (prefix caching off, so neither side finds the other's prompts cached) and two schedulers
driving it, one with --speculative off and one with --speculative ngram (plus --spec-args). Every (workload,
concurrency) cell runs its requests (closed loop, `concurrency` in flight) on each scheduler in turn, in
A B B A order over --rounds rounds, so drift on a shared machine hits both sides alike. Requests are chat
messages (benchmarks/spec_workloads.py), greedy, ending at EOS or --output-len tokens: speculation leaves
greedy output unchanged, so both sides generate the same tokens (checked, request by request).

Per cell and side: output tokens/s (tokens generated / wall time of the cell's requests), mean TTFT and
TPOT; for the speculative side the acceptance rate (accepted / drafted tokens) and the mean accepted tokens
per draft, from the scheduler's Prometheus counters (tandem:spec_decode_num_drafts / _num_draft_tokens /
_num_accepted_tokens) read before and after the cell. Targets (issue 14): copy-heavy at concurrency 1 >= 2x
output tokens/s with identical tokens; chat at every concurrency >= 0.95x.

Output: a table on stdout, JSON (--out, default bench_results/bench_spec.json: config, machine, model, every
cell's per-side figures and per-request records, targets).

    python scripts/bench_spec.py                                  # SmolLM2 fp32, copy + chat at 1, 4, 32
    python scripts/bench_spec.py --workloads copy --concurrency 8,16 --spec-args='--speculative-max-batch 64'
    python scripts/bench_spec.py --quick
"""
from __future__ import annotations

import asyncio
import shlex
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

from benchmarks import runtime
from benchmarks.cli import add_out_args, int_list, make_log, parse_with_preset, parser
from benchmarks.measure import summarize
from benchmarks.report import fmt, format_table, machine_info, model_json, write_json
from benchmarks.request_loops import closed_loop
from benchmarks.request_metrics import Record
from benchmarks.serving_client import chat
from benchmarks.spec_workloads import WORKLOADS, prompts
from tandem import server_process
from tandem.common.v1 import common_pb2 as cpb
from tandem.generate.v1 import generate_pb2 as gpb
from tandem.generate.v1 import generate_pb2_grpc as gpb_grpc

DEFAULTS = {"concurrency": "1,4,32", "output_len": 128, "rounds": 1, "workloads": "copy,chat"}
QUICK = {"concurrency": "1,2", "output_len": 16, "rounds": 1, "workloads": "copy,chat"}
SPEC_COUNTERS = ("tandem:spec_decode_num_drafts", "tandem:spec_decode_num_draft_tokens",
                 "tandem:spec_decode_num_accepted_tokens")
TARGETS = {("copy", 1): 2.0}  # (workload, concurrency) -> on/off tokens/s; every chat cell: CHAT_TARGET
CHAT_TARGET = 0.95

log = make_log("bench_spec")


def parse_args(argv: list[str] | None = None):
    ap = parser(__doc__, epilog="Method: see the module docstring (head -30 benchmarks/spec.py).")
    ap.add_argument("--model", type=Path, default=None,
                    help="HF model directory (default: SmolLM2-135M-Instruct via scripts/prepare_default_model.py)")
    ap.add_argument("--workloads", default=None, help=f"comma list of {', '.join(WORKLOADS)} (default both)")
    ap.add_argument("--concurrency", default=None, help="comma list of requests in flight (default 1,4,32)")
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per cell (default max(4, 2 x concurrency), at most 32)")
    ap.add_argument("--output-len", type=int, default=None, help="max_new_tokens of each request (default 128)")
    ap.add_argument("--rounds", type=int, default=None, help="A B B A rounds per cell (default 1: off then on)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the executor (default: all cores)")
    ap.add_argument("--spec-args", default="--speculative ngram",
                    help="the speculative scheduler's flags, one shell-quoted string given with '=' (default "
                         "'--speculative ngram': the scheduler's defaults for the rest)")
    ap.add_argument("--executor-args", default="", help="extra executor flags, one string given with '='")
    add_out_args(ap, "bench_spec", "smoke run: concurrency 1,2, 16 tokens")
    args = parse_with_preset(ap, argv, QUICK, DEFAULTS)
    args.concurrency_list = int_list(args.concurrency, "--concurrency")
    args.workload_list = [w for w in args.workloads.split(",") if w]
    if not args.workload_list or any(w not in WORKLOADS for w in args.workload_list):
        ap.error(f"--workloads: a comma list of {', '.join(WORKLOADS)}")
    if args.output_len < 1 or args.rounds < 1 or (args.requests is not None and args.requests < 1):
        ap.error("--output-len, --rounds and --requests must be >= 1")
    return args


def requests_for(args, concurrency: int) -> int:
    return args.requests or min(32, max(4, 2 * concurrency))


def spec_counters(http_url: str) -> dict[str, float]:
    """The scheduler's speculative-decoding counters from its /metrics."""
    with urllib.request.urlopen(f"{http_url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out = dict.fromkeys(SPEC_COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        if family.name in out:
            out[family.name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return out


async def send(stub, rec: Record, prompt: str, output_len: int, timeout: float) -> None:
    req = gpb.GenerateRequest(request_id=f"spec-{rec.index}", messages=chat(prompt), sampling=cpb.SamplingParams(),
                              stopping=gpb.StoppingCriteria(max_new_tokens=output_len))
    rec.start = time.perf_counter()
    try:
        async for msg in stub.Generate(req, timeout=timeout):
            if msg.token_ids:
                rec.messages.append((time.perf_counter(), len(msg.token_ids)))
                rec.output_ids.extend(msg.token_ids)
            if msg.HasField("usage"):
                u = msg.usage
                rec.usage = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                             "drafted_tokens": u.drafted_tokens, "accepted_tokens": u.accepted_tokens}
                rec.finish_reason = gpb.FinishReason.Name(msg.finish_reason)
    except grpc.aio.AioRpcError as exc:
        rec.error = f"{exc.code().name}: {exc.details()}"
    rec.end = time.perf_counter()


async def run_cell(address: str, texts: list[str], concurrency: int, output_len: int) -> tuple[list[Record], float]:
    records = [Record(i, 0) for i in range(len(texts))]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gpb_grpc.GenerateServiceStub(channel)
        t0 = time.perf_counter()
        await closed_loop(len(texts), concurrency, lambda i: send(stub, records[i], texts[i], output_len, 600.0))
        return records, time.perf_counter() - t0


def side_summary(records: list[Record], wall: float) -> dict[str, Any]:
    tokens = sum(len(r.output_ids) for r in records)
    ms = [r.metrics() for r in records]
    return {"requests": len(records), "output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_ms": summarize([m["ttft"] * 1e3 for m in ms if m["ttft"] is not None]),
            "tpot_ms": summarize([m["tpot"] * 1e3 for m in ms if m["tpot"] is not None]),
            "errors": [r.error for r in records if r.error]}


def measure(args, servers: dict[str, server_process.ServerProcess], workload: str, concurrency: int) -> dict:
    texts = prompts(workload, requests_for(args, concurrency))
    order = [m for r in range(args.rounds) for m in (("off", "on") if r % 2 == 0 else ("on", "off"))]
    walls: dict[str, float] = {"off": 0.0, "on": 0.0}
    records: dict[str, list[list[Record]]] = {"off": [], "on": []}
    spec_delta = dict.fromkeys(SPEC_COUNTERS, 0.0)
    for mode in order:
        before = spec_counters(servers[mode].http_url) if mode == "on" else None
        recs, wall = asyncio.run(run_cell(servers[mode].address, texts, concurrency, args.output_len))
        if before is not None:
            after = spec_counters(servers[mode].http_url)
            for k in spec_delta:
                spec_delta[k] += after[k] - before[k]
        walls[mode] += wall
        records[mode].append(recs)
        log(f"{workload} c={concurrency} {mode}: {sum(len(r.output_ids) for r in recs)} tokens in {wall:.1f}s")
    sides = {m: side_summary([r for rs in records[m] for r in rs], walls[m]) for m in ("off", "on")}
    identical = sum(a.output_ids == b.output_ids for ra, rb in zip(records["off"], records["on"])
                    for a, b in zip(ra, rb))
    drafts, drafted, accepted = (spec_delta[k] for k in SPEC_COUNTERS)
    ratio = sides["on"]["tokens_per_s"] / sides["off"]["tokens_per_s"]
    target = CHAT_TARGET if workload == "chat" else TARGETS.get((workload, concurrency))
    return {"workload": workload, "concurrency": concurrency, "requests": len(texts), "sides": sides,
            "ratio": ratio, "identical": identical, "compared": len(texts) * args.rounds,
            "drafts": drafts, "drafted_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_per_draft": accepted / drafts if drafts else None,
            "target": target, "met": None if target is None else bool(ratio >= target and
                                                                       identical == len(texts) * args.rounds),
            "records": {m: [[r.as_json(r.start) | {"output_ids": r.output_ids} for r in rs] for rs in records[m]]
                        for m in records}}


def print_table(header: str, cells: list[dict]) -> None:
    print(header)
    rows = [{"workload": c["workload"], "conc": c["concurrency"], "req": c["requests"],
             "off tok/s": fmt(c["sides"]["off"]["tokens_per_s"], 1), "on tok/s": fmt(c["sides"]["on"]["tokens_per_s"], 1),
             "on/off": f"{c['ratio']:.2f}x", "identical": f"{c['identical']}/{c['compared']}",
             "accept": "-" if c["acceptance_rate"] is None else f"{100 * c['acceptance_rate']:.0f}%",
             "acc/draft": fmt(c["mean_accepted_per_draft"], 2),
             "TPOT off/on ms": f"{fmt(c['sides']['off']['tpot_ms'].get('mean'), 1)} / "
                               f"{fmt(c['sides']['on']['tpot_ms'].get('mean'), 1)}",
             "target": "-" if c["target"] is None else f">= {c['target']}x: {'met' if c['met'] else 'NOT met'}"}
            for c in cells]
    print(format_table(rows, [(k, k) for k in rows[0]]))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads, model_dir, cfg = runtime.serving_setup(args)
    servers: dict[str, server_process.ServerProcess] = {}
    try:
        servers["executor"] = server_process.launch_executor(
            model_dir, "--threads", str(threads), "--no-prefix-caching", "--kv-blocks", "2048", "--log-level",
            "WARNING", *shlex.split(args.executor_args))
        address = servers["executor"].address
        servers["off"] = server_process.launch_scheduler(address, "--http-port", "0", "--log-level", "WARNING",
                                                          "--speculative", "off")
        servers["on"] = server_process.launch_scheduler(address, "--http-port", "0", "--log-level", "WARNING",
                                                         *shlex.split(args.spec_args))
        log(f"model {model_dir.name}; {threads} threads; speculative side: {args.spec_args}")
        for mode in ("off", "on"):  # warm-up: first-call costs out of the timed cells
            asyncio.run(run_cell(servers[mode].address, prompts("chat", 1), 1, 8))
        cells = [measure(args, servers, w, c) for w in args.workload_list for c in args.concurrency_list]
    finally:
        for s in servers.values():
            s.stop()
    header = (f"model: {model_dir.name} ({cfg.architecture}), executor {threads} threads, greedy, max {args.output_len} "
              f"new tokens; speculative: {args.spec_args}; rounds {args.rounds}")
    print_table(header, cells)
    config = {k: getattr(args, k) for k in ("workloads", "concurrency", "requests", "output_len", "rounds",
                                            "spec_args", "executor_args", "quick")}
    config.update(model=str(model_dir), threads=threads)
    path = write_json(args.out, {"benchmark": "bench_spec", "config": config, "machine": machine_info("cpu"),
                                 "model": model_json(model_dir, cfg), "cells": cells})
    log(f"wrote {path}")
    errors = [e for c in cells for side in c["sides"].values() for e in side["errors"]]
    if errors:
        log(f"{len(errors)} requests failed; first: {errors[0]}")
    return 1 if errors else 0
