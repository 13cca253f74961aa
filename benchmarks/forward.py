"""Forward-pass benchmark: Tandem's in-process Executor vs transformers, same model, inputs and run.

Phases (each configuration measures both sides, alternating their timed calls so that a noisy, shared
machine slows both alike; compare ratios from one run, not absolute numbers across runs):

- decode: B sequences, each first prefilled with --context random token ids (fixed seed). Tandem: one
  `Executor.decode()` call with B items per step (greedy, output mode TOKENS). transformers:
  `AutoModelForCausalLM` (sdpa attention) forward of a [B, 1] batch over its DynamicCache holding the same
  B x context prefix, then argmax of the logits (fed back, and copied to the host like Tandem's tokens).
  Median over --steps timed steps after --warmup untimed ones.
- prefill: B prompts of --prefill-len tokens. Tandem: `prefill` (B = 1) or one `unified_decode` with B
  items; transformers: one forward of [B, L] with a fresh DynamicCache, plus argmax of the last position.
  Row `prefill` is transformers' plain forward (LM head on every position); row `prefill/ltk1` passes
  `logits_to_keep=1` (LM head on the last position only, as Tandem does).

FLOPs (per side, what it actually computes): 2 x the weight parameters of every decoder layer's linear
layers per token (the embedding lookup is free), + 2 x hidden x vocab per LM-head row (Tandem: one row per
sequence; transformers prefill: every position unless logits_to_keep=1), + attention 4 x keys x head_dim x
heads per token per layer (decode: keys = cached context + 1; prefill: causal, i + 1 keys for query i).
Achieved GFLOP/s = FLOPs / median time; "% peak" divides by the fp32 (or --dtype) matmul GFLOP/s measured
in the same run (best of n x n @ n x n products, taken before and after the benchmark; the higher counts).

    python scripts/bench_forward.py                      # SmolLM2-135M-Instruct (prepared if needed)
    python scripts/bench_forward.py --quick --model /tmp/tiny-llama
    python scripts/bench_forward.py --batches 32 --profile-batch 32   # + torch.profiler of Tandem decode

Benchmark-only (needs transformers); never imported by the servers.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from benchmarks import runtime
from benchmarks.baselines import HfForward
from benchmarks.cli import (add_batch_args, add_device_args, add_model_arg, add_out_args, int_list, make_log, parser,
                            parse_with_preset)
from benchmarks.flops import FlopModel
from benchmarks.local_executor import TOKENS_ONLY, DecodeBatch, build_executor
from benchmarks.measure import Clock, measure_matmul_peak, time_stats
from benchmarks.report import format_table, machine_info, model_json, model_line, write_json
from benchmarks.workloads import kv_blocks, random_prompts, token_budget_groups
from executor_service.types import UnifiedItem

QUICK = {"batches": "1,8", "steps": 4, "warmup": 1, "context": 32, "prefill_len": 64, "prefill_batches": "1,4",
         "prefill_repeats": 1, "peak_n": 512, "peak_repeats": 3}
DEFAULTS = {"batches": "1,8,32,64", "steps": 16, "warmup": 2, "context": 128, "prefill_len": 512,
            "prefill_batches": "1,4", "prefill_repeats": 3, "peak_n": 2048, "peak_repeats": 7}

log = make_log("bench_forward")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = parser(__doc__)
    add_model_arg(ap)
    add_batch_args(ap, DEFAULTS)
    ap.add_argument("--steps", type=int, default=None, help=f"timed decode steps (default {DEFAULTS['steps']})")
    ap.add_argument("--warmup", type=int, default=None,
                    help=f"untimed decode steps first (default {DEFAULTS['warmup']})")
    ap.add_argument("--prefill-len", type=int, default=None,
                    help=f"prompt length of the prefill phase (default {DEFAULTS['prefill_len']}; 0 skips it)")
    ap.add_argument("--prefill-batches", default=None,
                    help=f"prefill batch sizes (default {DEFAULTS['prefill_batches']})")
    ap.add_argument("--prefill-repeats", type=int, default=None,
                    help=f"timed prefills per side and batch, after one untimed "
                         f"(default {DEFAULTS['prefill_repeats']})")
    add_device_args(ap)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: every usable core)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    ap.add_argument("--peak-n", type=int, default=None,
                    help=f"matmul size of the peak measurement (default {DEFAULTS['peak_n']})")
    ap.add_argument("--peak-repeats", type=int, default=None, help="timed matmuls per peak measurement")
    add_out_args(ap, "bench_forward",
                 "smoke run: batches 1,8; steps 4; context 32; prefill-len 64 (explicit flags still win)")
    ap.add_argument("--profile-batch", type=int, default=0,
                    help="after the benchmark, profile this many Tandem decode steps' ops at this batch size (0: off)")
    args = parse_with_preset(ap, argv, QUICK, DEFAULTS)
    args.batch_list = int_list(args.batches, "--batches")
    args.prefill_batch_list = int_list(args.prefill_batches, "--prefill-batches") if args.prefill_len > 0 else []
    if args.context < 1 or args.steps < 1 or args.warmup < 0 or args.prefill_repeats < 1:
        ap.error("--context and --steps and --prefill-repeats must be >= 1, --warmup >= 0")
    return args


class TandemSide(DecodeBatch):
    """The in-process Executor's side; each call returns (wall, cpu) seconds."""

    def prefill_many(self, prompts: list[list[int]]) -> tuple[float, float]:
        """Starts one cache per prompt, in calls of at most max_batch_tokens tokens (one call for the timed
        prefill phase: `prefill` for a single prompt, else `unified_decode`); returns the calls' seconds."""
        clock = Clock(self.ex.device)
        for group in token_budget_groups(prompts, self.ex.config.max_batch_tokens):
            with clock:
                if len(group) == 1:
                    res = self.ex.prefill(group[0], output=TOKENS_ONLY)
                    results = [res]
                else:
                    results = self.ex.unified_decode([UnifiedItem(tuple(p), output=TOKENS_ONLY) for p in group])
            self.add(results)
        return sum(clock.times), sum(clock.cpu_times)

    def decode_step(self) -> tuple[float, float]:
        items = self.decode_items()
        clock = Clock(self.ex.device)
        with clock:
            results = self.ex.decode(items)
        self.advance(results)
        return clock.times[0], clock.cpu_times[0]


