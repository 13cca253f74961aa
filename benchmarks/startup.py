"""Executor startup as a user meets it, per configuration: time to READY, resident memory, and the first and
second requests' latency right after READY; a cold start (the model files evicted from the page cache) then warm
ones. Method: docs/benchmarks.md."""
from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import time
from pathlib import Path
from typing import Any

import grpc

from benchmarks.cli import add_sizes, choices, make_log, model_dir, parse, parser, stop_on_sigterm
from benchmarks.measure import machine_busy_s, other_cores, proc_memory, process_cpu_s
from benchmarks.report import format_table, machine_info, write_json
from benchmarks.workloads import random_prompts
from tandem import server_process
from tandem.executor.v1 import executor_pb2 as pb
from tandem.executor.v1 import executor_pb2_grpc as pb_grpc

CONFIGS: dict[str, list[str]] = {
    "defaults": [], "kv-blocks-512": ["--kv-blocks", "512"], "unpacked": ["--no-cpu-packed-weights"],
    "kv-blocks-512-unpacked": ["--kv-blocks", "512", "--no-cpu-packed-weights"],
    "bfloat16": ["--dtype", "bfloat16"], "float16": ["--dtype", "float16"]}
QUICK = {"configs": "defaults", "repeats": 1, "cold": False, "prompt_len": 16, "decode_steps": 2}
DEFAULTS = {"configs": ",".join(CONFIGS), "repeats": 3, "cold": True, "prompt_len": 128, "decode_steps": 4}
RPC_TIMEOUT_S = 300.0
_READY_IN = re.compile(r"ready in ([0-9.]+)s")
COLUMNS = [("config", "config"), ("cache", "page cache"), ("runs", "runs"), ("kv_blocks", "KV blocks"),
           ("ready_s", "READY s"), ("ready_in_s", "ready-in s"),
           ("rss_mb", "RSS@READY MB", 0), ("peak_mb", "peak MB", 0), ("first_ms", "1st req ms", 0),
           ("second_ms", "2nd req ms", 0), ("first_prefill_ms", "1st prefill ms", 0),
           ("second_prefill_ms", "2nd prefill ms", 0), ("other_cores", "other cores")]
log = make_log("bench_startup")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = parser("startup", __doc__, "the defaults config once, warm only, a 16-token prompt, 2 decode steps",
                threads=False)
    ap.add_argument("--configs", default=None, help=f"comma list of {', '.join(CONFIGS)} (default: all)")
    add_sizes(ap, DEFAULTS, {"repeats": "warm starts per configuration (0 = the cold start only)",
                             "prompt-len": "tokens of the first (and second) request's prompt",
                             "decode-steps": "single-step Decode calls after each Prefill"})
    ap.add_argument("--cold", action=argparse.BooleanOptionalAction, default=None,
                    help="one cold start per configuration first (default on; off with --quick)")
    ap.add_argument("--executor-args", default="", help="more executor flags for every configuration, quoted")
    ap.add_argument("--ready-timeout", type=float, default=300.0, help="seconds a start may take (default 300)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    args = parse(ap, argv, QUICK, DEFAULTS)
    args.config_list = choices(args.configs, tuple(CONFIGS), "--configs")
    if args.repeats < 0 or args.prompt_len < 1 or args.decode_steps < 0 or (args.repeats == 0 and not args.cold):
        ap.error("--repeats >= 0 (with --cold when 0), --prompt-len >= 1, --decode-steps >= 0")
    return args


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in Path(directory).rglob("*") if p.is_file())


