#!/usr/bin/env python
"""Multi-LoRA decode throughput: one in-process Executor decoding a batch with 0, 1 and N distinct adapters.

Adapters: --num-adapters (4) random PEFT LoRA adapters of the model, made with peft itself
(`get_peft_model(AutoModelForCausalLM.from_pretrained(model), LoraConfig(r=--rank, lora_alpha=--alpha,
target_modules=--target-modules, init_lora_weights=False))` + `save_pretrained`, a different torch seed
each; init_lora_weights=False makes lora_B random too, so every adapter really changes the outputs). They
are written to a temporary directory (deleted at exit) that is the Executor's adapter_root, or to
--adapter-dir, where adapters already present with the same rank / alpha / targets / base model are reused
(creation time is logged and kept in the JSON). Each adapter is loaded once with `Executor.load_adapter`.

Configurations, all at batch --batch (32) with --context (128) random prompt tokens per sequence (the same
prompts, fixed seed, in every configuration), on the same Executor:

- base:      no adapter on any sequence (adapter "");
- 1 adapter: every sequence on adapter lora-0;
- N mixed:   N distinct adapters assigned round-robin (sequence i -> lora-(i mod N); 8 each at 32 / 4),
             so each adapter's rows are scattered over the packed batch, as a scheduler's arbitrary order
             leaves them. --adapter-counts picks the list (default 0,1,4; 0 = base). --layout grouped gives
             each adapter B / N consecutive sequences instead (contiguous rows: 'N grouped'); --layout
             both times both layouts.

Method: every configuration's B caches are prefilled first (untimed, UnifiedDecode in calls of at most
--max-batch-tokens tokens, each item with the adapter it will decode with: a cache's adapter is fixed at
creation), so all of them are resident at once. Then rounds of single-step decode calls (greedy, output
mode TOKENS, all B sequences of one configuration per call, the sampled token fed back): each round runs
one call of every configuration, the order rotating from round to round (a,b,c / b,c,a / c,a,b ...), so
a noisy, shared machine slows all configurations alike and none always follows the same one. --warmup
untimed rounds, then --steps timed rounds. A timed call covers building the B DecodeItems +
`Executor.decode(items)` + reading the sampled tokens.

Columns: ms/step = median call time (min: fastest call); tok/s = B / median; xbase = base median /
configuration median (throughput ratio to base, 1.0 = no adapter cost); xbase min = the same from the
fastest calls; xbase cpu = from median process CPU time (steadier when other jobs share the machine);
LoRA GFLOP = the adapters' extra matmul FLOPs per step (2 x (r x in + out x r) per targeted linear per
token, each token through its own adapter), LoRA % = their share of the base step's linear + LM-head
FLOPs; all-adapt % = the same if every token is projected through all N adapters of its batch (what a
stacked / masked implementation executes); differ = fraction of sampled tokens that differ from the
base configuration's (prefill token included; 0 would mean the adapters are not applied). The mixed
configuration with the most adapters (round-robin when timed) is checked against --target (0.8 x base
throughput): PASS / FAIL (the exit status stays 0: timings on a shared machine are not a test). Compare
ratios within a run, not absolute times across runs; the JSON records the load average, the cores other
processes kept busy during the timed rounds, and each configuration's (untimed) prefill time.

    python scripts/bench_lora.py                                  # SmolLM2-135M-Instruct (prepared if needed)
    python scripts/bench_lora.py --quick --model /tmp/tiny-llama
    python scripts/bench_lora.py --adapter-dir /tmp/lora-adapters --layout both   # keep/reuse the adapters
    python scripts/bench_lora.py --rank 8 --target-modules q_proj,v_proj --adapter-counts 0,1,2,4,8

Benchmark-only (needs peft + transformers to create adapters); never imported by the servers.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
for p in (str(ROOT), str(SCRIPTS)):
    if p not in sys.path:
        sys.path.insert(0, p)

import bench_common as bc  # noqa: E402
from executor_service.config import ExecutorConfig  # noqa: E402
from executor_service.executor import Executor  # noqa: E402
from executor_service.types import CacheRef, DecodeItem, OutputMode, OutputOptions, UnifiedItem  # noqa: E402
from models.kv_cache import DEFAULT_BLOCK_SIZE  # noqa: E402

TOKENS_ONLY = OutputOptions(OutputMode.TOKENS)
ALL_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
ADAPTER_PREFIX = "lora-"
QUICK = {"batch": 8, "steps": 3, "warmup": 1, "context": 16}
DEFAULTS = {"batch": 32, "steps": 16, "warmup": 2, "context": 128}


def log(msg: str) -> None:
    print(f"[bench_lora] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None,
                    help="HF model directory (default: SmolLM2-135M-Instruct via scripts/prepare_default_model.py)")
    ap.add_argument("--batch", type=int, default=None, help=f"sequences per decode call (default {DEFAULTS['batch']})")
    ap.add_argument("--context", type=int, default=None,
                    help=f"prompt tokens per sequence before decoding (default {DEFAULTS['context']})")
    ap.add_argument("--steps", type=int, default=None,
                    help=f"timed rounds (one decode call per configuration each; default {DEFAULTS['steps']})")
    ap.add_argument("--warmup", type=int, default=None, help=f"untimed rounds first (default {DEFAULTS['warmup']})")
    ap.add_argument("--adapter-counts", default="0,1,4",
                    help="distinct adapters per batch, one configuration each; 0 = base (default 0,1,4)")
    ap.add_argument("--layout", choices=("round-robin", "grouped", "both"), default="round-robin",
                    help="how a mixed batch's sequences take their adapters: round-robin (sequence i -> adapter "
                         "i mod N: each adapter's rows scattered), grouped (B/N consecutive sequences each: "
                         "contiguous rows), or both (an extra 'N grouped' row per mixed count; default "
                         "round-robin)")
    ap.add_argument("--num-adapters", type=int, default=None,
                    help="adapters to create and load (default: the largest of --adapter-counts)")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank r (default 16)")
    ap.add_argument("--alpha", type=float, default=32.0, help="lora_alpha (default 32)")
    ap.add_argument("--target-modules", default=ALL_TARGETS,
                    help=f"comma-separated module names the adapters target (default {ALL_TARGETS})")
    ap.add_argument("--adapter-dir", type=Path, default=None,
                    help="keep the adapters here and reuse matching ones on later runs (default: a temporary "
                         "directory deleted at exit)")
    ap.add_argument("--max-adapters-on-device", type=int, default=None,
                    help="ExecutorConfig.max_adapters_on_device (default max(8, --num-adapters))")
    ap.add_argument("--max-lora-rank", type=int, default=None,
                    help="ExecutorConfig.max_lora_rank (default max(64, --rank))")
    ap.add_argument("--target", type=float, default=0.8,
                    help="minimum throughput ratio to base of the most-mixed configuration (default 0.8)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="default cpu")
    ap.add_argument("--dtype", default="float32", choices=sorted(bc.DTYPES), help="default float32")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: every usable core)")
    ap.add_argument("--max-batch-tokens", type=int, default=8192, help="the Executor's per-call token limit")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompts and adapter weights")
    ap.add_argument("--out", type=Path, default=Path("bench_results/bench_lora.json"), help="JSON results file")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: batch 8; steps 3; warmup 1; context 16 (explicit flags still win)")
    args = ap.parse_args(argv)
    preset = QUICK if args.quick else DEFAULTS
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    try:
        counts = [int(v) for v in args.adapter_counts.split(",") if v.strip()]
    except ValueError:
        ap.error(f"--adapter-counts: expected comma-separated integers, got {args.adapter_counts!r}")
    if not counts or any(c < 0 for c in counts) or len(set(counts)) != len(counts):
        ap.error("--adapter-counts: distinct integers >= 0")
    args.count_list = counts
    if args.num_adapters is None:
        args.num_adapters = max(counts)
    if args.num_adapters < max(counts):
        ap.error(f"--num-adapters {args.num_adapters} < the largest --adapter-counts {max(counts)}")
    if max(counts) > args.batch:
        ap.error(f"--adapter-counts: at most --batch ({args.batch}) distinct adapters per batch")
    if args.batch < 1 or args.context < 1 or args.steps < 1 or args.warmup < 0 or args.rank < 1:
        ap.error("--batch, --context, --steps and --rank must be >= 1, --warmup >= 0")
    args.target_list = [m.strip() for m in args.target_modules.split(",") if m.strip()]
    if not args.target_list:
        ap.error("--target-modules: at least one module name")
    if args.max_adapters_on_device is None:
        args.max_adapters_on_device = max(8, args.num_adapters)
    if args.max_lora_rank is None:
        args.max_lora_rank = max(64, args.rank)
    return args


# ------------------------------------------------------------------------------------------- adapters
def adapter_name(i: int) -> str:
    return f"{ADAPTER_PREFIX}{i}"


def _matches(path: Path, model_dir: Path, args: argparse.Namespace) -> bool:
    """True when path holds a saved PEFT LoRA adapter with this run's rank, alpha, targets and base model."""
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file() or not any(path.glob("adapter_model.*")):
        return False
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError):
        return False
    return (cfg.get("peft_type") == "LORA" and cfg.get("r") == args.rank
            and float(cfg.get("lora_alpha", -1)) == float(args.alpha)
            and sorted(cfg.get("target_modules") or []) == sorted(args.target_list)
            and Path(str(cfg.get("base_model_name_or_path", ""))).resolve() == model_dir.resolve())


