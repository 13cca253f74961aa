"""Executor startup: time to READY, resident memory, and the first request's latency, per configuration.

Each run starts a real executor process (`python -m executor_service --model DIR --port 0 FLAGS`, launched as
tandem/server_process.py launches it for scripts/serve, the serving benchmark and the tests) and measures:

- READY s: wall time from spawning the process to its stdout line `READY <address>` (interpreter start,
  imports, weight loading, KV pool, warm-up forward). The executor turns grpc.health.v1 SERVING just before it
  prints that line, so this is also when a client can first be served.
- ready-in s: the executor's own figure from its log line `ready in X s` (from listening to READY: weights,
  packing, KV pool, warm-up; without the interpreter and imports). imports s: spawn to its `listening` line.
- RSS: the process's resident memory (/proc/PID/status VmRSS) read as soon as READY arrives; peak: VmHWM
  then (the most it held while starting) and after the requests.
- 1st request: right after READY, over gRPC, one Prefill of --prompt-len random tokens then --decode-steps
  single-step Decode calls feeding the sampled token back (wall ms of the calls, the sum and each part);
  then a 2nd request of the same shape (other tokens), so a cost moved from startup into the first request
  shows as a gap between the two.
- other cores: cores other processes kept busy from spawn to READY (the machine's busy time minus the
  executor's, per second; /proc): a busy machine stretches every figure.

Page cache: a "cold" run first evicts the model directory's files from the page cache (posix_fadvise
DONTNEED; the share of their bytes still cached just before the start is measured with mincore and
reported), so the weights come from disk. Python, torch and the other libraries stay cached: evicting
those needs root's global /proc/sys/vm/drop_caches, which would also slow every other process on a shared
machine, so it is not done. Where fadvise/mincore are missing, cold runs are reported as unavailable.
"Warm" runs follow the cold one (--repeats of them; the table shows their medians).

Configurations (--configs, comma-separated; default all): defaults (no flags: float32 on CPU, packed
weights, default KV sizing), kv-blocks-512, unpacked (--no-cpu-packed-weights), kv-blocks-512-unpacked,
bfloat16, float16. --executor-args adds flags to every configuration. Runs are sequential; the machine's
load average is recorded. Compare within a run: a shared machine makes absolute times noisy.

    python scripts/bench_startup.py                                   # SmolLM2-135M-Instruct, every config
    python scripts/bench_startup.py --configs defaults,kv-blocks-512 --repeats 5
    python scripts/bench_startup.py --quick --model /tmp/tiny-llama --cold

Benchmark-only; never imported by the servers.
"""
from __future__ import annotations

import argparse
import re
import shlex
import statistics
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc

from benchmarks import page_cache, runtime
from benchmarks.cli import add_model_arg, add_out_args, make_log, parse_with_preset, parser
from benchmarks.cpu import loadavg, machine_busy_s, other_cores, process_cpu_s
from benchmarks.report import format_table, machine_info, write_json
from benchmarks.workloads import random_prompts
from tandem import server_process
from tandem.executor.v1 import executor_pb2 as pb
from tandem.executor.v1 import executor_pb2_grpc as pb_grpc

CONFIGS: dict[str, list[str]] = {
    "defaults": [],
    "kv-blocks-512": ["--kv-blocks", "512"],
    "unpacked": ["--no-cpu-packed-weights"],
    "kv-blocks-512-unpacked": ["--kv-blocks", "512", "--no-cpu-packed-weights"],
    "bfloat16": ["--dtype", "bfloat16"],
    "float16": ["--dtype", "float16"],
}
QUICK = {"configs": "defaults", "repeats": 1, "cold": False, "prompt_len": 16, "decode_steps": 2}
DEFAULTS = {"configs": ",".join(CONFIGS), "repeats": 3, "cold": True, "prompt_len": 128, "decode_steps": 4}
RPC_TIMEOUT_S = 300.0
_READY_IN = re.compile(r"ready in ([0-9.]+)s")
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ \S+: listening on", re.MULTILINE)

log = make_log("bench_startup")


def proc_memory(pid: int) -> dict[str, int | None]:
    """{"rss": VmRSS, "peak": VmHWM} of a live process in bytes (None where /proc does not say)."""
    out: dict[str, int | None] = {"rss": None, "peak": None}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out["rss" if key == "VmRSS" else "peak"] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def _request(stub: pb_grpc.ExecutorServiceStub, prompt: list[int], steps: int) -> dict[str, Any]:
    """One Prefill + `steps` single-step Decodes (greedy, the sampled token fed back), then ReleaseCache."""
    t = time.perf_counter()
    res = stub.Prefill(pb.PrefillRequest(token_ids=prompt), timeout=RPC_TIMEOUT_S)
    prefill_ms = 1e3 * (time.perf_counter() - t)
    cache, token = res.cache, res.output.tokens[0].token_id
    decode_ms = []
    for _ in range(steps):
        t = time.perf_counter()
        out = stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(cache=cache, token_id=token)], num_steps=1),
                          timeout=RPC_TIMEOUT_S)
        decode_ms.append(1e3 * (time.perf_counter() - t))
        cache, token = out.results[0].cache, out.results[0].output.tokens[0].token_id
    stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[cache.cache_id]), timeout=RPC_TIMEOUT_S)
    return {"prefill_ms": prefill_ms, "decode_ms": decode_ms, "total_ms": prefill_ms + sum(decode_ms)}


