"""The LoRA benchmark's output: the configurations' table with its notes and verdict, and the JSON payload."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import format_table, machine_info, model_json, model_line

COLUMNS = [("config", "config"), ("adapters", "adapters"), ("batch", "batch"), ("ms_per_step", "ms/step"),
           ("min_ms", "min ms"), ("tok_s", "tok/s", 1), ("ratio_to_base", "xbase", 3),
           ("ratio_to_base_min", "xbase min", 3), ("ratio_to_base_cpu", "xbase cpu", 3),
           ("lora_gflop_per_step", "LoRA GFLOP", 3), ("lora_flop_pct", "LoRA %", 1),
           ("lora_flop_pct_all_adapters", "all-adapt %", 1),
           ("tokens_differ_from_base", "differ", 2)]


def print_report(args: argparse.Namespace, rows: list[dict[str, Any]], verdict: dict[str, Any] | None,
                 model_dir: Path, cfg: Any, device: torch.device, creation: dict[str, Any],
                 load_adapter_s: dict[str, float], load_start: float | None, load: dict[str, Any]) -> None:
    """creation: make_adapters' record; load: the machine's load around the timed rounds."""
    load0, load1 = load["loadavg_1m_timed"]
    others = load["other_processes_cores"]
    print(model_line(model_dir, cfg))
    print(f"device: {device}  dtype: {args.dtype}  threads: {torch.get_num_threads()}  batch {args.batch}, context "
          f"{args.context}, {args.steps} timed rounds after {args.warmup}; medians")
    print(f"adapters: {args.num_adapters} random LoRA, r={args.rank}, alpha={args.alpha:g}, targets "
          f"{','.join(args.target_list)}; created in {creation['total_s']:.1f}s"
          + (f" (reused {len(creation['reused'])})" if creation["reused"] else "")
          + f"; load_adapter {sum(load_adapter_s.values()):.2f}s total")
    print(f"load average: {load_start} at start, {load0} / {load1} around the timed rounds"
          + (f"; other processes kept {others:.2f} cores busy" if others is not None else "") + "\n")
    print(format_table(rows, COLUMNS))
    print("\nxbase: base median / configuration median (throughput ratio); min: of the fastest calls; cpu: of the "
          "median process CPU time.\nLoRA %: the adapters' extra FLOPs over the base step's linear + LM-head FLOPs "
          "(each token through its own adapter; all-adapt %: through all N);\ndiffer: sampled tokens that differ "
          "from base.")
    if verdict is not None:
        print(f"\n{verdict['config']}: {verdict['ratio_to_base']:.3f} x base throughput (target >= {args.target:g}): "
              f"{'PASS' if verdict['passed'] else 'FAIL'}")
    if others is not None and others > 0.25:
        print(f"\nnote: other processes kept {others:.2f} cores busy while timing; absolute times are not the "
              "idle-machine ones (the interleaved ratios are less affected)")
    has_base = any(r["adapters"] == 0 for r in rows)
    if has_base and any(r["adapters"] and not r["tokens_differ_from_base"] for r in rows):
        print("\nnote: an adapter configuration sampled exactly the base tokens: are the adapters applied?")


def results_json(args: argparse.Namespace, model_dir: Path, cfg: Any, device: torch.device, kv_blocks: int,
                 load_start: float | None, load: dict[str, Any], adapters: dict[str, Any], load_model_s: float,
                 prefill_s: dict[str, float], rows: list[dict[str, Any]], verdict: dict[str, Any] | None
                 ) -> dict[str, Any]:
    return {
        "benchmark": "bench_lora",
        "model": model_json(model_dir, cfg),
        "machine": machine_info(device),
        "settings": {"batch": args.batch, "context": args.context, "steps": args.steps, "warmup": args.warmup,
                     "adapter_counts": args.count_list, "num_adapters": args.num_adapters, "rank": args.rank,
                     "alpha": args.alpha, "target_modules": args.target_list, "dtype": args.dtype,
                     "threads": torch.get_num_threads(), "seed": args.seed, "kv_blocks": kv_blocks,
                     "max_adapters_on_device": args.max_adapters_on_device, "max_lora_rank": args.max_lora_rank,
                     "layout": args.layout, "target_ratio": args.target, "quick": args.quick,
                     "order": "rounds of one decode call per configuration, order rotating per round",
                     "timed_region": "DecodeItems building + Executor.decode (1 step, greedy, TOKENS) + reading "
                                     "the tokens"},
        "load": {"loadavg_1m_start": load_start, **load},
        "adapters": adapters,
        "executor_load_s": load_model_s,
        "prefill_s": prefill_s,  # untimed setup, one wall-clock reading per configuration (not interleaved)
        "rows": rows,
        "ratios": {r["config"]: r.get("ratio_to_base") for r in rows},
        "verdict": verdict,
    }