def bench_decode(tandem: TandemSide, hf: HfForward, flops: FlopModel, batch: int, args) -> dict[str, Any]:
    prompts = random_prompts(batch, args.context, flops.vocab, args.seed + batch)
    tandem.prefill_many(prompts.tolist())
    hf.prefill(prompts.to(hf.device), logits_to_keep=1, keep=True)
    t_times, h_times = [], []
    try:
        for step in range(args.warmup + args.steps):
            if step % 2 == 0:  # alternate who goes first: neither always runs on the other's warm caches
                t = tandem.decode_step()
                h = hf.decode_step()
            else:
                h = hf.decode_step()
                t = tandem.decode_step()
            if step >= args.warmup:
                t_times.append(t)
                h_times.append(h)
    finally:
        tandem.release()
        hf.release()
    # Keys attended by the token written at position p: p + 1. Timed steps write positions
    # context + warmup ... context + warmup + steps - 1.
    keys = args.context + args.warmup + (args.steps + 1) / 2
    f = flops.decode_step(batch, keys)
    return row("decode", batch, args.context, batch, t_times, h_times, f, f, lm_rows_hf=batch, lm_rows_tandem=batch)


def bench_prefill(tandem: TandemSide, hf: HfForward, flops: FlopModel, batch: int, args) -> list[dict[str, Any]]:
    length = args.prefill_len
    prompts = random_prompts(batch, length, flops.vocab, args.seed + 1000 + batch)
    as_list, on_dev = prompts.tolist(), prompts.to(hf.device)
    t_times, full_times, ltk_times = [], [], []
    for rep in range(1 + args.prefill_repeats):  # the first round is warmup
        order = [0, 1, 2] if rep % 2 == 0 else [2, 1, 0]
        got = {}
        for which in order:
            if which == 0:
                got[0] = tandem.prefill_many(as_list)
                tandem.release()
            elif which == 1:
                got[1] = hf.prefill(on_dev, logits_to_keep=0)
            else:
                got[2] = hf.prefill(on_dev, logits_to_keep=1)
        if rep:
            t_times.append(got[0])
            full_times.append(got[1])
            ltk_times.append(got[2])
    t_flops = flops.prefill(batch, length, lm_rows=batch)
    return [row("prefill", batch, length, batch * length, t_times, full_times, t_flops,
                flops.prefill(batch, length, lm_rows=batch * length), lm_rows_hf=batch * length,
                lm_rows_tandem=batch),
            row("prefill/ltk1", batch, length, batch * length, t_times, ltk_times, t_flops, t_flops,
                lm_rows_hf=batch, lm_rows_tandem=batch)]