def _info(stub: pb_grpc.ExecutorServiceStub) -> dict[str, Any]:
    """The KV pool as GetInfo states it. kv_pool and resident_memory_bytes are read only where the contract
    has them, so the benchmark also runs against an executor from before they existed."""
    info = stub.GetInfo(pb.GetInfoRequest(), timeout=RPC_TIMEOUT_S)
    out: dict[str, Any] = {"kv_blocks": info.kv.total_blocks, "block_size": info.kv.block_size,
                           "dtype": info.dtype, "vocab_size": info.vocab_size, "max_seq_len": info.max_seq_len}
    fields = info.DESCRIPTOR.fields_by_name
    if "kv_pool" in fields and info.HasField("kv_pool"):
        p = info.kv_pool
        out["kv_pool"] = {"blocks": p.blocks, "tokens": p.tokens, "bytes": p.bytes, "reason": p.reason}
    if "resident_memory_bytes" in fields:
        out["resident_memory_bytes"] = info.resident_memory_bytes
    return out


def _log_times(text: str, spawned_at: float) -> dict[str, float | None]:
    ready = _READY_IN.search(text)
    stamp = _STAMP.search(text)
    imports = None
    if stamp:  # the logging module's asctime: local wall-clock time, millisecond resolution
        listening = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        imports = max(0.0, listening - spawned_at)
    return {"ready_in_s": float(ready.group(1)) if ready else None, "imports_s": imports}


def start_once(model_dir: Path, flags: list[str], cold: bool, args: argparse.Namespace, seed: int
               ) -> dict[str, Any]:
    """One start of the executor with `flags`: READY time, memory, two requests, a clean stop."""
    if cold:
        page_cache.evict(model_dir)
    cached = page_cache.cached_fraction(model_dir)
    busy, spawned_at, t = machine_busy_s(), time.time(), time.perf_counter()
    server = server_process.launch_executor(model_dir, *flags, ready_timeout=args.ready_timeout)
    try:
        ready_s = time.perf_counter() - t
        at_ready = proc_memory(server.proc.pid)
        executor_cpu = process_cpu_s(server.proc.pid)
        others = other_cores(busy, machine_busy_s(), executor_cpu or 0.0, ready_s)
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.ExecutorServiceStub(channel)
            info = _info(stub)  # also after READY: a control call, it does not wait for the model thread
            prompts = random_prompts(2, args.prompt_len, info["vocab_size"], seed).tolist()
            first = _request(stub, prompts[0], args.decode_steps)
            second = _request(stub, prompts[1], args.decode_steps)
        after = proc_memory(server.proc.pid)
        times = _log_times(server.log(), spawned_at)
    finally:
        code = server.stop()
    return {"cold": cold, "model_cached_fraction": cached, "ready_s": ready_s, **times,
            "executor_cpu_to_ready_s": executor_cpu, "other_cores_to_ready": others,
            "rss_at_ready_bytes": at_ready["rss"], "peak_at_ready_bytes": at_ready["peak"],
            "rss_after_requests_bytes": after["rss"], "peak_bytes": after["peak"], "info": info,
            "first_request": first, "second_request": second, "exit_code": code}


def _median(runs: list[dict[str, Any]], key: str, sub: str | None = None) -> float | None:
    values = [(r[key][sub] if sub else r[key]) for r in runs]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(name: str, flags: list[str], runs: list[dict[str, Any]], cold: bool) -> dict[str, Any]:
    """One table row: a run (cold) or the medians of the warm runs."""
    info = runs[0]["info"]
    pool = info.get("kv_pool") or {}
    mb = 1 / (1 << 20)
    row: dict[str, Any] = {
        "config": name, "flags": " ".join(flags) or "(none)", "cache": "cold" if cold else "warm", "runs": len(runs),
        "kv_blocks": info["kv_blocks"], "kv_gib": pool["bytes"] / (1 << 30) if pool else None,
        "ready_s": _median(runs, "ready_s"), "ready_in_s": _median(runs, "ready_in_s"),
        "imports_s": _median(runs, "imports_s"),
        "rss_mb": _scaled(_median(runs, "rss_at_ready_bytes"), mb),
        "peak_ready_mb": _scaled(_median(runs, "peak_at_ready_bytes"), mb),
        "peak_mb": _scaled(_median(runs, "peak_bytes"), mb),
        "first_ms": _median(runs, "first_request", "total_ms"), "second_ms": _median(runs, "second_request", "total_ms"),
        "first_prefill_ms": _median(runs, "first_request", "prefill_ms"),
        "second_prefill_ms": _median(runs, "second_request", "prefill_ms"),
        "cached": _median(runs, "model_cached_fraction"), "other_cores": _median(runs, "other_cores_to_ready"),
    }
    return row


def _scaled(value: float | None, scale: float) -> float | None:
    return None if value is None else value * scale


