"""`python -m benchmarks block_kernels --model FILE.gguf`: the native block kernels on a GGUF file's own weights,
without servers or llama.cpp: the time of one token's matrix products (every block weight of the model once,
the tied LM head included) at `--rows` activation rows (1: a decode step; 512: a prompt, per token), first on the
blocks as the file lays them out (the kernels before repacking; calls over 32 rows dequantize and run the float
GEMM), then after `repack_block_weights` (Q4_0 / Q4_K / Q6_K rows interleaved 8 by 8), in one process.

Times are the best of `--repeats` passes, wall and CPU (the CPU time of the process: on a loaded machine it moves
less than the wall time). The formats' share of the bytes and each format's time are printed per layout.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


def _time(weights, rows: int, repeats: int) -> tuple[float, float, dict[str, float]]:
    """Best (wall, cpu) seconds of one pass over every weight at `rows` rows, and the wall per format."""
    inputs = {w.in_features: torch.randn(rows, w.in_features) for w in weights}
    for w in weights:  # warm: scratch buffers, pages
        w(inputs[w.in_features])
    best_wall, best_cpu, per_format = float("inf"), float("inf"), {}
    for _ in range(repeats):
        wall0, cpu0, fmt_times = time.perf_counter(), time.process_time(), {}
        for w in weights:
            t = time.perf_counter()
            w(inputs[w.in_features])
            key = "+".join(w.formats)
            fmt_times[key] = fmt_times.get(key, 0.0) + time.perf_counter() - t
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        if wall < best_wall:
            best_wall, per_format = wall, fmt_times
        best_cpu = min(best_cpu, cpu)
    return best_wall, best_cpu, per_format


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks block_kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a GGUF file with block-quantized weights")
    ap.add_argument("--rows", default="1,512", help="activation rows per call, comma-separated (default 1,512)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch / OpenMP threads (default: all)")
    ap.add_argument("--repeats", type=int, default=3, help="passes per cell; the best counts (default 3)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)

    from models.loader import load_model
    from models.quant.blocks import block_ops_available, block_weights, repack_block_weights

    torch.set_num_threads(args.threads)
    if not block_ops_available():
        raise SystemExit("the native block kernels do not load here")
    model = load_model(args.model, progress=False)
    weights = block_weights(model)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{args.model}: {len(weights)} block weights, {sum(w.nbytes for w in weights) / 2**30:.2f} GiB, "
          f"{args.threads} threads, load average {os.getloadavg()[0]:.1f}")
    results: dict[str, dict[int, dict]] = {}
    for layout in ("file", "repacked"):
        if layout == "repacked":
            t = time.perf_counter()
            repack_block_weights(model)
            print(f"repacked in {time.perf_counter() - t:.1f} s")
        for r in rows:
            with torch.inference_mode():
                wall, cpu, per_format = _time(weights, r, args.repeats)
            results.setdefault(layout, {})[r] = {"wall_ms_per_token": wall / r * 1e3, "cpu_ms_per_token": cpu / r * 1e3,
                                                 "by_format_ms": {k: v / r * 1e3 for k, v in per_format.items()}}
            formats = ", ".join(f"{k} {v / r * 1e3:.2f}" for k, v in sorted(per_format.items()))
            print(f"{layout:9s} rows {r:4d}: {wall / r * 1e3:8.2f} ms/token wall, {cpu / r * 1e3:8.2f} cpu "
                  f"({formats})", flush=True)
    print("\nrows | file ms/token | repacked ms/token | speedup (wall) | speedup (cpu)\n---|---|---|---|---")
    for r in rows:
        a, b = results["file"][r], results["repacked"][r]
        print(f"{r} | {a['wall_ms_per_token']:.2f} | {b['wall_ms_per_token']:.2f} | "
              f"{a['wall_ms_per_token'] / b['wall_ms_per_token']:.2f}x | {a['cpu_ms_per_token'] / b['cpu_ms_per_token']:.2f}x")
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "threads": args.threads, "results": results}, indent=1))
    return 0