def row(phase: str, batch: int, context: int, tokens: int, t_meas: list[tuple[float, float]],
        h_meas: list[tuple[float, float]], t_flops: float, h_flops: float, lm_rows_hf: int,
        lm_rows_tandem: int) -> dict[str, Any]:
    """t_meas / h_meas: (wall, cpu) seconds per timed call. Times, ratios and rates use the wall-clock
    medians; the cpu columns (process CPU time, all threads) are a second view on a contended machine."""
    t_wall, t_cpu = [m[0] for m in t_meas], [m[1] for m in t_meas]
    h_wall, h_cpu = [m[0] for m in h_meas], [m[1] for m in h_meas]
    t, h = statistics.median(t_wall), statistics.median(h_wall)
    tc, hc = statistics.median(t_cpu), statistics.median(h_cpu)
    return {
        "phase": phase, "batch": batch, "context": context, "tokens_per_call": tokens,
        "tandem_ms": t * 1e3, "hf_ms": h * 1e3, "hf_over_tandem": h / t,
        "tandem_cpu_ms": tc * 1e3, "hf_cpu_ms": hc * 1e3, "hf_over_tandem_cpu": hc / tc if tc > 0 else None,
        "tandem_tok_s": tokens / t, "hf_tok_s": tokens / h,
        "tandem_gflop": t_flops / 1e9, "hf_gflop": h_flops / 1e9,
        "tandem_gflops": t_flops / t / 1e9, "hf_gflops": h_flops / h / 1e9,
        "tandem_lm_head_rows": lm_rows_tandem, "hf_lm_head_rows": lm_rows_hf,
        "tandem_times": time_stats(t_wall), "hf_times": time_stats(h_wall),
        "tandem_cpu_times": time_stats(t_cpu), "hf_cpu_times": time_stats(h_cpu),
    }


def profile_decode(tandem: TandemSide, flops: FlopModel, batch: int, args) -> str:
    from torch.profiler import ProfilerActivity, profile
    prompts = random_prompts(batch, args.context, flops.vocab, args.seed + batch)
    tandem.prefill_many(prompts.tolist())
    try:
        for _ in range(max(1, args.warmup)):
            tandem.decode_step()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if tandem.ex.device.type == "cuda" else [])
        steps = min(args.steps, 8)
        with profile(activities=activities) as prof:
            for _ in range(steps):
                tandem.decode_step()
    finally:
        tandem.release()
    sort = "self_cuda_time_total" if tandem.ex.device.type == "cuda" else "self_cpu_time_total"
    return f"torch.profiler: Tandem decode, batch {batch}, {steps} steps\n" + \
        prof.key_averages().table(sort_by=sort, row_limit=25)


COLUMNS = [("phase", "phase"), ("batch", "batch"), ("context", "ctx"), ("tandem_ms", "tandem ms"),
           ("hf_ms", "hf ms"), ("hf_over_tandem", "hf/tandem"), ("hf_over_tandem_cpu", "cpu hf/tandem"),
           ("tandem_tok_s", "tandem tok/s", 1),
           ("hf_tok_s", "hf tok/s", 1), ("tandem_gflops", "tandem GFLOP/s", 1),
           ("tandem_pct_peak", "tandem %peak", 1), ("hf_gflops", "hf GFLOP/s", 1), ("hf_pct_peak", "hf %peak", 1),
           ("hf_lm_head_rows", "hf lm-head rows")]


