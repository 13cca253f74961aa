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
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import runtime
from benchmarks.cli import add_device_args, add_model_arg, add_out_args, make_log, parse_with_preset, parser
from benchmarks.cpu import loadavg, machine_busy_s, other_cores
from benchmarks.flops import FlopModel
from benchmarks.local_executor import TOKENS_ONLY, DecodeBatch, build_executor
from benchmarks.lora_adapters import adapter_name, lora_params, make_adapters
from benchmarks.lora_report import print_report, results_json
from benchmarks.measure import Clock, summarize
from benchmarks.report import write_json
from benchmarks.workloads import kv_blocks, random_prompts
from executor_service.executor import Executor

ALL_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
QUICK = {"batch": 8, "steps": 3, "warmup": 1, "context": 16}
DEFAULTS = {"batch": 32, "steps": 16, "warmup": 2, "context": 128}

log = make_log("bench_lora")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = parser(__doc__, epilog=__doc__.split("\n\n", 1)[1])
    add_model_arg(ap)
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
    add_device_args(ap)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: every usable core)")
    ap.add_argument("--max-batch-tokens", type=int, default=8192, help="the Executor's per-call token limit")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompts and adapter weights")
    add_out_args(ap, "bench_lora", "smoke run: batch 8; steps 3; warmup 1; context 16 (explicit flags still win)")
    args = parse_with_preset(ap, argv, QUICK, DEFAULTS)
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