COLUMNS = [("config", "config"), ("cache", "page cache"), ("runs", "runs"), ("kv_blocks", "KV blocks"),
           ("ready_s", "READY s", 2), ("ready_in_s", "ready-in s", 2), ("imports_s", "imports s", 2),
           ("rss_mb", "RSS@READY MB", 0), ("peak_ready_mb", "peak@READY MB", 0), ("peak_mb", "peak MB", 0),
           ("first_ms", "1st req ms", 0), ("second_ms", "2nd req ms", 0),
           ("first_prefill_ms", "1st prefill ms", 0), ("second_prefill_ms", "2nd prefill ms", 0),
           ("other_cores", "other cores", 2)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = parser(__doc__, epilog=__doc__.split("\n\n", 1)[1])
    add_model_arg(ap)
    ap.add_argument("--configs", default=None,
                    help=f"comma-separated configurations, of: {', '.join(CONFIGS)} (default: all)")
    ap.add_argument("--repeats", type=int, default=None,
                    help=f"warm starts per configuration (default {DEFAULTS['repeats']}; 0 = the cold start only)")
    ap.add_argument("--cold", action=argparse.BooleanOptionalAction, default=None,
                    help="one cold start per configuration first: the model files evicted from the page cache "
                         "(default on; off with --quick)")
    ap.add_argument("--prompt-len", type=int, default=None,
                    help=f"tokens of the first (and second) request's prompt (default {DEFAULTS['prompt_len']})")
    ap.add_argument("--decode-steps", type=int, default=None,
                    help=f"single-step Decode calls after each Prefill (default {DEFAULTS['decode_steps']})")
    ap.add_argument("--executor-args", default="", help="more executor flags for every configuration, quoted")
    ap.add_argument("--ready-timeout", type=float, default=300.0,
                    help="seconds a start may take before the run fails (default 300)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    add_out_args(ap, "bench_startup", "smoke run: the defaults config once, warm only, a 16-token prompt, 2 decode "
                                      "steps (explicit flags still win)")
    args = parse_with_preset(ap, argv, QUICK, DEFAULTS)
    args.config_list = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.config_list if c not in CONFIGS]
    if unknown or not args.config_list:
        ap.error(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    if args.repeats < 0 or args.prompt_len < 1 or args.decode_steps < 0 or (args.repeats == 0 and not args.cold):
        ap.error("--repeats >= 0 (with --cold when 0), --prompt-len >= 1, --decode-steps >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runtime.exit_on_sigterm()
    model_dir = runtime.model_dir(args.model).resolve()
    extra = shlex.split(args.executor_args)
    cold_ok = args.cold and page_cache.cached_fraction(model_dir) is not None and page_cache.evict(model_dir)
    if args.cold and not cold_ok:
        log("cold starts unavailable here (no posix_fadvise / mincore): warm runs only")
    load_start = loadavg()
    log(f"model {model_dir}; configs {', '.join(args.config_list)}; load average {load_start}")
    rows, results = [], []
    for n, name in enumerate(args.config_list):
        flags = CONFIGS[name] + extra
        runs = []
        kinds = ([True] if cold_ok else []) + [False] * args.repeats
        for i, cold in enumerate(kinds):
            run = start_once(model_dir, flags, cold, args, args.seed + 2 * n)
            log(f"{name} {'cold' if cold else 'warm'} #{i}: READY {run['ready_s']:.2f}s (log {run['ready_in_s']}s), "
                f"RSS {run['rss_at_ready_bytes'] / 2**20 if run['rss_at_ready_bytes'] else 0:.0f} MB, "
                f"1st request {run['first_request']['total_ms']:.0f} ms")
            runs.append(run)
        if cold_ok:
            rows.append(summarize(name, flags, runs[:1], cold=True))
        if args.repeats:
            rows.append(summarize(name, flags, runs[1:] if cold_ok else runs, cold=False))
        results.append({"config": name, "flags": flags, "runs": runs})

    print(f"model: {model_dir.name}; READY s = spawn -> the READY line; ready-in s = the executor's own figure "
          f"(listening -> READY); 1st / 2nd req = Prefill {args.prompt_len} tokens + {args.decode_steps} Decode "
          f"steps right after READY; warm rows are medians")
    if cold_ok:
        print("cold = the model files evicted from the page cache (fadvise DONTNEED) before the start; python and "
              "torch libraries stay cached (no global drop_caches on a shared machine)")
    print(format_table(rows, COLUMNS))
    pools = {r["config"]: r["runs"][0]["info"].get("kv_pool", {}).get("reason") for r in results}
    for name, reason in pools.items():
        if reason:
            print(f"  {name}: KV pool {reason}")
    out = write_json(args.out, {
        "benchmark": "bench_startup", "config": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": {**machine_info("cpu"), **_meminfo(), "load_average_start": load_start,
                    "load_average_end": loadavg()},
        "model": {"dir": str(model_dir), "name": model_dir.name}, "cold_available": bool(cold_ok),
        "rows": rows, "results": results})
    log(f"wrote {out}")
    return 0


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    out[key.lower() + "_bytes"] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out
