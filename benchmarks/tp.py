"""Tensor parallelism: decode-step and prefill time, and each rank's resident memory, of the same
executor at --tensor-parallel-size 1, 2, ... (real server processes over gRPC, the same prompts). Each size gets
the same cores in all: --threads T at size 1 is T/N threads per rank at size N (at least 1). Method and how to
read it: docs/tensor-parallel.md, Measured."""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import time
from pathlib import Path
from typing import Any

import grpc

from benchmarks.cli import add_sizes, int_list, make_log, model_dir, parse, parser
from benchmarks.measure import proc_memory
from benchmarks.report import format_table, machine_info, write_json
from benchmarks.workloads import random_prompts
from models.config import ModelConfig
from models.parallel.shard import shard_refusal
from tandem import server_process
from tandem.executor.v1 import executor_pb2 as pb
from tandem.executor.v1 import executor_pb2_grpc as pb_grpc

QUICK = {"sizes": "1,2", "batches": "1,4", "steps": 3, "warmup": 1, "context": 16, "prefill": 32}
DEFAULTS = {"sizes": "1,2,3", "batches": "1,8", "steps": 8, "warmup": 2, "context": 64, "prefill": 128}
COLUMNS = [("tp", "tp"), ("threads_per_rank", "threads/rank"), ("batch", "batch"), ("decode_ms", "decode ms/step"),
           ("decode_ms_min", "min ms"), ("vs_tp1", "vs tp1", 3), ("prefill_ms", "prefill ms"),
           ("rank_rss_mib", "RSS MiB per rank")]
log = make_log("bench_tp")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = parser("tp", __doc__, "sizes 1,2; batches 1,4; steps 3; context 16; prefill 32")
    ap.add_argument("--sizes", default=None, help="tensor-parallel sizes, comma list; sizes the model cannot be "
                                                  "split into (heads, KV heads) are skipped, logged (default 1,2,3)")
    ap.add_argument("--batches", default=None, help="decode batch sizes, comma list (default 1,8)")
    add_sizes(ap, DEFAULTS, {"steps": "timed decode calls per size and batch", "warmup": "untimed decode calls first",
                             "context": "prompt tokens of each decoding sequence",
                             "prefill": "tokens of the timed one-prompt prefill"})
    ap.add_argument("--threads-per-rank", type=int, default=None,
                    help="torch threads of every rank at every size (default: --threads / N, at least 1)")
    ap.add_argument("--executor-args", default="",
                    help="extra `python -m executor_service` flags for every size, one quoted string given with '=' "
                         "(--executor-args='--decode-kernel torch': size 1 on the same eager forward as the ranks)")
    ap.add_argument("--server-timeout", type=float, default=600.0, help="seconds to wait for each server's READY")
    args = parse(ap, argv, QUICK, DEFAULTS)
    args.size_list, args.batch_list = int_list(args.sizes, "--sizes"), int_list(args.batches, "--batches")
    return args


def ranks_of(pid: int) -> list[int]:
    """Rank 0's pid and its workers' (its children)."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    return [pid] + ([int(c) for c in children.read_text().split()] if children.exists() else [])


def decode_ms(stub: Any, prompts: list[list[int]], steps: int, warmup: int) -> list[float]:
    out = pb.OutputOptions(mode=pb.OUTPUT_MODE_TOKENS)
    res = stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=[pb.UnifiedItem(token_ids=p, is_final_chunk=True, output=out)
                                                            for p in prompts]), timeout=600).results
    caches = [(r.cache.cache_id, r.cache.seq_len, r.output.tokens[0].token_id) for r in res]
    times = []
    for i in range(warmup + steps):
        items = [pb.UnifiedItem(cache_id=c, token_ids=[t], pos_offset=n, is_final_chunk=True, output=out)
                 for c, n, t in caches]
        start = time.perf_counter()
        res = stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=items), timeout=600).results
        if i >= warmup:
            times.append(1e3 * (time.perf_counter() - start))
        caches = [(r.cache.cache_id, r.cache.seq_len, r.output.tokens[0].token_id) for r in res]
    stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[c for c, _, _ in caches]), timeout=60)
    return times


def prefill_ms(stub: Any, prompt: list[int]) -> float:
    start = time.perf_counter()
    res = stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=[pb.UnifiedItem(token_ids=prompt, is_final_chunk=True)]),
                             timeout=600).results
    took = 1e3 * (time.perf_counter() - start)
    stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[res[0].cache.cache_id]), timeout=60)
    return took


def bench_size(model: Path, size: int, threads: int, args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    per_rank = args.threads_per_rank or max(1, threads // size)
    server = server_process.launch_executor(model, "--threads", str(per_rank), "--tensor-parallel-size", str(size),
                                            "--no-prefix-caching", *shlex.split(args.executor_args),
                                            ready_timeout=args.server_timeout)
    try:
        stub = pb_grpc.ExecutorServiceStub(grpc.insecure_channel(server.address))
        rows = []
        long_prompt = random_prompts(1, args.prefill, vocab, 99).tolist()[0]
        prefill_ms(stub, long_prompt)  # warm
        prefill = statistics.median(prefill_ms(stub, long_prompt) for _ in range(3))
        for batch in args.batch_list:
            times = decode_ms(stub, random_prompts(batch, args.context, vocab, batch).tolist(), args.steps, args.warmup)
            rows.append({"tp": size, "threads_per_rank": per_rank, "batch": batch,
                         "decode_ms": statistics.median(times), "decode_ms_min": min(times), "prefill_ms": prefill,
                         "rank_rss_mib": " / ".join(f"{(proc_memory(p)['rss'] or 0) / 2**20:.0f}"
                                                    for p in ranks_of(server.proc.pid))})
        return rows
    finally:
        code = server.stop()
        log(f"tp={size} server stopped (exit code {code})")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = model_dir(args.model)
    vocab = ModelConfig.from_dir(model).vocab_size
    threads = args.threads or len(os.sched_getaffinity(0))
    rows: list[dict[str, Any]] = []
    cfg = ModelConfig.from_dir(model)
    for size in args.size_list:
        why = shard_refusal(cfg, size)
        if why:
            log(f"tp={size} skipped: {why}")
            continue
        log(f"tp={size}: {args.threads_per_rank or max(1, threads // size)} threads per rank")
        rows += bench_size(model, size, threads, args, vocab)
    base = {r["batch"]: r["decode_ms"] for r in rows if r["tp"] == 1}
    for r in rows:
        r["vs_tp1"] = r["decode_ms"] / base[r["batch"]] if r["batch"] in base else None
    split = f"{args.threads_per_rank} threads per rank" if args.threads_per_rank else \
        f"{threads} threads in all per size (threads per rank = {threads} / N)"
    print(f"tensor parallelism on {model.name}: {split}")
    print(format_table(rows, COLUMNS))
    write_json(args.out, {"benchmark": "bench_tp", "machine": machine_info("cpu"), "model": str(model),
                          "threads": threads, "rows": rows})
    return 0
