"""Executors sharing a host: the same decode work on one executor with every core vs two executors with half
each (pinned with --cpu-cores, or not) vs two executors each as wide as the machine; aggregate decode tokens/s
and the executors' CPU time. Method: docs/benchmarks.md.

Each layout starts its executors (READY), prefills `streams` random prompts split evenly over them, then every
executor decodes its share as one batch in Decode calls of --burst steps (the scheduler's multi-step decode),
all executors at once from one client thread each, --steps tokens per sequence; greedy, no stop tokens.
Tokens/s = every executor's tokens / the wall time until the last one finished."""
from __future__ import annotations

import argparse
import os
import shlex
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from benchmarks.cli import add_sizes, choices, int_list, make_log, model_dir, parse, parser
from benchmarks.measure import process_cpu_s
from benchmarks.report import format_table, machine_info, write_json
from benchmarks.workloads import random_prompts
from executor_service.cpu_cores import parse_cores
from tandem import server_process
from tandem.executor.v1 import executor_pb2 as pb
from tandem.executor.v1 import executor_pb2_grpc as pb_grpc

LAYOUTS = ("1xN", "2xhalf-pinned", "2xhalf", "2xN")
LAYOUT_HELP = {"1xN": "one executor, --threads = every core", "2xhalf-pinned": "two, each --cpu-cores its half",
               "2xhalf": "two, each --threads half, unpinned", "2xN": "two, each --threads every core (oversubscribed)"}
QUICK = {"streams": "2", "steps": 16, "burst": 4, "prompt_len": 16}
DEFAULTS = {"streams": "2,8", "steps": 128, "burst": 8, "prompt_len": 64}
RPC_TIMEOUT_S = 600.0
COLUMNS = [("layout", "layout"), ("executors", "executors"), ("threads", "threads each"), ("cores", "cores"),
           ("streams", "streams"), ("tokens", "tokens"), ("wall_s", "wall s"), ("tok_s", "tok/s", 1),
           ("vs_1xN", "vs 1xN"), ("cpu_s", "executor CPU s", 1), ("cpu_per_token_ms", "CPU ms/token", 2)]
log = make_log("bench_host_sharing")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = parser("host_sharing", __doc__, "2 streams, 16 steps in bursts of 4, 16-token prompts", threads=False)
    ap.add_argument("--layouts", default=",".join(LAYOUTS),
                    help="comma list of " + "; ".join(f"{k}: {v}" for k, v in LAYOUT_HELP.items()) + " (default all)")
    ap.add_argument("--cores", default=None,
                    help="the cores to share, Linux cpuset syntax (default: every core this process may use; an even "
                         "count)")
    ap.add_argument("--streams", default=None, help="comma list of sequences decoding at once, over all executors "
                                                    f"(default {DEFAULTS['streams']})")
    add_sizes(ap, DEFAULTS, {"steps": "tokens decoded per sequence", "burst": "steps per Decode call",
                             "prompt-len": "tokens of each random prompt"})
    ap.add_argument("--executor-args", default="", help="more executor flags for every executor, one quoted string")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    args = parse(ap, argv, QUICK, DEFAULTS)
    args.layout_list = choices(args.layouts, LAYOUTS, "--layouts")
    args.stream_list = int_list(args.streams, "--streams")
    args.core_list = parse_cores(args.cores) if args.cores else tuple(sorted(os.sched_getaffinity(0)))
    if len(args.core_list) % 2 or any(s % 2 for s in args.stream_list):
        ap.error("--cores: an even number of cores, and --streams even counts (split over two executors)")
    if args.steps < 1 or args.burst < 1 or args.prompt_len < 1:
        ap.error("--steps, --burst and --prompt-len must be >= 1")
    return args


def executor_flags(layout: str, cores: tuple[int, ...]) -> list[list[str]]:
    """The flags of each executor of a layout."""
    n, half = len(cores), len(cores) // 2
    if layout == "1xN":
        return [["--threads", str(n)]]
    if layout == "2xhalf-pinned":
        return [["--cpu-cores", ",".join(map(str, part))] for part in (cores[:half], cores[half:])]
    if layout == "2xhalf":
        return [["--threads", str(half)]] * 2
    return [["--threads", str(n)]] * 2  # 2xN


