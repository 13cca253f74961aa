"""Fleet benchmark: one scheduler over several executors as a client sees it: (1) scaling, the same workload on
one executor with T threads and on N executors sharing the cores (--configs EXECUTORSxTHREADS); (2) failover, long
streams during which one executor is SIGKILLed, against a clean run of the same streams. See docs/benchmarks.md."""
from __future__ import annotations

import argparse
import asyncio
import os
import shlex
from pathlib import Path
from typing import Any

import grpc

from benchmarks import executor_metrics
from benchmarks.cli import (add_process_args, add_sizes, choices, has_flag, make_log, parse, parser,
                            serving_setup)
from benchmarks.fleet_failover import Fleet, analyse, failover_run, stream
from benchmarks.measure import CpuMeter
from benchmarks.openai_client import closed_loop
from benchmarks.report import format_table, machine_info, model_json, table, write_json
from benchmarks.request_metrics import Record, agreement, aggregate, exact
from benchmarks.workloads import kv_blocks, model_vocabulary, vocabulary_prompts
from tandem.generate.v1 import generate_pb2_grpc as gpb_grpc

PARTS = ("scaling", "failover")
DEFAULTS = {"configs": "1x2,2x1", "num_requests": 32, "input_len": 128, "output_len": 64, "concurrency": 32,
            "warmup": 2, "failover_streams": 16, "failover_input_len": 128, "failover_output_len": 128,
            "kill_after_tokens": 8}
# the tiny model decodes in milliseconds: long streams keep the kill inside them
QUICK = {"configs": "1x2,2x1", "num_requests": 8, "input_len": 16, "output_len": 8, "concurrency": 8, "warmup": 1,
         "failover_streams": 4, "failover_input_len": 16, "failover_output_len": 128, "kill_after_tokens": 2}
METRICS = [("request_throughput", "req/s", 3), ("output_throughput", "out tok/s", 1), ("ttft_p50", "TTFT p50 ms", 0),
           ("ttft_p99", "TTFT p99 ms", 0), ("tpot_p50", "TPOT p50 ms", 1), ("tpot_p99", "TPOT p99 ms", 1)]
log = make_log("bench_fleet")


def start(args, model_dir: Path, n: int, threads: int, flags: list[str]) -> Fleet:
    fleet = Fleet(model_dir, [["--threads", str(threads), *flags]] * n, shlex.split(args.scheduler_args))
    log(f"{n} executor(s) x {threads} thread(s) and scheduler {fleet.address} ready in {fleet.startup_s:.1f}s")
    return fleet


