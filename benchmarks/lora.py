"""Multi-LoRA decode throughput: one in-process Executor decoding a batch with no adapter, one adapter, and N
distinct adapters (sequence i on adapter i mod N), configurations interleaved round by round; random PEFT adapters made
with peft itself (reused from --adapter-dir). Method and columns: docs/benchmarks.md."""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.cli import (add_device_args, add_sizes, make_log, model_dir, parse, parser, set_threads,
                            torch_device)
from benchmarks.flops import FlopModel
from benchmarks.local_executor import TOKENS_ONLY, DecodeBatch, build_executor
from benchmarks.measure import Clock, machine_busy_s, other_cores, summarize
from benchmarks.report import format_table, machine_info, model_json, model_line, write_json
from benchmarks.workloads import kv_blocks, random_prompts
from executor_service.executor import Executor

ALL_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
QUICK = {"batch": 8, "steps": 3, "warmup": 1, "context": 16}
DEFAULTS = {"batch": 32, "steps": 16, "warmup": 2, "context": 128}
COLUMNS = [("config", "config"), ("adapters", "adapters"), ("batch", "batch"), ("ms_per_step", "ms/step"),
           ("min_ms", "min ms"), ("tok_s", "tok/s", 1), ("ratio_to_base", "xbase", 3),
           ("ratio_to_base_min", "xbase min", 3), ("ratio_to_base_cpu", "xbase cpu", 3),
           ("lora_gflop_per_step", "LoRA GFLOP", 3), ("lora_flop_pct", "LoRA %", 1),
           ("lora_flop_pct_all_adapters", "all-adapt %", 1), ("tokens_differ_from_base", "differ", 2)]
log = make_log("bench_lora")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = parser("lora", __doc__, "batch 8; steps 3; warmup 1; context 16")
    add_sizes(ap, DEFAULTS, {"batch": "sequences per decode call", "context": "prompt tokens per sequence",
                             "steps": "timed rounds (one decode call per configuration each)",
                             "warmup": "untimed rounds first"})
    ap.add_argument("--adapter-counts", default="0,1,4", help="distinct adapters per batch, one configuration each; "
                    "0 = base (default 0,1,4)")
    ap.add_argument("--num-adapters", type=int, default=None, help="adapters to create and load (default: the "
                    "largest of --adapter-counts)")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank r (default 16)")
    ap.add_argument("--alpha", type=float, default=32.0, help="lora_alpha (default 32)")
    ap.add_argument("--target-modules", default=ALL_TARGETS, help=f"modules the adapters target ({ALL_TARGETS})")
    ap.add_argument("--adapter-dir", type=Path, default=None, help="keep the adapters here and reuse matching ones "
                    "on later runs (default: a temporary directory)")
    add_device_args(ap)
    ap.add_argument("--max-batch-tokens", type=int, default=8192, help="the Executor's per-call token limit")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompts and adapter weights")
    args = parse(ap, argv, QUICK, DEFAULTS)
    try:
        args.count_list = [int(v) for v in args.adapter_counts.split(",") if v.strip()]
    except ValueError:
        ap.error(f"--adapter-counts: expected comma-separated integers, got {args.adapter_counts!r}")
    counts = args.count_list
    if not counts or min(counts) < 0 or len(set(counts)) != len(counts) or max(counts) > args.batch:
        ap.error("--adapter-counts: distinct integers >= 0, at most --batch")
    args.num_adapters = max(counts) if args.num_adapters is None else args.num_adapters
    args.target_list = [m.strip() for m in args.target_modules.split(",") if m.strip()]
    if args.num_adapters < max(counts) or not args.target_list or \
            min(args.batch, args.context, args.steps, args.rank) < 1:
        ap.error("--num-adapters >= the largest count; --batch, --context, --steps, --rank >= 1; a target module")
    return args


def adapter_name(i: int) -> str:
    return f"lora-{i}"