class Config(DecodeBatch):
    """One configuration: B caches, each with its adapter, and the state to feed back."""

    def __init__(self, ex: Executor, count: int, batch: int, grouped: bool = False) -> None:
        super().__init__(ex)
        self.count = count
        self.grouped = grouped and count > 1
        self.name = "base" if count == 0 else ("1 adapter" if count == 1 else
                                               f"{count} {'grouped' if self.grouped else 'mixed'}")
        if self.grouped:  # consecutive runs of ~batch / count sequences per adapter
            self.adapters = [adapter_name(i * count // batch) for i in range(batch)]
        else:  # round-robin
            self.adapters = [adapter_name(i % count) if count else "" for i in range(batch)]
        self.history: list[list[int]] = []  # tokens sampled per sequence, prefill's first
        self.clock: Clock | None = None

    def prefill(self, prompts: list[list[int]]) -> None:
        super().prefill(prompts, self.adapters)
        self.history = [[t] for t in self.tokens]

    def step(self) -> None:
        with self.clock:
            self.advance(self.ex.decode(self.decode_items(TOKENS_ONLY, self.adapters)))
        for h, t in zip(self.history, self.tokens):
            h.append(t)


def layouts(args: argparse.Namespace) -> list[tuple[int, bool]]:
    """(adapters, grouped) of each configuration, in table order."""
    out = []
    for c in args.count_list:
        if c < 2 or args.layout in ("round-robin", "both"):
            out.append((c, False))
        if c >= 2 and args.layout in ("grouped", "both"):
            out.append((c, True))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runtime.set_threads(args.threads)
    device = runtime.torch_device(args.device)
    model_dir = runtime.model_dir(args.model).resolve()
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
        return run(args, model_dir, root, device, load_start)
    finally:
        if tmp is not None:
            tmp.cleanup()


def run(args: argparse.Namespace, model_dir: Path, root: Path, device: torch.device, load_start: float | None
        ) -> int:
    creation = make_adapters(model_dir, root, args, log)

    per_seq_tokens = args.context + 1 + args.warmup + args.steps
    specs = layouts(args)
    kv = kv_blocks(len(specs) * args.batch, per_seq_tokens)  # every configuration's caches at once
    t0 = time.perf_counter()
    ex = build_executor(model_dir, args.device, args.dtype, kv, max(args.max_batch_tokens, args.context),
                        adapter_root=root, max_adapters_on_device=args.max_adapters_on_device,
                        max_lora_rank=args.max_lora_rank)
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
    log(f"Executor loaded in {load_model_s:.1f}s (KV pool {kv} blocks); {args.num_adapters} adapters loaded "
        f"in {sum(load_adapter_s.values()):.2f}s")

    configs = [Config(ex, count, args.batch, grouped) for count, grouped in specs]
    prompts = random_prompts(args.batch, args.context, cfg.vocab_size, args.seed).tolist()
    prefill_s, load = time_rounds(configs, prompts, args, device)

    # LoRA cost model: per sampled token, each targeted linear adds x @ A^T (r x in) and @ B^T (out x r).
    flops = FlopModel.from_executor(ex)
    base_flops = flops.linear(1) + flops.lm_head(1)  # per sampled token of the base model
    adapter_params = {name: lora_params(root / name) for name in (adapter_name(i) for i in range(args.num_adapters))}
    lora_per_token = statistics.fmean(2.0 * p for p, _ in adapter_params.values()) if adapter_params else 0.0
    rows = table_rows(configs, args, lora_per_token, base_flops)
    verdict = target_verdict(configs, rows, args.target)

    print_report(args, rows, verdict, model_dir, cfg, device, creation, load_adapter_s, load_start, load)
    try:
        adapters_info = list(ex.info().adapters)
    except Exception:  # noqa: BLE001 - informational only
        adapters_info = None
    adapters = {"creation": creation, "load_adapter_s": load_adapter_s, "executor_adapters": adapters_info,
                "lora_params": {k: v[0] for k, v in adapter_params.items()},
                "lora_linear_layers": {k: v[1] for k, v in adapter_params.items()},
                "lora_flops_per_token": lora_per_token, "base_linear_flops_per_token": base_flops}
    path = write_json(args.out, results_json(args, model_dir, cfg, device, kv, load_start, load, adapters,
                                             load_model_s, prefill_s, rows, verdict))
    log(f"wrote {path}")
    return 0


def time_rounds(configs: list[Config], prompts: list[list[int]], args: argparse.Namespace, device: torch.device
                ) -> tuple[dict[str, float], dict[str, Any]]:
    """Prefills every configuration (untimed), then rounds of one decode call per configuration, the order
    rotating; returns the prefill seconds per configuration and the machine's load around the timed rounds."""
    prefill_s: dict[str, float] = {}
    try:
        for c in configs:
            t0 = time.perf_counter()
            c.prefill(prompts)
            prefill_s[c.name] = time.perf_counter() - t0
            c.clock = Clock(device)
        log(f"prefilled {args.batch} sequences of {args.context} tokens per configuration (untimed): "
            + ", ".join(f"{k} {v:.1f}s" for k, v in prefill_s.items()))
        n = len(configs)
        for rnd in range(args.warmup):
            for k in range(n):
                configs[(rnd + k) % n].step()
        for c in configs:
            c.clock = Clock(device)  # the warm-up calls are not kept
        load0, busy0, wall0, cpu0 = loadavg(), machine_busy_s(), time.perf_counter(), time.process_time()
        for rnd in range(args.steps):
            for k in range(n):
                configs[(args.warmup + rnd + k) % n].step()
        load1, busy1, wall1, cpu1 = loadavg(), machine_busy_s(), time.perf_counter(), time.process_time()
    finally:
        for c in configs:
            c.release()
    # Cores other processes kept busy during the timed rounds (machine busy time minus ours).
    others = other_cores(busy0, busy1, cpu1 - cpu0, wall1 - wall0)
    return prefill_s, {"loadavg_1m_timed": [load0, load1], "other_processes_cores": others,
                       "timed_wall_s": wall1 - wall0}


def table_rows(configs: list[Config], args: argparse.Namespace, lora_per_token: float, base_flops: float
               ) -> list[dict[str, Any]]:
    """One row per configuration: its step times, throughput, ratios to base and LoRA FLOP share."""
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
            "times": summarize(wall, 1e3), "cpu_times": summarize(cpu, 1e3), "times_s": wall,
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
    return rows


def target_verdict(configs: list[Config], rows: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """The mixed configuration with the most adapters (round-robin first) against --target; None without a
    base configuration or a mixed one."""
    base = next((c for c in configs if c.count == 0), None)
    mixed = max(configs, key=lambda c: (c.count, not c.grouped))
    mixed_row = rows[configs.index(mixed)]
    if base is None or mixed.count == 0:
        return None
    ratio = mixed_row["ratio_to_base"]
    return {"config": mixed.name, "adapters": mixed.count, "ratio_to_base": ratio, "target": target,
            "passed": ratio >= target,
            "ratio_to_base_min": mixed_row["ratio_to_base_min"],
            "ratio_to_base_cpu": mixed_row["ratio_to_base_cpu"]}