async def closed(fleet: Fleet, prompts: list[list[int]], output_len: int, concurrency: int, timeout: float
                 ) -> list[Record]:
    records = [Record(i, len(p)) for i, p in enumerate(prompts)]
    async with grpc.aio.insecure_channel(fleet.address) as channel:
        stub = gpb_grpc.GenerateServiceStub(channel)
        await closed_loop(len(prompts), concurrency,
                          lambda i: stream(stub, records[i], prompts[i], output_len, timeout))
    if any(r.error for r in records):
        raise RuntimeError(f"a request failed: {next(r.error for r in records if r.error)}")
    return records


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = parser("fleet", __doc__,
                "scaling 8 x (16 in, 8 out); failover 4 streams x (16 in, 128 out) killed after 2 tokens", threads=False)
    ap.add_argument("--parts", default=",".join(PARTS), help="comma list of scaling, failover (default both)")
    add_sizes(ap, DEFAULTS, {"configs": "scaling: EXECUTORSxTHREADS comma list, ratios against the first",
                             "num-requests": "scaling: timed requests", "input-len": "scaling: prompt tokens",
                             "output-len": "scaling: generated tokens, exactly", "concurrency": "scaling: in flight",
                             "warmup": "untimed requests before each timed run",
                             "failover-streams": "failover: concurrent streams",
                             "failover-input-len": "failover: prompt tokens",
                             "failover-output-len": "failover: generated tokens per stream, exactly",
                             "kill-after-tokens": "failover: kill once every stream has this many tokens"})
    ap.add_argument("--failover-executors", type=int, default=2, help="failover: executors (default 2)")
    ap.add_argument("--failover-threads", type=int, default=1, help="failover: threads per executor (default 1)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    add_process_args(ap)
    args = parse(ap, argv, QUICK, DEFAULTS)
    args.part_list = choices(args.parts, PARTS, "--parts")
    try:
        args.config_list = [tuple(int(x) for x in c.lower().split("x")) for c in args.configs.split(",") if c.strip()]
    except ValueError:
        ap.error(f"--configs: expected EXECUTORSxTHREADS items such as 2x1, got {args.configs!r}")
    if not args.config_list or any(len(c) != 2 or min(c) < 1 for c in args.config_list):
        ap.error("--configs: EXECUTORSxTHREADS items, both >= 1")
    if args.kill_after_tokens >= args.failover_output_len or args.failover_executors < 2:
        ap.error("--kill-after-tokens must be below --failover-output-len; --failover-executors >= 2")
    if has_flag(shlex.split(args.executor_args), "--threads", "--kv-blocks", "--kv-memory-fraction"):
        ap.error("--executor-args: threads come from --configs / --failover-threads, the KV pool from the workload")
    return args


def flat(side: dict[str, Any]) -> dict[str, Any]:
    return {k: side[k] for k in ("name", "completed", "duration_s", "request_throughput", "output_throughput")} | {
        f"{m}_{s}": side[f"{m}_ms"][s] for m in ("ttft", "tpot", "e2el") for s in ("p50", "p99")}


def scaling(args, model_dir: Path, flags: list[str], clean_prompts: list[list[int]] | None, allowed: Any
            ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Each configuration on fresh servers; the failover's clean run on the configuration of its shape after that
    one's timed run (a fleet launch saved)."""
    prompts = vocabulary_prompts(args.num_requests, args.input_len, allowed, args.seed, stream=0)
    warm = vocabulary_prompts(args.warmup, args.input_len, allowed, args.seed, stream=1)
    sides, clean = {}, None
    for n, threads in args.config_list:
        fleet = start(args, model_dir, n, threads, flags)
        try:
            if warm:
                asyncio.run(closed(fleet, warm, args.output_len, len(warm), args.request_timeout))
            before, meter = [executor_metrics.snapshot(a) for a in fleet.executor_addresses], CpuMeter(fleet.pids())
            meter.start()
            records = asyncio.run(closed(fleet, prompts, args.output_len, args.concurrency, args.request_timeout))
            cpu = meter.stop()
            work = [executor_metrics.work(b, executor_metrics.snapshot(a), cpu["wall_s"])
                    for b, a in zip(before, fleet.executor_addresses)]
            if clean_prompts and (n, threads) == (args.failover_executors, args.failover_threads):
                clean = asyncio.run(failover_run(fleet, clean_prompts, args.failover_output_len, args.kill_after_tokens,
                                                 args.request_timeout, kill=False))
        finally:
            codes = fleet.stop()
        name = f"{n}x{threads}"
        sides[name] = aggregate(name, records, output_len=args.output_len) | {
            "executors": n, "threads": threads, "cpu": cpu, "executor_work": work, "exit_codes": codes}
        log(f"{name}: {len(records)} requests in {sides[name]['duration_s']:.2f}s; per executor "
            f"{'/'.join(str(w['requests']) for w in work)}")
    base = flat(next(iter(sides.values())))
    ratios = {name: {k: (flat(s)[k] / base[k] if flat(s)[k] is not None and base[k] else None)
                     for k in [m[0] for m in METRICS] + ["duration_s"]} for name, s in list(sides.items())[1:]}
    exact_all = all(s["failed"] == 0 and s["exact_output_len"] == s["requests"] for s in sides.values())
    return {"runs": sides, "ratios": ratios, "baseline": base["name"], "all_exact_output_len": exact_all}, clean


def print_scaling(s: dict[str, Any]) -> None:
    rows = [flat(side) | {"requests_each": "/".join(str(w["requests"]) for w in side["executor_work"]),
                          "busy": "/".join(f"{100 * (w['busy_share'] or 0):.0f}" for w in side["executor_work"]),
                          "other_cores": side["cpu"]["other_cores"]} for side in s["runs"].values()]
    print(format_table(rows, [("name", "config"), ("completed", "done"), ("duration_s", "duration s")] + METRICS
                       + [("requests_each", "requests each"), ("busy", "busy %"), ("other_cores", "other cores")]))
    if s["ratios"]:
        print()
        print(format_table([{"name": f"{n} / {s['baseline']}", **r} for n, r in s["ratios"].items()],
                           [("name", "ratio"), ("duration_s", "duration")] + [(k, h, 2) for k, h, _ in METRICS]))
    print("\nratio: the configuration's value / the first's (throughput: > 1 is better; TTFT, TPOT: < 1 is better); "
          "requests each: routed to each executor; busy %: share of the run each executor's model was busy.\n")


def print_failover(f: dict[str, Any]) -> None:
    if not f["killed"]:
        print("ERROR: no kill happened (every stream ended first): nothing was measured\n")
        return
    k, s = f["kill"], f["summary"]
    print(f"failover: killed executor-{k['index']} ({k['address']}); running per executor then: {k['running']}; "
          f"tokens streamed by then: {k['tokens_streamed_before']}")
    dist = lambda d: "-" if not d["n"] else f"{d['p50']:.0f} / {d['max']:.0f}"  # noqa: E731
    print(table([{"streams": g, "n": s[g]["streams"], "paused": s[g]["paused"], "completed": s[g]["completed"],
                  "largest gap after kill p50/max ms": dist(s[g]["pause_ms"]),
                  "kill->next token ms": dist(s[g]["next_token_after_kill_ms"]),
                  "kill->resume ms": dist(s[g]["resume_after_kill_ms"]),
                  "tokens recomputed": s[g]["recomputed_tokens"]} for g in ("moved", "stayed")]))
    print(f"\ntokens recomputed {s['recomputed_tokens']} (prompts {s['recomputed_prompt_tokens']})\n")
    agree = f["agreement_with_clean"] or {"identical": 0, "compared": 0}
    print(f"\nevery stream completed with exactly {f['output_len']} tokens: {'yes' if f['all_completed'] else 'NO'}; "
          f"tokens identical to the clean run (greedy): {agree['identical']}/{agree['compared']}; failover / clean "
          f"duration {f['ratios']['duration_s']:.2f}x\n")


def failover(args, model_dir: Path, flags: list[str], prompts: list[list[int]], clean: dict[str, Any] | None,
             allowed: Any) -> dict[str, Any]:
    """The failover run on a fresh fleet (and the clean run on another, unless scaling hosted it)."""
    runs, warm = {}, vocabulary_prompts(args.warmup, args.failover_input_len, allowed, args.seed, stream=4)
    for name in (["clean"] if clean is None else []) + ["failover"]:
        fleet = start(args, model_dir, args.failover_executors, args.failover_threads, flags)
        try:
            if warm:
                asyncio.run(closed(fleet, warm, args.failover_output_len, len(warm), args.request_timeout))
            run = asyncio.run(failover_run(fleet, prompts, args.failover_output_len, args.kill_after_tokens,
                                           args.request_timeout, kill=name == "failover"))
        finally:
            codes = fleet.stop()
        runs[name] = run | {"exit_codes": codes}
    clean = clean or runs["clean"]
    run, out_len = runs["failover"], args.failover_output_len
    view = analyse(run, out_len) if run["kill"] else {}
    by_index = {r.index: r.output_ids for r in clean["records"]}
    agree = agreement(run["records"], clean["records"])
    sides = {n: aggregate(n, r["records"], output_len=out_len) for n, r in (("clean", clean), ("failover", run))}
    kill = None if not run["kill"] else {k: v for k, v in run["kill"].items() if k != "t"}
    return {"streams": len(prompts), "output_len": out_len, "killed": kill is not None, "kill": kill,
            "summary": {k: v for k, v in view.items() if k != "streams"},
            "per_stream": [v | {"identical_to_clean": run["records"][v["index"]].output_ids == by_index.get(v["index"])}
                           for v in view.get("streams", [])],
            "all_completed": all(exact(r, out_len) for r in run["records"]),
            "clean_all_completed": all(exact(r, out_len) for r in clean["records"]), "agreement_with_clean": agree,
            "identical_to_clean": bool(agree) and agree["identical"] == agree["compared"] == len(prompts),
            "executor_states_after": run["states_after"], "exit_codes": run["exit_codes"],
            "clean_on_scaling_fleet": "clean" not in runs,
            "ratios": {"duration_s": sides["failover"]["duration_s"] / sides["clean"]["duration_s"]}, "runs": sides}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _, model_dir, cfg = serving_setup(args)
    if max(args.input_len + args.output_len, args.failover_input_len + args.failover_output_len) > \
            cfg.max_position_embeddings:
        raise SystemExit(f"error: a request is past the model's {cfg.max_position_embeddings} positions")
    allowed = model_vocabulary(model_dir, cfg)
    # every pool holds what any run puts on one executor (the survivor of a failover takes every stream)
    sequences = max(args.concurrency, args.failover_streams) + max(args.warmup, 1)
    user = shlex.split(args.executor_args)
    flags = ["--kv-blocks", str(kv_blocks(sequences, max(args.input_len + args.output_len, args.failover_input_len
                                                         + args.failover_output_len)))] + \
        ([] if has_flag(user, "--log-level") else ["--log-level", "WARNING"]) + user
    f_prompts = vocabulary_prompts(args.failover_streams, args.failover_input_len, allowed, args.seed, stream=3)
    results: dict[str, Any] = {"benchmark": "bench_fleet", "machine": machine_info("cpu"),
                               "model": model_json(model_dir, cfg),
                               "config": {k: v for k, v in vars(args).items() if k != "out"}}
    print(f"model: {model_dir.name} ({cfg.architecture})  machine: {os.cpu_count()} CPUs\n")
    ok, clean = True, None
    if "scaling" in args.part_list:
        print(f"scaling: {args.num_requests} requests x ({args.input_len} prompt, {args.output_len} output tokens), "
              f"{args.concurrency} in flight\n")
        results["scaling"], clean = scaling(args, model_dir, flags, f_prompts if "failover" in args.part_list else None,
                                            allowed)
        print_scaling(results["scaling"])
        ok &= results["scaling"]["all_exact_output_len"]
    if "failover" in args.part_list:
        f = results["failover"] = failover(args, model_dir, flags, f_prompts, clean, allowed)
        print_failover(f)
        ok &= f["killed"] and f["all_completed"] and f["clean_all_completed"]
    results["ok"] = bool(ok)
    log(f"wrote {write_json(args.out, results)}")
    return 0 if ok else 1
