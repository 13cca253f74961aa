"""Serving workload in-process: Tandem's Executor driven as the scheduler packs steps (one unified_decode per step
under a token budget: decode tokens first, then prompt chunks) vs transformers' batched generate, same prompts and
weights, sides alternating per repeat. Method: docs/benchmarks.md."""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.baselines import generate_greedy, load_causal_lm
from benchmarks.cli import add_common, make_log, model_dir, parser
from benchmarks.local_executor import build_executor
from benchmarks.report import format_table, machine_info, write_json
from benchmarks.workloads import kv_blocks, random_prompts
from executor_service.executor import Executor
from executor_service.types import UnifiedItem

log = make_log("bench_step_profile")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = parser("step_profile", __doc__.split("\n\n")[0])
    add_common(ap, "step_profile", "8 requests of 16 + 8 tokens, 1 repeat", threads=False)
    ap.add_argument("--requests", type=int, default=32, help="requests (default 32)")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request (default 128)")
    ap.add_argument("--gen", type=int, default=64, help="generated tokens per request, the first from prefill (64)")
    ap.add_argument("--budget", type=int, default=2048, help="tokens per unified_decode call (scheduler budget, 2048)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per side after one warm-up (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-hf", action="store_true", help="Tandem only")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.prompt_len, args.gen, args.repeats = 8, 16, 8, 1
    return args


def tandem_serve(ex: Executor, prompts: list[list[int]], gen: int, budget: int) -> dict[str, Any]:
    """The workload to completion; step times (and kind) and every request's tokens."""
    n = len(prompts)
    cache: list[str | None] = [None] * n
    fed, out = [0] * n, [[] for _ in range(n)]  # prompt tokens written; tokens generated
    steps: list[tuple[str, float, int]] = []  # (kind, seconds, tokens in the call)
    while any(len(o) < gen for o in out):
        items, who = [], []
        for i in range(n):  # running decodes first: one token each
            if fed[i] == len(prompts[i]) and 0 < len(out[i]) < gen:
                items.append(UnifiedItem((out[i][-1],), cache[i], fed[i] + len(out[i]) - 1, True))
                who.append(i)
        room = budget - len(items)
        for i in range(n):  # then prompt chunks, first come first served
            if room > 0 and fed[i] < len(prompts[i]):
                part = prompts[i][fed[i]:fed[i] + room]
                items.append(UnifiedItem(tuple(part), cache[i], fed[i], fed[i] + len(part) == len(prompts[i])))
                who.append(i)
                room -= len(part)
        start = time.perf_counter()
        results = ex.unified_decode(items)
        elapsed = time.perf_counter() - start
        tokens = sum(len(it.token_ids) for it in items)
        steps.append(("decode" if tokens == len(items) else "prefill", elapsed, tokens))
        for i, it, res in zip(who, items, results):
            cache[i] = res.cache.cache_id
            if fed[i] < len(prompts[i]):
                fed[i] += len(it.token_ids)
            if res.output is not None:
                out[i].append(res.output.tokens[0].token_id)
    ex.release_cache([c for c in cache if c])
    dec = [s for k, s, _ in steps if k == "decode"]
    return {"tokens": out, "total_s": sum(s for _, s, _ in steps), "decode_steps": len(dec),
            "prefill_phase_s": sum(s for k, s, _ in steps if k == "prefill"), "decode_phase_s": sum(dec),
            "decode_step_median_ms": statistics.median(dec) * 1e3 if dec else None, "steps": steps}


def hf_generate(model: Any, input_ids: torch.Tensor, gen: int) -> tuple[float, list[list[int]]]:
    """transformers' generate of exactly `gen` tokens per prompt (EOS masked until then): (seconds, new ids)."""
    new, start, end = generate_greedy(model, input_ids, max_new_tokens=gen, min_new_tokens=gen, do_sample=False,
                                      temperature=None, top_p=None, top_k=None, pad_token_id=model.config.eos_token_id)
    return end - start, new


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    directory = model_dir(args.model)
    ex = build_executor(directory, "cpu", "float32", kv_blocks(args.requests, args.prompt_len + args.gen),
                        max(8192, args.budget))
    ids = random_prompts(args.requests, args.prompt_len, ex.model_config.vocab_size, args.seed)
    prompts = ids.tolist()
    hf = None if args.no_hf else load_causal_lm(directory, attn_implementation="sdpa")
    log(f"model {directory.name}, {args.threads} threads, {args.requests} x ({args.prompt_len} + {args.gen}), "
        f"budget {args.budget}")
    tandem_serve(ex, prompts[:4], 4, args.budget)  # warm up both sides
    if hf is not None:
        hf_generate(hf, ids[:4], 4)
    sides = ["tandem"] + (["hf"] if hf is not None else [])
    rows = []
    for rep in range(args.repeats):
        row: dict[str, Any] = {"repeat": rep}
        for side in (sides if rep % 2 == 0 else sides[::-1]):
            if side == "hf":
                row["hf_total_s"], h_tokens = hf_generate(hf, ids, args.gen)
                continue
            run = tandem_serve(ex, prompts, args.gen, args.budget)
            row.update({f"tandem_{k}": v for k, v in run.items() if k not in ("tokens", "steps")})
            t_tokens = run["tokens"]
        if hf is not None:
            row["hf_over_tandem"] = row["hf_total_s"] / row["tandem_total_s"]
            row["same_tokens"] = sum(a == b for a, b in zip(t_tokens, h_tokens))
        rows.append(row)
        log(f"repeat {rep}: tandem {row['tandem_total_s']:.2f}s" + (f", hf {row['hf_total_s']:.2f}s" if hf else ""))
    cols = [("repeat", "rep"), ("tandem_total_s", "tandem s"), ("tandem_prefill_phase_s", "prefill s"),
            ("tandem_decode_phase_s", "decode s"), ("tandem_decode_step_median_ms", "decode step ms", 1)]
    if hf is not None:
        cols += [("hf_total_s", "hf generate s"), ("hf_over_tandem", "hf/tandem", 3),
                 ("same_tokens", f"same tokens /{args.requests}")]
    print(format_table(rows, cols))
    summary = {k: statistics.median(r[k] for r in rows) for k in ("tandem_total_s", "tandem_decode_step_median_ms",
                                                                  "hf_over_tandem")
               if k in rows[0]}
    print("medians: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()) + "  (hf/tandem > 1: Tandem faster)")
    payload = {"benchmark": "bench_step_profile", "model": str(directory), "machine": machine_info("cpu"),
               "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "summary": summary, "rows": rows}
    log(f"wrote {write_json(args.out, payload)}")
    return 0
