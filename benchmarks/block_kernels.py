"""`python -m benchmarks block_kernels --model FILE.gguf`: the native block kernels on a GGUF file's own weights,
without servers or llama.cpp (or `--synthetic FORMAT --shape smollm2-1.7b`: one format's random valid blocks in a
shape's linear layers, for a machine without the file or llama.cpp's quantizer): the time of one token's matrix
products (every block weight of the model once, the tied LM head included) at `--rows` activation rows (1: a
decode step; 512: a prompt, per token), first on the blocks as the file lays them out (the kernels before
repacking; calls over 32 rows dequantize and run the float GEMM), then after `repack_block_weights` (Q4_0 / Q8_0 /
Q4_K / Q6_K rows interleaved 8 by 8), in one process.

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
from torch import nn

# (offset, low, high) of each float16 scale in a block: values that give weights of a model's spread (as the kernel
# tests, tests/models/test_block_kernels.py); every other byte random
_SCALES = {"Q4_0": [(0, 1e-3, 2e-2)], "Q5_0": [(0, 1e-3, 2e-2)], "Q8_0": [(0, 1e-3, 2e-2)],
           "Q4_1": [(0, 1e-3, 2e-2), (2, -0.1, 0.1)], "Q5_1": [(0, 1e-3, 2e-2), (2, -0.1, 0.1)],
           "Q4_K": [(0, 5e-4, 2e-3), (2, 5e-4, 2e-3)], "Q5_K": [(0, 5e-4, 2e-3), (2, 5e-4, 2e-3)],
           "Q6_K": [(208, 5e-4, 2e-3)]}


def synthetic_model(shape: str, fmt_name: str, seed: int = 0) -> nn.Module:
    """A module whose children hold (`.quant`) the linear layers of a benchmarks/shapes.py shape (every layer's
    q, k, v, o, gate, up, down; no LM head) as BlockWeights of random valid `fmt_name` blocks."""
    from benchmarks.shapes import SHAPES
    from models.quant.block_formats import FORMATS
    from models.quant.blocks import BlockWeight

    fmt, cfg = FORMATS[fmt_name], SHAPES[shape][1]
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim", hidden // cfg["num_attention_heads"])
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    mats = [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (inter, hidden), (inter, hidden), (hidden, inter)]
    gen = torch.Generator().manual_seed(seed)
    model = nn.Module()
    model.layers = nn.ModuleList()
    for _ in range(cfg["num_hidden_layers"]):
        for rows, columns in mats:
            nb = columns // fmt.block_weights
            raw = torch.randint(0, 256, (rows, nb, fmt.block_bytes), dtype=torch.uint8, generator=gen)
            for offset, low, high in _SCALES[fmt.name]:  # raw: [rows, nb, block bytes]
                raw[:, :, offset:offset + 2] = torch.empty(rows, nb).uniform_(low, high, generator=gen) \
                    .half().view(torch.uint8).view(rows, nb, 2)
            layer = nn.Module()
            layer.quant = BlockWeight([(fmt, raw.view(rows, -1))], columns, None)
            model.layers.append(layer)
    return model


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
    ap.add_argument("--model", help="a GGUF file with block-quantized weights")
    ap.add_argument("--synthetic", choices=sorted(_SCALES), help="instead of --model: random valid blocks of this "
                    "format in --shape's linear layers (no LM head)")
    ap.add_argument("--shape", default="smollm2-1.7b", help="the shape of --synthetic (benchmarks/shapes.py; "
                    "default smollm2-1.7b)")
    ap.add_argument("--rows", default="1,512", help="activation rows per call, comma-separated (default 1,512)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch / OpenMP threads (default: all)")
    ap.add_argument("--repeats", type=int, default=3, help="passes per cell; the best counts (default 3)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if (args.model is None) == (args.synthetic is None):
        ap.error("give one of --model FILE.gguf and --synthetic FORMAT")

    from models.loader import load_model
    from models.quant.blocks import block_ops_available, block_weights, repack_block_weights

    torch.set_num_threads(args.threads)
    if not block_ops_available():
        raise SystemExit("the native block kernels do not load here")
    if args.synthetic:
        model, name = synthetic_model(args.shape, args.synthetic), f"{args.shape} {args.synthetic} (random blocks)"
    else:
        model, name = load_model(args.model, progress=False), args.model
    weights = block_weights(model)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{name}: {len(weights)} block weights, {sum(w.nbytes for w in weights) / 2**30:.2f} GiB, "
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
        args.out.write_text(json.dumps({"model": name, "threads": args.threads, "results": results}, indent=1))
    return 0