def _matches(path: Path, directory: Path, args: argparse.Namespace) -> bool:
    """A saved PEFT LoRA adapter with this run's rank, alpha, targets and base model."""
    try:
        cfg = json.loads((path / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return False
    return (any(path.glob("adapter_model.*")) and cfg.get("peft_type") == "LORA" and cfg.get("r") == args.rank
            and float(cfg.get("lora_alpha", -1)) == args.alpha
            and sorted(cfg.get("target_modules") or []) == sorted(args.target_list)
            and Path(str(cfg.get("base_model_name_or_path", ""))).resolve() == directory.resolve())


def make_adapters(directory: Path, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Creates (or reuses) args.num_adapters random adapters under root with peft (init_lora_weights=False: lora_B
    random too, so every adapter changes the outputs); returns what was created and how long it took."""
    paths = {adapter_name(i): root / adapter_name(i) for i in range(args.num_adapters)}
    todo = [n for n, p in paths.items() if not _matches(p, directory, args)]
    info: dict[str, Any] = {"root": str(root), "created": todo, "reused": [n for n in paths if n not in todo],
                            "total_s": 0.0}
    if not todo:
        return info
    t0 = time.perf_counter()
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    for name in todo:
        torch.manual_seed(args.seed * 1000 + int(name.split("-")[1]) + 1)
        model = get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=args.target_list,
                                                lora_dropout=0.0, bias="none", init_lora_weights=False,
                                                task_type="CAUSAL_LM"))
        shutil.rmtree(paths[name], ignore_errors=True)
        model.save_pretrained(paths[name])
        cfg_file = paths[name] / "adapter_config.json"  # record the base model as its directory (for reuse)
        cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()),
                                        "base_model_name_or_path": str(directory.resolve())}, indent=2))
        base = model.unload()  # the LoRA layers out again (no merge): the next adapter starts from the base
    info["total_s"] = time.perf_counter() - t0
    log(f"created {len(todo)} LoRA adapters (r={args.rank}) in {root} in {info['total_s']:.1f}s")
    return info


def lora_params(path: Path) -> int:
    """Parameters of an adapter's low-rank matrices, from its saved weights."""
    from safetensors import safe_open
    with safe_open(str(path / "adapter_model.safetensors"), framework="pt") as f:
        return sum(int(torch.tensor(f.get_slice(k).get_shape()).prod()) for k in f.keys())


class Config(DecodeBatch):
    """One configuration: B caches, each with its adapter (fixed at creation), and the tokens it sampled."""

    def __init__(self, ex: Executor, count: int, batch: int, device: torch.device) -> None:
        super().__init__(ex)
        self.count = count
        self.name = "base" if count == 0 else ("1 adapter" if count == 1 else f"{count} mixed")
        self.adapters = [adapter_name(i % count) if count else "" for i in range(batch)]
        self.history: list[list[int]] = []
        self.clock = Clock(device)

    def start(self, prompts: list[list[int]]) -> None:
        self.prefill(prompts, self.adapters)
        self.history = [[t] for t in self.tokens]

    def step(self) -> None:
        with self.clock:
            self.advance(self.ex.decode(self.decode_items(TOKENS_ONLY, self.adapters)))
        for h, t in zip(self.history, self.tokens):
            h.append(t)


def time_rounds(configs: list[Config], prompts: list[list[int]], args, device: torch.device) -> dict[str, Any]:
    """Prefills every configuration (untimed), then rounds of one decode call each, the order rotating per round
    so that a noisy machine slows all alike and none always follows the same one."""
    try:
        for c in configs:
            c.start(prompts)
        n = len(configs)
        for rnd in range(args.warmup + args.steps):
            if rnd == args.warmup:
                for c in configs:
                    c.clock = Clock(device)  # the warm-up calls are not kept
                busy0, wall0, cpu0 = machine_busy_s(), time.perf_counter(), time.process_time()
            for k in range(n):
                configs[(rnd + k) % n].step()
        busy1, wall1, cpu1 = machine_busy_s(), time.perf_counter(), time.process_time()
    finally:
        for c in configs:
            c.release()
    return {"other_processes_cores": other_cores(busy0, busy1, cpu1 - cpu0, wall1 - wall0),
            "timed_wall_s": wall1 - wall0}


def table_rows(configs: list[Config], args, lora_per_token: float, base_flops: float) -> list[dict[str, Any]]:
    base = next((c for c in configs if c.count == 0), None)
    rows = []
    for c in configs:
        wall, cpu = c.clock.times, c.clock.cpu_times
        med, cpu_med = statistics.median(wall), statistics.median(cpu)
        row: dict[str, Any] = {
            "config": c.name, "adapters": c.count, "batch": args.batch, "ms_per_step": 1e3 * med,
            "min_ms": 1e3 * min(wall), "tok_s": args.batch / med,
            "lora_gflop_per_step": lora_per_token * args.batch / 1e9 if c.count else 0.0,
            "lora_flop_pct": 100.0 * lora_per_token / base_flops if c.count else 0.0,
            # a stacked (masked) implementation projects every token onto every adapter of the batch
            "lora_flop_pct_all_adapters": 100.0 * lora_per_token * c.count / base_flops,
            "adapter_of_sequence": c.adapters, "times": summarize(wall, 1e3), "times_s": wall}
        if base is not None:
            row.update(ratio_to_base=statistics.median(base.clock.times) / med,
                       ratio_to_base_min=min(base.clock.times) / min(wall),
                       ratio_to_base_cpu=statistics.median(base.clock.cpu_times) / cpu_med if cpu_med > 0 else None)
            pairs = [(a, b) for hb, hc in zip(base.history, c.history) for a, b in zip(hb, hc)]
            row["tokens_differ_from_base"] = 1.0 - sum(a == b for a, b in pairs) / len(pairs) if pairs else None
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    device, directory = torch_device(args.device), model_dir(args.model).resolve()
    with tempfile.TemporaryDirectory(prefix="bench_lora_") as tmp:
        root = args.adapter_dir.resolve() if args.adapter_dir else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        creation = make_adapters(directory, root, args)
        per_seq = args.context + 1 + args.warmup + args.steps
        kv = kv_blocks(len(args.count_list) * args.batch, per_seq)  # every configuration's caches at once
        ex = build_executor(directory, args.device, args.dtype, kv, max(args.max_batch_tokens, args.context),
                            adapter_root=root, max_adapters_on_device=max(8, args.num_adapters),
                            max_lora_rank=max(64, args.rank))
        cfg = ex.model_config
        if per_seq > cfg.max_position_embeddings:
            raise SystemExit(f"error: {per_seq} tokens per sequence; the model takes {cfg.max_position_embeddings}")
        load_s = {}
        for i in range(args.num_adapters):
            t0 = time.perf_counter()
            ex.load_adapter(adapter_name(i), root / adapter_name(i))
            load_s[adapter_name(i)] = time.perf_counter() - t0
        configs = [Config(ex, count, args.batch, device) for count in args.count_list]
        load = time_rounds(configs, random_prompts(args.batch, args.context, cfg.vocab_size, args.seed).tolist(),
                           args, device)
        # per sampled token, each targeted linear adds x @ A^T (r x in) and @ B^T (out x r): 2 FLOPs per parameter
        params = [lora_params(root / adapter_name(i)) for i in range(args.num_adapters)]
        lora_per_token = 2.0 * statistics.fmean(params) if params else 0.0
        flops = FlopModel.from_executor(ex)
        rows = table_rows(configs, args, lora_per_token, flops.linear(1) + flops.lm_head(1))
    print(model_line(directory, cfg))
    print(f"device: {device}  dtype: {args.dtype}  threads: {torch.get_num_threads()}  batch {args.batch}, context "
          f"{args.context}, {args.steps} timed rounds after {args.warmup}; medians; adapters: {args.num_adapters} "
          f"random LoRA, r={args.rank}, alpha={args.alpha:g}\n")
    print(format_table(rows, COLUMNS))
    print("\nxbase: base median / configuration median (throughput ratio to base; min: fastest calls; cpu: process "
          "CPU time). LoRA %: the adapters' extra FLOPs over the base step's (all-adapt %: every token through all N "
          "adapters); differ: sampled tokens that differ from base (0 would mean the adapters are not applied).")
    if (load["other_processes_cores"] or 0) > 0.25:
        print(f"note: other processes kept {load['other_processes_cores']:.2f} cores busy while timing")
    payload = {"benchmark": "bench_lora", "model": model_json(directory, cfg), "machine": machine_info(device),
               "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()} | {"kv_blocks": kv},
               "load": load, "adapters": {"creation": creation, "load_adapter_s": load_s,
                                          "lora_flops_per_token": lora_per_token}, "rows": rows,
               "ratios": {r["config"]: r.get("ratio_to_base") for r in rows}}
    log(f"wrote {write_json(args.out, payload)}")
    return 0
