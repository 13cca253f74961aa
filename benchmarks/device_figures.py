"""One device's figures, in process (what scripts/gpu_check reports per model shape): decode steps at batch 1 and 64
with CUDA graphs on and off, prefill of one 512- and one 4096-token prompt, the graphs' capture time, peak memory,
the attention backend that ran and why, and batch-1 decode against the memory-bandwidth limit (weight bytes read
per step / the device's measured bandwidth). --shape: a random checkpoint of a served model's sizes, made on the
machine (no weights travel), in the dtype measured."""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.cli import add_sizes, choices, int_list, make_log, parse, parser, set_threads, torch_device
from benchmarks.local_executor import TOKENS_ONLY, DecodeBatch, build_executor
from benchmarks.report import machine_info, table, write_json
from benchmarks.shapes import SHAPES, bytes_read_per_step, memory_bandwidth, shape_checkpoint
from benchmarks.workloads import model_vocabulary, vocabulary_prompts
from executor_service.types import UnifiedItem
from models.attention.backend import flashinfer_importable
from models.config import ModelConfig

log = make_log("bench_device")
GRAPHS = {"on": True, "off": False}
DEFAULTS = {"batches": "1,64", "prefill": "512,4096", "prompt_len": 128, "steps": 20, "repeats": 3}
QUICK = {"batches": "1,8", "prefill": "128", "prompt_len": 16, "steps": 3, "repeats": 1}
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = parser("device", __doc__, "batches 1,8, one 128-token prefill, 16-token context, 3 steps", model=False)
    ap.add_argument("--model", type=Path, default=None, help="HF model directory (or --shape)")
    ap.add_argument("--shape", dest="shape_name", choices=sorted(SHAPES), default=None,
                    help="a random checkpoint of that model's sizes in --dtype, made once into ~/.cache/tandem/shapes")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="default cpu")
    ap.add_argument("--dtype", default=None, choices=sorted(BYTES), help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--graphs", default=None, help="comma list of on, off: CUDA graphs for decode steps (default "
                    "both on CUDA; on CPU none can run and the executor's own choice is measured)")
    add_sizes(ap, DEFAULTS, {"batches": "decode batch sizes", "prefill": "prompt lengths of the prefill rows",
                             "prompt-len": "context of the decode rows", "steps": "timed decode steps per batch",
                             "repeats": "timed prefills per length (after an untimed first one)"})
    args = parse(ap, argv, QUICK, DEFAULTS)
    if bool(args.model) == bool(args.shape_name):  # (not `shape`: parse() would make it float32)
        ap.error("give one of --model DIR and --shape NAME")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.batch_list, args.prefill_list = int_list(args.batches, "--batches"), int_list(args.prefill, "--prefill")
    if args.device == "cuda":
        args.graph_list = choices(args.graphs or "on,off", tuple(GRAPHS), "--graphs")
    elif args.graphs:
        ap.error("--graphs: CUDA graphs need --device cuda")
    else:
        args.graph_list = ["n/a"]
    if min(args.prompt_len, args.steps, args.repeats) < 1:
        ap.error("--prompt-len, --steps and --repeats must be >= 1")
    return args


def device_bandwidth(device: torch.device) -> float:
    """Bytes/s the device's memory moves: on CUDA a 1 GiB device-to-device copy (read + write), the best of 5 after
    a warm-up; on the CPU the host's read rate (benchmarks/shapes.py)."""
    if device.type != "cuda":
        return memory_bandwidth()["read"]
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * (1 << 30) / best


def attention_note(device: torch.device) -> str:
    """Why the executor's `auto` picks what it picks here (models/attention/backend.py's order)."""
    if device.type != "cuda":
        return "gathered: the CPU's backend"
    if flashinfer_importable():
        return "flashinfer: importable"
    return "flex (compiled): flashinfer-python is not importable here"


def decode_rows(ex: Any, prompts: list[list[int]], batches: list[int], steps: int) -> dict[str, dict[str, float]]:
    """Median ms per decode step and tokens/s at each batch size (3 untimed steps first)."""
    out = {}
    for b in batches:
        batch = DecodeBatch(ex)
        batch.prefill(prompts[:b])
        times = []
        for i in range(steps + 3):
            start = time.perf_counter()
            batch.advance(ex.decode(batch.decode_items()))  # tokens come back to the host: the step has finished
            if i >= 3:
                times.append(time.perf_counter() - start)
        batch.release()
        ms = 1e3 * statistics.median(times)
        out[str(b)] = {"step_ms": ms, "tok_s": b / ms * 1e3}
        log(f"decode B={b}: {ms:.2f} ms/step, {b / ms * 1e3:,.0f} tok/s")
    return out


def prefill_rows(ex: Any, allowed: Any, lengths: list[int], repeats: int) -> dict[str, dict[str, float]]:
    """One prompt per call: the first call (compiles, where something compiles per shape) and the median after."""
    out = {}
    for n in lengths:
        prompts = vocabulary_prompts(repeats + 1, n, allowed, seed=0, stream=n)
        times = []
        for p in prompts:
            start = time.perf_counter()
            result = ex.unified_decode([UnifiedItem(tuple(p), output=TOKENS_ONLY)])
            times.append(time.perf_counter() - start)
            ex.release_cache([r.cache.cache_id for r in result])
        s = statistics.median(times[1:])
        out[str(n)] = {"first_s": times[0], "s": s, "tok_s": n / s}
        log(f"prefill {n}: {n / s:,.0f} tok/s ({s * 1e3:.1f} ms; first call {times[0]:.1f} s)")
    return out


def run_executor(args, model_dir: Path, graphs: str, prompts: list[list[int]], allowed: Any, prefill: bool,
                 run: dict[str, Any], save: Callable[[], Any]) -> None:
    """Builds one executor (graphs on, off, or its own choice), measures it into `run` (save() after each part:
    partial results survive a kill), frees it."""
    cuda = args.device == "cuda"
    ctx = args.prompt_len + args.steps + 8
    blocks = max(args.batch_list) * (ctx // 16 + 2) + max(args.prefill_list) // 16 + 64
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    ex = build_executor(model_dir, args.device, args.dtype, kv_blocks=blocks, prefix_caching=False,
                        max_batch_tokens=max(max(args.prefill_list), max(args.batch_list) * args.prompt_len, 2048),
                        decode_kernel="torch", cuda_graph_max_batch=max(args.batch_list),
                        **({"cuda_graphs": GRAPHS[graphs]} if cuda else {}))
    build_s = time.perf_counter() - start
    info = ex.info()
    run |= {"graphs": graphs, "build_s": build_s, "capture_s": getattr(ex.decode_step, "capture_s", None),
           "attention_backend": info.attention_backend, "capabilities": list(info.capabilities)}
    replays = "replays CUDA graphs" if "cuda_graphs" in info.capabilities else "no CUDA graphs"
    log(f"graphs {graphs}: executor ready in {build_s:.1f} s (capture {run['capture_s'] or 0:.1f} s), attention "
        f"{info.attention_backend}, decode {replays}")
    run["decode"] = decode_rows(ex, prompts, args.batch_list, args.steps)
    run["peak_memory_bytes"] = (torch.cuda.max_memory_allocated() if cuda
                                else ex.info().resident_memory_bytes)  # CPU: the process's RSS
    if prefill:
        save()
        run["prefill"] = {}
        for n in args.prefill_list:
            run["prefill"].update(prefill_rows(ex, allowed, [n], args.repeats))
            save()
    del ex
    gc.collect()  # (the next executor's peak memory without this one's)
    if cuda:
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch_device(args.device)
    threads = set_threads(args.threads)
    model_dir = args.model or shape_checkpoint(args.shape_name, args.dtype, device=args.device)
    cfg = ModelConfig.from_dir(model_dir)
    allowed = model_vocabulary(model_dir, cfg)
    prompts = vocabulary_prompts(max(args.batch_list), args.prompt_len, allowed, seed=0, stream=0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    bandwidth = device_bandwidth(device)
    step_bytes = bytes_read_per_step(model_dir, cfg.tie_word_embeddings, BYTES[args.dtype])
    limit = bandwidth / step_bytes
    log(f"{name}: {bandwidth / 1e9:,.0f} GB/s; {step_bytes / 1e9:.3f} GB of weights per step: batch-1 limit "
        f"{limit:,.0f} tok/s; attention {attention_note(device)}")
    result = {"benchmark": "bench_device", "config": {k: v for k, v in vars(args).items() if k != "out"}
              | {"model": str(model_dir), "threads": threads}, "machine": machine_info(device), "device_name": name,
              "bandwidth_Bps": bandwidth, "step_bytes": step_bytes, "batch1_limit_tok_s": limit,
              "attention_note": attention_note(device), "runs": []}
    for i, graphs in enumerate(args.graph_list):  # the prefill rows last: a first compile that runs long (flex on
        last = i == len(args.graph_list) - 1      # CUDA, per shape) leaves every decode row written
        run: dict[str, Any] = {}
        result["runs"].append(run)
        try:
            run_executor(args, model_dir, graphs, prompts, allowed, last, run,
                         save=lambda: write_json(args.out, result))
        except Exception as exc:  # noqa: BLE001 - the other settings still run; the exit status says it failed
            log(f"graphs {graphs}: {type(exc).__name__}: {exc}")
            run |= {"graphs": graphs, "error": f"{type(exc).__name__}: {exc}"[:300]}
        write_json(args.out, result)  # after each executor: a stage killed at its time limit keeps what it measured
    runs = [r for r in result["runs"] if "decode" in r]
    failed = len(result["runs"]) - len(runs)
    if not runs:
        return 1
    rows = [{"graphs": r["graphs"], "batch": int(b), "ms/step": v["step_ms"], "tok/s": v["tok_s"],
             "of BW limit": f"{v['tok_s'] / limit:.0%}" if b == "1" else None}
            for r in runs for b, v in r["decode"].items()]
    print(f"{args.shape_name or model_dir.name} {args.dtype} on {name} ({threads} threads); attention "
          f"{runs[0]['attention_backend']} ({attention_note(device)})")
    print(table(rows, 2))
    print(table([{"prompt": int(n), "tok/s": v["tok_s"], "ms": v["s"] * 1e3, "first s": v["first_s"]}
                 for n, v in result["runs"][-1].get("prefill", {}).items()], 1))
    log(f"wrote {args.out}")
    return 1 if failed else 0