def decode_share(stub: Any, prompts: list[list[int]], steps: int, burst: int, start: threading.Barrier,
                 out: dict[str, Any]) -> None:
    """Prefills its prompts and decodes one step (warm-up), waits for the others, then decodes them as one
    batch; out: tokens, seconds."""
    items = []
    for p in prompts:
        r = stub.Prefill(pb.PrefillRequest(token_ids=p), timeout=RPC_TIMEOUT_S)
        items.append(pb.DecodeItem(cache=r.cache, token_id=r.output.tokens[0].token_id))
    warm = stub.Decode(pb.DecodeRequest(items=items, num_steps=1), timeout=RPC_TIMEOUT_S).results  # (untimed)
    items = [pb.DecodeItem(cache=r.cache, token_id=r.output.tokens[-1].token_id) for r in warm]
    start.wait()
    t0, tokens, done = time.monotonic(), 0, 0
    while done < steps:
        n = min(burst, steps - done)
        results = stub.Decode(pb.DecodeRequest(items=items, num_steps=n), timeout=RPC_TIMEOUT_S).results
        for r in results:
            if r.status.code:
                raise RuntimeError(f"a decode failed: {r.status.message}")
        tokens += sum(len(r.output.tokens) for r in results)
        items = [pb.DecodeItem(cache=r.cache, token_id=r.output.tokens[-1].token_id) for r in results]
        done += n
    out["seconds"], out["tokens"] = time.monotonic() - t0, tokens
    stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[i.cache.cache_id for i in items]), timeout=RPC_TIMEOUT_S)


def run_layout(args: argparse.Namespace, model: Path, layout: str, streams: int, vocab: list[int]) -> dict[str, Any]:
    flags = executor_flags(layout, args.core_list)
    extra = shlex.split(args.executor_args)
    servers = []
    try:
        for f in flags:
            servers.append(server_process.launch_executor(model, *f, *extra))
        channels = [grpc.insecure_channel(s.address) for s in servers]
        stubs = [pb_grpc.ExecutorServiceStub(c) for c in channels]
        if not vocab:
            vocab.append(stubs[0].GetInfo(pb.GetInfoRequest()).vocab_size)
        prompts = random_prompts(streams, args.prompt_len, vocab[0], args.seed).tolist()
        per = streams // len(servers)
        start = threading.Barrier(len(servers) + 1)
        outs: list[dict[str, Any]] = [{} for _ in servers]
        threads = [threading.Thread(target=decode_share, args=(stub, prompts[i * per:(i + 1) * per], args.steps,
                                                               args.burst, start, outs[i]), daemon=True)
                   for i, stub in enumerate(stubs)]
        for t in threads:
            t.start()
        start.wait()
        cpu0 = [process_cpu_s(s.proc.pid) or 0.0 for s in servers]
        t0 = time.monotonic()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        cpu = sum((process_cpu_s(s.proc.pid) or 0.0) - c for s, c in zip(servers, cpu0))
        if any("tokens" not in o for o in outs):
            raise RuntimeError(f"{layout}: an executor's decode loop failed (see above)")
        tokens = sum(o["tokens"] for o in outs)
        for c in channels:
            c.close()
        threads_each = flags[0][1].count(",") + 1 if flags[0][0] == "--cpu-cores" else int(flags[0][1])
        return {"layout": layout, "executors": len(servers), "threads": threads_each,
                "cores": ",".join(map(str, args.core_list)), "streams": streams, "tokens": tokens,
                "wall_s": round(wall, 2), "tok_s": tokens / wall, "cpu_s": cpu, "cpu_per_token_ms": 1000 * cpu / tokens,
                "per_executor_s": [round(o["seconds"], 2) for o in outs]}
    finally:
        for s in servers:
            s.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = model_dir(args.model)
    rows: list[dict[str, Any]] = []
    vocab: list[int] = []
    for streams in args.stream_list:
        base = None
        for layout in args.layout_list:
            log(f"{layout}, {streams} streams...")
            row = run_layout(args, model, layout, streams, vocab)
            base = row["tok_s"] if layout == "1xN" else base
            row["vs_1xN"] = f"{row['tok_s'] / base:.2f}x" if base else "-"
            log(f"{layout}, {streams} streams: {row['tok_s']:.1f} tok/s")
            rows.append(row)
    print(f"model: {model.name}; cores {','.join(map(str, args.core_list))}; {args.steps} tokens per sequence in "
          f"Decode calls of {args.burst} steps; {args.prompt_len}-token prompts")
    print(format_table(rows, COLUMNS))
    path = write_json(args.out, {"benchmark": "host_sharing", "machine": machine_info(), "args": {
        k: v for k, v in vars(args).items() if k not in ("layout_list", "stream_list")} | {"model": str(model)},
        "rows": rows})
    log(f"wrote {path}")
    return 0