def make_adapters(model_dir: Path, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Creates (or reuses) args.num_adapters random LoRA adapters under root; returns timing info."""
    paths = {adapter_name(i): root / adapter_name(i) for i in range(args.num_adapters)}
    todo = [name for name, path in paths.items() if not _matches(path, model_dir, args)]
    info: dict[str, Any] = {"root": str(root), "paths": {k: str(v) for k, v in paths.items()},
                            "created": todo, "reused": [n for n in paths if n not in todo],
                            "import_s": None, "base_load_s": None, "per_adapter_s": {}, "total_s": 0.0}
    if not todo:
        log(f"reusing {len(paths)} adapters from {root}")
        return info
    t_total = time.perf_counter()
    t0 = time.perf_counter()
    import warnings

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)  # peft calls deprecated transformers helpers
    info["import_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    info["base_load_s"] = time.perf_counter() - t0
    for name in todo:
        t0 = time.perf_counter()
        torch.manual_seed(args.seed * 1000 + int(name.removeprefix(ADAPTER_PREFIX)) + 1)
        config = LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=list(args.target_list),
                            lora_dropout=0.0, bias="none", init_lora_weights=False, task_type="CAUSAL_LM")
        peft_model = get_peft_model(base, config)
        path = paths[name]
        if path.exists():
            shutil.rmtree(path)
        peft_model.save_pretrained(path)
        # Record the base model as the directory it came from (peft writes name_or_path), then take the
        # LoRA layers out again (unload: no merge) so the next adapter starts from the plain base model.
        cfg_file = path / "adapter_config.json"
        cfg = json.loads(cfg_file.read_text())
        cfg["base_model_name_or_path"] = str(model_dir.resolve())
        cfg_file.write_text(json.dumps(cfg, indent=2) + "\n")
        base = peft_model.unload()
        info["per_adapter_s"][name] = time.perf_counter() - t0
    del base
    info["total_s"] = time.perf_counter() - t_total
    log(f"created {len(todo)} LoRA adapters (r={args.rank}, alpha={args.alpha:g}, {len(args.target_list)} target "
        f"modules) in {root} in {info['total_s']:.1f}s (peft/transformers import {info['import_s']:.1f}s, base "
        f"model load {info['base_load_s']:.1f}s, per adapter "
        f"{statistics.fmean(info['per_adapter_s'].values()):.2f}s)")
    return info


def lora_params(path: Path) -> tuple[int, int]:
    """(parameters of the adapter's LoRA matrices, targeted linear layers) from its saved weights."""
    from safetensors import safe_open
    files = sorted(path.glob("adapter_model.safetensors"))
    if not files:
        return 0, 0
    total, layers = 0, 0
    with safe_open(str(files[0]), framework="pt") as f:
        for key in f.keys():
            shape = f.get_slice(key).get_shape()
            n = 1
            for d in shape:
                n *= d
            total += n
            layers += "lora_A" in key
    return total, layers


# ------------------------------------------------------------------------------------------ workload
class Config:
    """One configuration: B caches, each with its adapter, and the state to feed back."""

    def __init__(self, count: int, batch: int, grouped: bool = False) -> None:
        self.count = count
        self.grouped = grouped and count > 1
        self.name = "base" if count == 0 else ("1 adapter" if count == 1 else
                                               f"{count} {'grouped' if self.grouped else 'mixed'}")
        if self.grouped:  # consecutive runs of ~batch / count sequences per adapter
            self.adapters = [adapter_name(i * count // batch) for i in range(batch)]
        else:  # round-robin
            self.adapters = [adapter_name(i % count) if count else "" for i in range(batch)]
        self.caches: list[str] = []
        self.lengths: list[int] = []
        self.tokens: list[int] = []
        self.history: list[list[int]] = []  # tokens sampled per sequence, prefill's first
        self.clock: bc.Clock | None = None

    def prefill(self, ex: Executor, prompts: list[list[int]], max_tokens: int) -> None:
        groups: list[list[int]] = [[]]
        size = 0
        for i, p in enumerate(prompts):
            if groups[-1] and size + len(p) > max_tokens:
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += len(p)
        for group in groups:
            out = ex.unified_decode([UnifiedItem(tuple(prompts[i]), output=TOKENS_ONLY, adapter=self.adapters[i])
                                     for i in group])
            for r in out:
                self.caches.append(r.cache.cache_id)
                self.lengths.append(r.cache.seq_len)
                self.tokens.append(r.output.tokens[0].token_id)
        self.history = [[t] for t in self.tokens]

    def step(self, ex: Executor) -> None:
        clock = self.clock
        with clock:
            items = [DecodeItem(CacheRef(c, n), t, output=TOKENS_ONLY, adapter=a)
                     for c, n, t, a in zip(self.caches, self.lengths, self.tokens, self.adapters)]
            results = ex.decode(items)
            self.lengths = [r.cache.seq_len for r in results]
            self.tokens = [r.output.tokens[0].token_id for r in results]
        for h, t in zip(self.history, self.tokens):
            h.append(t)

    def release(self, ex: Executor) -> None:
        if self.caches:
            ex.release_cache(self.caches)
        self.caches = []


def make_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    low = min(3, vocab - 1)  # skip the usual special ids (pad/bos/eos)
    return torch.randint(low, vocab, (batch, length), generator=gen).tolist()


def linear_flops_per_token(ex: Executor) -> float:
    """2 x every decoder-layer linear weight + 2 x the LM head, per sampled token (base model)."""
    layer = sum(m.weight.numel() for m in ex.model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    return 2.0 * (layer + ex.model.lm_head.weight.numel())


def loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------- main
COLUMNS = [("config", "config"), ("adapters", "adapters"), ("batch", "batch"), ("ms_per_step", "ms/step"),
           ("min_ms", "min ms"), ("tok_s", "tok/s", 1), ("ratio_to_base", "xbase", 3),
           ("ratio_to_base_min", "xbase min", 3), ("ratio_to_base_cpu", "xbase cpu", 3),
           ("lora_gflop_per_step", "LoRA GFLOP", 3), ("lora_flop_pct", "LoRA %", 1),
           ("lora_flop_pct_all_adapters", "all-adapt %", 1),
           ("tokens_differ_from_base", "differ", 2)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = args.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    torch.set_num_threads(max(1, threads))
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    model_dir = (Path(args.model) if args.model else bc.default_model_dir()).resolve()
    load_start = loadavg()
    log(f"model {model_dir}, device {device}, dtype {args.dtype}, {torch.get_num_threads()} threads, "
        f"load average {load_start}")

    tmp: tempfile.TemporaryDirectory | None = None
    if args.adapter_dir is not None:
        root = args.adapter_dir.resolve()
        root.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="bench_lora_")
        root = Path(tmp.name)
    try:
        return run(args, model_dir, root, device, threads, load_start)
    finally:
        if tmp is not None:
            tmp.cleanup()


def run(args: argparse.Namespace, model_dir: Path, root: Path, device: torch.device, threads: int,
        load_start: float | None) -> int:
    creation = make_adapters(model_dir, root, args)

    per_seq_tokens = args.context + 1 + args.warmup + args.steps
    per_seq_blocks = -(-per_seq_tokens // DEFAULT_BLOCK_SIZE)
    configs = []
    for c in args.count_list:
        if c < 2 or args.layout in ("round-robin", "both"):
            configs.append(Config(c, args.batch))
        if c >= 2 and args.layout in ("grouped", "both"):
            configs.append(Config(c, args.batch, grouped=True))
    kv_blocks = len(configs) * args.batch * per_seq_blocks + 16  # every configuration's caches at once + slack
    t0 = time.perf_counter()
    ex = Executor(ExecutorConfig(model_dir, device=args.device, dtype=args.dtype, kv_blocks=kv_blocks,
                                 max_batch_tokens=max(args.max_batch_tokens, args.context), progress=False,
                                 adapter_root=root, max_adapters_on_device=args.max_adapters_on_device,
                                 max_lora_rank=args.max_lora_rank))
    load_model_s = time.perf_counter() - t0
    cfg = ex.model_config
    if per_seq_tokens > cfg.max_position_embeddings:
        raise SystemExit(f"error: --context {args.context} + 1 + --warmup {args.warmup} + --steps {args.steps} = "
                         f"{per_seq_tokens} tokens per sequence; the model takes at most "
                         f"{cfg.max_position_embeddings}")
    load_adapter_s: dict[str, float] = {}
    for i in range(args.num_adapters):
        name = adapter_name(i)
        t0 = time.perf_counter()
        ex.load_adapter(name, root / name)
        load_adapter_s[name] = time.perf_counter() - t0
    log(f"Executor loaded in {load_model_s:.1f}s (KV pool {kv_blocks} blocks); {args.num_adapters} adapters loaded "
        f"in {sum(load_adapter_s.values()):.2f}s")

    prompts = make_prompts(args.batch, args.context, cfg.vocab_size, args.seed)
    max_tokens = max(args.max_batch_tokens, args.context)
    prefill_s: dict[str, float] = {}
    try:
        for c in configs:
            t0 = time.perf_counter()
            c.prefill(ex, prompts, max_tokens)
            prefill_s[c.name] = time.perf_counter() - t0
            c.clock = bc.Clock(device)
        log(f"prefilled {args.batch} sequences of {args.context} tokens per configuration (untimed): "
            + ", ".join(f"{k} {v:.1f}s" for k, v in prefill_s.items()))
        n = len(configs)
        for rnd in range(args.warmup):
            for k in range(n):
                configs[(rnd + k) % n].step(ex)
        for c in configs:
            c.clock = bc.Clock(device)  # the warm-up calls are not kept
        load0, busy0, wall0, cpu0 = loadavg(), bc.machine_busy_s(), time.perf_counter(), time.process_time()
        for rnd in range(args.steps):
            for k in range(n):
                configs[(args.warmup + rnd + k) % n].step(ex)
        load1, busy1, wall1, cpu1 = loadavg(), bc.machine_busy_s(), time.perf_counter(), time.process_time()
    finally:
        for c in configs:
            c.release(ex)
    # Cores other processes kept busy during the timed rounds (machine busy time minus ours); /proc counts
    # 10 ms ticks, too coarse for windows under 2 s.
    others = None if busy0 is None or busy1 is None or wall1 - wall0 < 2.0 else \
        max(0.0, (busy1 - busy0 - (cpu1 - cpu0)) / (wall1 - wall0))

    # LoRA cost model: per sampled token, each targeted linear adds x @ A^T (r x in) and @ B^T (out x r).
    base_flops = linear_flops_per_token(ex)
    adapter_params = {name: lora_params(root / name) for name in (adapter_name(i) for i in range(args.num_adapters))}
    lora_per_token = statistics.fmean(2.0 * p for p, _ in adapter_params.values()) if adapter_params else 0.0

    base = next((c for c in configs if c.count == 0), None)
    rows: list[dict[str, Any]] = []
    for c in configs:
        wall, cpu = c.clock.times, c.clock.cpu_times
        med, cpu_med = statistics.median(wall), statistics.median(cpu)
        row: dict[str, Any] = {
            "config": c.name, "adapters": c.count, "batch": args.batch, "context": args.context,
            "layout": ("grouped" if c.grouped else "round-robin") if c.count > 1 else None,
            "ms_per_step": 1e3 * med, "min_ms": 1e3 * min(wall), "cpu_ms_per_step": 1e3 * cpu_med,
            "tok_s": args.batch / med, "tok_s_best": args.batch / min(wall),
            "lora_gflop_per_step": (lora_per_token * args.batch / 1e9) if c.count else 0.0,
            "lora_flop_pct": (100.0 * lora_per_token / base_flops) if c.count else 0.0,
            # A stacked (masked) implementation projects every token onto every adapter of the batch:
            "lora_flop_pct_all_adapters": (100.0 * lora_per_token * c.count / base_flops),
            "adapter_of_sequence": c.adapters,
            "times": bc.summarize(wall, 1e3), "cpu_times": bc.summarize(cpu, 1e3), "times_s": wall,
        }
        if base is not None:
            bw, bcpu = base.clock.times, base.clock.cpu_times
            row["ratio_to_base"] = statistics.median(bw) / med
            row["ratio_to_base_min"] = min(bw) / min(wall)
            row["ratio_to_base_cpu"] = statistics.median(bcpu) / cpu_med if cpu_med > 0 else None
            same = total = 0
            for hb, hc in zip(base.history, c.history):
                same += sum(a == b for a, b in zip(hb, hc))
                total += min(len(hb), len(hc))
            row["tokens_differ_from_base"] = 1.0 - same / total if total else None
        rows.append(row)

    mixed = max(configs, key=lambda c: (c.count, not c.grouped))  # the most adapters; round-robin first
    mixed_row = rows[configs.index(mixed)]
    verdict: dict[str, Any] | None = None
    if base is not None and mixed.count > 0:
        ratio = mixed_row["ratio_to_base"]
        verdict = {"config": mixed.name, "adapters": mixed.count, "ratio_to_base": ratio, "target": args.target,
                   "passed": ratio >= args.target,
                   "ratio_to_base_min": mixed_row["ratio_to_base_min"],
                   "ratio_to_base_cpu": mixed_row["ratio_to_base_cpu"]}

    print(f"model: {model_dir.name}  ({cfg.architecture}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"vocab {cfg.vocab_size})")
    print(f"device: {device}  dtype: {args.dtype}  threads: {torch.get_num_threads()}  batch {args.batch}, context "
          f"{args.context}, {args.steps} timed rounds after {args.warmup}; medians")
    print(f"adapters: {args.num_adapters} random LoRA, r={args.rank}, alpha={args.alpha:g}, targets "
          f"{','.join(args.target_list)}; created in {creation['total_s']:.1f}s"
          + (f" (reused {len(creation['reused'])})" if creation["reused"] else "")
          + f"; load_adapter {sum(load_adapter_s.values()):.2f}s total")
    print(f"load average: {load_start} at start, {load0} / {load1} around the timed rounds"
          + (f"; other processes kept {others:.2f} cores busy" if others is not None else "") + "\n")
    print(bc.format_table(rows, COLUMNS))
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
    if base is not None and any(r["adapters"] and not r["tokens_differ_from_base"] for r in rows):
        print("\nnote: an adapter configuration sampled exactly the base tokens: are the adapters applied?")

    try:
        adapters_info = list(ex.info().adapters)
    except Exception:  # noqa: BLE001 - informational only
        adapters_info = None
    payload = {
        "benchmark": "bench_lora",
        "model": {"dir": str(model_dir), "name": model_dir.name, "architecture": cfg.architecture,
                  "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size},
        "machine": bc.machine_info(device),
        "settings": {"batch": args.batch, "context": args.context, "steps": args.steps, "warmup": args.warmup,
                     "adapter_counts": args.count_list, "num_adapters": args.num_adapters, "rank": args.rank,
                     "alpha": args.alpha, "target_modules": args.target_list, "dtype": args.dtype,
                     "threads": torch.get_num_threads(), "seed": args.seed, "kv_blocks": kv_blocks,
                     "max_adapters_on_device": args.max_adapters_on_device, "max_lora_rank": args.max_lora_rank,
                     "layout": args.layout, "target_ratio": args.target, "quick": args.quick,
                     "order": "rounds of one decode call per configuration, order rotating per round",
                     "timed_region": "DecodeItems building + Executor.decode (1 step, greedy, TOKENS) + reading "
                                     "the tokens"},
        "load": {"loadavg_1m_start": load_start, "loadavg_1m_timed": [load0, load1],
                 "other_processes_cores": others, "timed_wall_s": wall1 - wall0},
        "adapters": {"creation": creation, "load_adapter_s": load_adapter_s, "executor_adapters": adapters_info,
                     "lora_params": {k: v[0] for k, v in adapter_params.items()},
                     "lora_linear_layers": {k: v[1] for k, v in adapter_params.items()},
                     "lora_flops_per_token": lora_per_token, "base_linear_flops_per_token": base_flops},
        "executor_load_s": load_model_s,
        "prefill_s": prefill_s,  # untimed setup, one wall-clock reading per configuration (not interleaved)
        "rows": rows,
        "ratios": {r["config"]: r.get("ratio_to_base") for r in rows},
        "verdict": verdict,
    }
    path = bc.write_json(args.out, payload)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
