"""KV disk tier across an executor restart: time to first token of a long prompt on a restarted executor whose
disk tier holds the prompt's blocks (written by the clean stop's flush), vs a prompt it never saw; the tier's read
bandwidth and the stop's flush time. Method: docs/benchmarks.md ('kv_restart')."""
from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from benchmarks.cli import add_sizes, make_log, model_dir, parse, parser, stop_on_sigterm
from benchmarks.openai_client import counters, metrics_url
from benchmarks.report import format_table, machine_info, write_json
from benchmarks.workloads import random_prompts
from tandem import server_process
from tandem.executor.v1 import executor_pb2 as pb
from tandem.executor.v1 import executor_pb2_grpc as pb_grpc

QUICK = {"prompt_len": 256, "repeats": 1}
DEFAULTS = {"prompt_len": 1200, "repeats": 3}
RPC_TIMEOUT_S = 600.0
COLUMNS = [("case", "case"), ("runs", "runs"), ("cached_tokens", "cached tokens"), ("ttft_ms", "TTFT ms", 0),
           ("ttft_min_ms", "min ms", 0), ("vs_cold", "vs cold")]
log = make_log("bench_kv_restart")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = parser("kv_restart", __doc__, "a 256-token prompt, one run per case")
    add_sizes(ap, DEFAULTS, {"prompt-len": "tokens of the long prompt (default 1200)",
                             "repeats": "restarts, each timing one warm and one cold prompt"})
    ap.add_argument("--executor-args", default="", help="more executor flags, quoted")
    args = parse(ap, argv, QUICK, DEFAULTS)
    if args.prompt_len < 32 or args.repeats < 1:
        ap.error("--prompt-len >= 32 and --repeats >= 1")
    return args


def ttft(stub: pb_grpc.ExecutorServiceStub, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first token, tokens found cached): CreateCache (the prefix cache and its tiers), then the
    Prefill of what is left; the cache is released."""
    t = time.perf_counter()
    made = stub.CreateCache(pb.CreateCacheRequest(items=[pb.CreateCacheItem(token_ids=prompt)]),
                            timeout=RPC_TIMEOUT_S).results[0]
    stub.Prefill(pb.PrefillRequest(token_ids=prompt[made.cached_tokens:], cache_id=made.cache.cache_id),
                 timeout=RPC_TIMEOUT_S)
    seconds = time.perf_counter() - t
    stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[made.cache.cache_id]), timeout=RPC_TIMEOUT_S)
    return seconds, made.cached_tokens


READS = ("tandem:executor_kv_tier_read_bytes_total", "tandem:executor_kv_tier_read_seconds_total")
FLUSHED = re.compile(r"(\d+) KV blocks written to the disk tier in ([\d.]+)s")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()
    directory = model_dir(args.model).resolve()
    config = json.loads((directory / "config.json").read_text())
    vocab, bs = int(config["vocab_size"]), 16
    blocks = -(-args.prompt_len // bs)
    pool = blocks + blocks // 4 + 2  # one long prompt and a bit: the stop's flush writes its blocks from the pool
    # per restart: a (cached before it), c (cold after it)
    prompts = [p.tolist() for p in random_prompts(2 * args.repeats, args.prompt_len, vocab, seed=0)]
    first = random_prompts(1, 2 * bs, vocab, seed=1)[0].tolist()  # a short untimed first request
    cold, warm, reads, flushes = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="kv-restart-") as tmp:
        flags = ["--kv-blocks", str(pool), "--kv-disk-dir", str(Path(tmp) / "tier"), "--kv-disk-gb", "8",
                 "--metrics-port", "0", *args.executor_args.split()]
        if args.threads:
            flags += ["--threads", str(args.threads)]
        for r in range(args.repeats):
            a, c = prompts[2 * r:2 * r + 2]
            server = server_process.launch_executor(directory, *flags)
            try:  # before the restart: a's blocks reach the disk tier (the stop's flush)
                ttft(pb_grpc.ExecutorServiceStub(grpc.insecure_channel(server.address)), a)
                server.send_signal()
                server.wait_exit()
                flushed = FLUSHED.search(server.log())
                if flushed:
                    flushes.append((int(flushed.group(1)), float(flushed.group(2))))
                    log(f"run {r}: the stop wrote {flushes[-1][0]} blocks in {flushes[-1][1]:.2f} s; restarted")
            finally:
                server.stop()
            server = server_process.launch_executor(directory, *flags)
            try:
                stub = pb_grpc.ExecutorServiceStub(grpc.insecure_channel(server.address))
                ttft(stub, first)  # the first request after a start pays one-time costs: not timed
                seconds, cached = ttft(stub, a)
                warm.append((seconds, cached))
                seconds, cached = ttft(stub, c)
                cold.append((seconds, cached))
                reads.append(tuple(counters(metrics_url(server), READS).values()))
                log(f"run {r}: warm {1e3 * warm[-1][0]:.0f} ms ({warm[-1][1]} cached), cold {1e3 * seconds:.0f} ms")
            finally:
                server.stop()
    cold_ms = statistics.median(1e3 * s for s, _ in cold)
    rows: list[dict[str, Any]] = []
    for case, runs in (("cold (after a restart)", cold), ("disk tier (after a restart)", warm)):
        ms = statistics.median(1e3 * s for s, _ in runs)
        rows.append({"case": case, "runs": len(runs), "cached_tokens": runs[0][1], "ttft_ms": ms,
                     "ttft_min_ms": min(1e3 * s for s, _ in runs), "vs_cold": ms / cold_ms})
    read_bytes, read_s = sum(b for b, _ in reads), sum(s for _, s in reads)
    mb_s = read_bytes / read_s / 1e6 if read_s else None
    print(format_table(rows, COLUMNS))
    print(f"\ndisk tier reads: {read_bytes / 1e6:.1f} MB in {read_s:.3f} s = "
          f"{'-' if mb_s is None else f'{mb_s:.0f}'} MB/s (files read and CRC-checked; page cache warm)")
    flush_s = statistics.median(s for _, s in flushes) if flushes else None
    if flushes:
        print(f"stop's flush of the pool: {flushes[0][0]} blocks in {flush_s:.2f} s (median of {len(flushes)})")
    out = write_json(args.out, {"benchmark": "bench_kv_restart", "machine": machine_info("cpu"),
                                "config": {"model": directory.name, "prompt_len": args.prompt_len,
                                           "repeats": args.repeats, "kv_blocks": pool,
                                           "executor_args": args.executor_args},
                                "rows": rows, "disk_read_bytes": read_bytes, "disk_read_seconds": read_s,
                                "disk_read_mb_s": mb_s, "flush_blocks": flushes[0][0] if flushes else None,
                                "flush_seconds": flush_s})
    log(f"wrote {out}")
    return 0