def evict(directory: Path) -> bool:
    """Drops the directory's files from the page cache (fsync, then fadvise DONTNEED: clean unmapped pages go) so
    the weights come from disk, without root's global drop_caches, which would slow every other process."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in _files(directory):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def request(stub: pb_grpc.ExecutorServiceStub, prompt: list[int], steps: int) -> dict[str, Any]:
    """One Prefill + `steps` single-step Decodes (greedy, the sampled token fed back), then ReleaseCache."""
    t = time.perf_counter()
    res = stub.Prefill(pb.PrefillRequest(token_ids=prompt), timeout=RPC_TIMEOUT_S)
    prefill_ms, cache, token = 1e3 * (time.perf_counter() - t), res.cache, res.output.tokens[0].token_id
    decode_ms = []
    for _ in range(steps):
        t = time.perf_counter()
        out = stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(cache=cache, token_id=token)], num_steps=1),
                          timeout=RPC_TIMEOUT_S)
        decode_ms.append(1e3 * (time.perf_counter() - t))
        cache, token = out.results[0].cache, out.results[0].output.tokens[0].token_id
    stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[cache.cache_id]), timeout=RPC_TIMEOUT_S)
    return {"prefill_ms": prefill_ms, "decode_ms": decode_ms, "total_ms": prefill_ms + sum(decode_ms)}


def info_of(stub: pb_grpc.ExecutorServiceStub) -> dict[str, Any]:
    """The KV pool as GetInfo states it, and why that size."""
    info = stub.GetInfo(pb.GetInfoRequest(), timeout=RPC_TIMEOUT_S)
    p = info.kv_pool
    return {"kv_blocks": info.kv.total_blocks, "dtype": info.dtype, "vocab_size": info.vocab_size,
            "resident_memory_bytes": info.resident_memory_bytes,
            "kv_pool": {"blocks": p.blocks, "tokens": p.tokens, "bytes": p.bytes, "reason": p.reason}}


def start_once(directory: Path, flags: list[str], cold: bool, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One start with `flags`: READY time, memory, two requests, a clean stop."""
    if cold:
        evict(directory)
    busy, t = machine_busy_s(), time.perf_counter()
    server = server_process.launch_executor(directory, *flags, ready_timeout=args.ready_timeout)
    try:
        ready_s = time.perf_counter() - t
        at_ready, cpu = proc_memory(server.proc.pid), process_cpu_s(server.proc.pid)
        others = other_cores(busy, machine_busy_s(), cpu or 0.0, ready_s)
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.ExecutorServiceStub(channel)
            info = info_of(stub)
            prompts = random_prompts(2, args.prompt_len, info["vocab_size"], seed).tolist()
            first, second = (request(stub, p, args.decode_steps) for p in prompts)
        after, text = proc_memory(server.proc.pid), server.log()
    finally:
        code = server.stop()
    ready_in = _READY_IN.search(text)
    return {"cold": cold, "ready_s": ready_s,
            "ready_in_s": float(ready_in.group(1)) if ready_in else None,
            "executor_cpu_to_ready_s": cpu, "other_cores_to_ready": others, "rss_at_ready_bytes": at_ready["rss"],
            "peak_at_ready_bytes": at_ready["peak"], "peak_bytes": after["peak"], "info": info,
            "first_request": first, "second_request": second, "exit_code": code}


def summarize(name: str, runs: list[dict[str, Any]], cold: bool) -> dict[str, Any]:
    """One table row: the cold run, or the medians of the warm runs."""
    def med(key: str, sub: str | None = None, scale: float = 1.0) -> float | None:
        values = [v for v in ((r[key][sub] if sub else r[key]) for r in runs) if v is not None]
        return statistics.median(values) * scale if values else None

    mb = 1 / (1 << 20)
    return {"config": name, "cache": "cold" if cold else "warm", "runs": len(runs),
            "kv_blocks": runs[0]["info"]["kv_blocks"], "ready_s": med("ready_s"), "ready_in_s": med("ready_in_s"),
            "rss_mb": med("rss_at_ready_bytes", scale=mb),
            "peak_mb": med("peak_bytes", scale=mb), "first_ms": med("first_request", "total_ms"),
            "second_ms": med("second_request", "total_ms"), "first_prefill_ms": med("first_request", "prefill_ms"),
            "second_prefill_ms": med("second_request", "prefill_ms"),
            "other_cores": med("other_cores_to_ready")}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()
    directory = model_dir(args.model).resolve()
    cold_ok = bool(args.cold and evict(directory))
    if args.cold and not cold_ok:
        log("cold starts unavailable here (no posix_fadvise): warm runs only")
    rows, results = [], []
    for n, name in enumerate(args.config_list):
        flags = CONFIGS[name] + shlex.split(args.executor_args)
        runs = []
        for i, cold in enumerate(([True] if cold_ok else []) + [False] * args.repeats):
            runs.append(start_once(directory, flags, cold, args, args.seed + 2 * n))
            log(f"{name} {'cold' if cold else 'warm'} #{i}: READY {runs[-1]['ready_s']:.2f}s, "
                f"1st request {runs[-1]['first_request']['total_ms']:.0f} ms")
        if cold_ok:
            rows.append(summarize(name, runs[:1], cold=True))
        if args.repeats:
            rows.append(summarize(name, runs[1:] if cold_ok else runs, cold=False))
        results.append({"config": name, "flags": flags, "runs": runs})
    print(f"model: {directory.name}; READY s = spawn -> the READY line; ready-in s = the executor's own figure "
          f"(listening -> READY); 1st / 2nd req = Prefill {args.prompt_len} tokens + {args.decode_steps} Decode steps "
          "right after READY; warm rows are medians; cold = model files evicted from the page cache first")
    print(format_table(rows, COLUMNS))
    for r in results:
        reason = r["runs"][0]["info"].get("kv_pool", {}).get("reason")
        if reason:
            print(f"  {r['config']}: KV pool {reason}")
    config = {k: v for k, v in vars(args).items() if k != "out"}
    out = write_json(args.out, {"benchmark": "bench_startup", "config": config,
                                "machine": machine_info("cpu"), "cold_available": cold_ok,
                                "model": {"dir": str(directory), "name": directory.name}, "rows": rows,
                                "results": results})
    log(f"wrote {out}")
    return 0