def main(argv: list[str] | None = None, flop_model: type[FlopModel] = FlopModel) -> int:
    """flop_model: how the loaded model's FLOPs are counted (the MoE benchmark counts routed experts)."""
    args = parse_args(argv)
    runtime.set_threads(args.threads)
    device = runtime.torch_device(args.device)
    dtype = runtime.DTYPES[args.dtype]
    model_dir = runtime.model_dir(args.model)
    log(f"model {model_dir}, device {device}, dtype {args.dtype}, {torch.get_num_threads()} threads")

    peak_before = measure_matmul_peak(device, dtype, n=args.peak_n, repeats=args.peak_repeats)
    log(f"matmul peak (before): {peak_before.gflops:.1f} GFLOP/s")

    max_b = max(args.batch_list + [args.profile_batch])
    decode_tokens = args.context + args.warmup + args.steps + 1
    kv = max([kv_blocks(max_b, decode_tokens)] + [kv_blocks(b, args.prefill_len) for b in args.prefill_batch_list])
    max_batch_tokens = max([8192, args.context] + [b * args.prefill_len for b in args.prefill_batch_list])
    t0 = time.perf_counter()
    ex = build_executor(model_dir, args.device, args.dtype, kv, max_batch_tokens)
    hf = HfForward(model_dir, device, dtype)
    log(f"loaded both models in {time.perf_counter() - t0:.1f}s; KV pool {kv} blocks")
    tandem = TandemSide(ex)
    flops = flop_model.from_executor(ex)

    rows: list[dict[str, Any]] = []
    for b in args.batch_list:
        t0 = time.perf_counter()
        rows.append(bench_decode(tandem, hf, flops, b, args))
        log(f"decode batch {b}: tandem {rows[-1]['tandem_ms']:.2f} ms, hf {rows[-1]['hf_ms']:.2f} ms "
            f"({time.perf_counter() - t0:.1f}s)")
    for b in args.prefill_batch_list:
        t0 = time.perf_counter()
        rows.extend(bench_prefill(tandem, hf, flops, b, args))
        log(f"prefill batch {b}: tandem {rows[-2]['tandem_ms']:.1f} ms, hf {rows[-2]['hf_ms']:.1f} ms, "
            f"hf ltk1 {rows[-1]['hf_ms']:.1f} ms ({time.perf_counter() - t0:.1f}s)")

    peak_after = measure_matmul_peak(device, dtype, n=args.peak_n, repeats=args.peak_repeats)
    peak = max(peak_before.gflops, peak_after.gflops)
    log(f"matmul peak (after): {peak_after.gflops:.1f} GFLOP/s")
    for r in rows:
        r["tandem_pct_peak"] = 100.0 * r["tandem_gflops"] / peak
        r["hf_pct_peak"] = 100.0 * r["hf_gflops"] / peak

    profile_text = profile_decode(tandem, flops, args.profile_batch, args) if args.profile_batch else None

    cfg = ex.model_config
    print(model_line(model_dir, cfg, heads=True))
    print(f"device: {device}  dtype: {args.dtype}  threads: {torch.get_num_threads()}  "
          f"{args.dtype} matmul peak: {peak:.1f} GFLOP/s (n={args.peak_n}; before {peak_before.gflops:.1f}, "
          f"after {peak_after.gflops:.1f})")
    print(f"decode: context {args.context}, {args.steps} timed steps after {args.warmup}; "
          f"prefill: {args.prefill_repeats} timed after 1 warmup; medians\n")
    print(format_table(rows, COLUMNS))
    print("\nhf/tandem > 1: Tandem is faster (wall-clock medians); cpu hf/tandem: the same from process CPU "
          "time (all threads), steadier when the machine is shared.")
    print("FLOPs: 2 x linear weights per token + 2 x hidden x vocab per LM-head "
          "row + attention 4 x keys x head_dim x heads per layer.")
    print("prefill: transformers' plain forward computes the LM head on every position (hf lm-head rows = B x L);"
          " prefill/ltk1: with logits_to_keep=1 (one row per sequence, like Tandem). Tandem always computes one "
          "row per sequence.")
    if profile_text:
        print("\n" + profile_text)

    payload = {
        "benchmark": "bench_forward",
        "model": {**model_json(model_dir, cfg, heads=True),
                  "layer_linear_params": flops.layer_params, "lm_head_params": flops.lm_head_params},
        "machine": machine_info(device),
        "settings": {"batches": args.batch_list, "context": args.context, "steps": args.steps,
                     "warmup": args.warmup, "prefill_len": args.prefill_len,
                     "prefill_batches": args.prefill_batch_list, "prefill_repeats": args.prefill_repeats,
                     "dtype": args.dtype, "seed": args.seed, "kv_blocks": kv, "quick": args.quick,
                     "hf_attn_implementation": "sdpa"},
        "peak": {"gflops": peak, "before": peak_before.as_dict(), "after": peak_after.as_dict()},
        "rows": rows,
    }
    if profile_text:
        payload["profile"] = profile_text
    path = write_json(args.out, payload)
    log(f"wrote {path}")
    return 0
