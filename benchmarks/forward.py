"""Forward-pass benchmark: Tandem's in-process Executor vs transformers' forward, same model, inputs and run
(decode steps of B sequences and prefills; timed calls alternate sides). Method: docs/benchmarks.md."""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from benchmarks.baselines import HfForward
from benchmarks.cli import (DTYPES, add_device_args, add_sizes, int_list, make_log, model_dir, parse,
                            parser, set_threads, torch_device)
from benchmarks.flops import FlopModel
from benchmarks.local_executor import TOKENS_ONLY, DecodeBatch, build_executor
from benchmarks.measure import Clock, matmul_peak, time_stats
from benchmarks.report import format_table, machine_info, model_json, model_line, write_json
from benchmarks.workloads import kv_blocks, random_prompts, token_budget_groups
from executor_service.types import UnifiedItem

QUICK = {"batches": "1,8", "steps": 4, "warmup": 1, "context": 32, "prefill_len": 64, "prefill_batches": "1,4",
         "prefill_repeats": 1, "peak_n": 512, "peak_repeats": 3}
DEFAULTS = {"batches": "1,8,32,64", "steps": 16, "warmup": 2, "context": 128, "prefill_len": 512,
            "prefill_batches": "1,4", "prefill_repeats": 3, "peak_n": 2048, "peak_repeats": 7}
COLUMNS = [("phase", "phase"), ("batch", "batch"), ("context", "ctx"), ("tandem_ms", "tandem ms"), ("hf_ms", "hf ms"),
           ("hf_over_tandem", "hf/tandem"), ("hf_over_tandem_cpu", "cpu hf/tandem"),
           ("tandem_tok_s", "tandem tok/s", 1), ("hf_tok_s", "hf tok/s", 1), ("tandem_gflops", "tandem GFLOP/s", 1),
           ("tandem_pct_peak", "tandem %peak", 1),
           ("hf_gflops", "hf GFLOP/s", 1), ("hf_pct_peak", "hf %peak", 1), ("hf_lm_head_rows", "hf lm-head rows")]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = parser("forward", __doc__, "batches 1,8; steps 4; context 32; prefill-len 64")
    add_sizes(ap, DEFAULTS, {"batches": "decode batch sizes", "context": "tokens per sequence before decoding",
                             "steps": "timed decode steps", "warmup": "untimed decode steps first",
                             "prefill-len": "prompt length of the prefill phase (0 skips it)",
                             "prefill-batches": "prefill batch sizes",
                             "prefill-repeats": "timed prefills per side and batch, after one untimed",
                             "peak-n": "matmul size of the peak measurement",
                             "peak-repeats": "timed matmuls per peak measurement"})
    add_device_args(ap)
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    args = parse(ap, argv, QUICK, DEFAULTS)
    args.batch_list = int_list(args.batches, "--batches")
    args.prefill_batch_list = int_list(args.prefill_batches, "--prefill-batches") if args.prefill_len > 0 else []
    if args.context < 1 or args.steps < 1 or args.warmup < 0 or args.prefill_repeats < 1:
        ap.error("--context, --steps and --prefill-repeats must be >= 1, --warmup >= 0")
    return args


class TandemSide(DecodeBatch):
    """The in-process Executor's side; each call returns (wall, cpu) seconds."""

    def prefill_many(self, prompts: list[list[int]]) -> tuple[float, float]:
        """One cache per prompt, in calls of at most max_batch_tokens (`prefill` alone, else unified_decode)."""
        clock = Clock(self.ex.device)
        for group in token_budget_groups(prompts, self.ex.config.max_batch_tokens):
            with clock:
                results = [self.ex.prefill(group[0], output=TOKENS_ONLY)] if len(group) == 1 else \
                    self.ex.unified_decode([UnifiedItem(tuple(p), output=TOKENS_ONLY) for p in group])
            self.add(results)
        return sum(clock.times), sum(clock.cpu_times)

    def decode_step(self) -> tuple[float, float]:
        items = self.decode_items()
        clock = Clock(self.ex.device)
        with clock:
            results = self.ex.decode(items)
        self.advance(results)
        return clock.times[0], clock.cpu_times[0]


def row(phase: str, batch: int, context: int, tokens: int, t_meas: list[tuple[float, float]],
        h_meas: list[tuple[float, float]], t_flops: float, h_flops: float, lm_rows_hf: int) -> dict[str, Any]:
    """t_meas / h_meas: (wall, cpu) seconds per timed call; ratios and rates from the wall-clock medians, the cpu
    ratio from process CPU time (steadier on a shared machine)."""
    t_wall, t_cpu = [m[0] for m in t_meas], [m[1] for m in t_meas]
    h_wall, h_cpu = [m[0] for m in h_meas], [m[1] for m in h_meas]
    t, h, tc, hc = (statistics.median(v) for v in (t_wall, h_wall, t_cpu, h_cpu))
    return {"phase": phase, "batch": batch, "context": context, "tokens_per_call": tokens,
            "tandem_ms": t * 1e3, "hf_ms": h * 1e3, "hf_over_tandem": h / t,
            "tandem_cpu_ms": tc * 1e3, "hf_cpu_ms": hc * 1e3, "hf_over_tandem_cpu": hc / tc if tc > 0 else None,
            "tandem_tok_s": tokens / t, "hf_tok_s": tokens / h, "tandem_gflops": t_flops / t / 1e9,
            "hf_gflops": h_flops / h / 1e9, "tandem_lm_head_rows": batch, "hf_lm_head_rows": lm_rows_hf,
            "tandem_times": time_stats(t_wall), "hf_times": time_stats(h_wall)}


def bench_decode(tandem: TandemSide, hf: HfForward, flops: FlopModel, batch: int, args) -> dict[str, Any]:
    prompts = random_prompts(batch, args.context, flops.vocab, args.seed + batch)
    tandem.prefill_many(prompts.tolist())
    hf.prefill(prompts.to(hf.device), logits_to_keep=1, keep=True)
    t_times, h_times = [], []
    try:
        for step in range(args.warmup + args.steps):
            # alternate who goes first: neither always runs on the other's warm caches
            first, second = (tandem, hf) if step % 2 == 0 else (hf, tandem)
            a, b = first.decode_step(), second.decode_step()
            if step >= args.warmup:
                t_times.append(a if first is tandem else b)
                h_times.append(b if first is tandem else a)
    finally:
        tandem.release()
        hf.release()
    keys = args.context + args.warmup + (args.steps + 1) / 2  # mean keys attended by the timed steps' tokens
    f = flops.decode_step(batch, keys)
    return row("decode", batch, args.context, batch, t_times, h_times, f, f, batch)


def bench_prefill(tandem: TandemSide, hf: HfForward, flops: FlopModel, batch: int, args) -> list[dict[str, Any]]:
    """Rows `prefill` (transformers' LM head on every position) and `prefill/ltk1` (logits_to_keep=1, one row per
    sequence as Tandem computes)."""
    length = args.prefill_len
    prompts = random_prompts(batch, length, flops.vocab, args.seed + 1000 + batch)
    as_list, on_dev = prompts.tolist(), prompts.to(hf.device)
    got: dict[int, list] = {0: [], 1: [], 2: []}
    for rep in range(1 + args.prefill_repeats):  # the first round is warm-up
        for which in ([0, 1, 2] if rep % 2 == 0 else [2, 1, 0]):
            if which == 0:
                m = tandem.prefill_many(as_list)
                tandem.release()
            else:
                m = hf.prefill(on_dev, logits_to_keep=0 if which == 1 else 1)
            if rep:
                got[which].append(m)
    t_flops = flops.prefill(batch, length, lm_rows=batch)
    return [row("prefill", batch, length, batch * length, got[0], got[1], t_flops,
                flops.prefill(batch, length, lm_rows=batch * length), batch * length),
            row("prefill/ltk1", batch, length, batch * length, got[0], got[2], t_flops, t_flops, batch)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = make_log("bench_forward")
    set_threads(args.threads)
    device, dtype, directory = torch_device(args.device), DTYPES[args.dtype], model_dir(args.model)
    log(f"model {directory}, device {device}, dtype {args.dtype}, {torch.get_num_threads()} threads")
    peaks = [matmul_peak(device, dtype, n=args.peak_n, repeats=args.peak_repeats)]
    max_b = max(args.batch_list)
    kv = max([kv_blocks(max_b, args.context + args.warmup + args.steps + 1)]
             + [kv_blocks(b, args.prefill_len) for b in args.prefill_batch_list])
    max_batch_tokens = max([8192, args.context] + [b * args.prefill_len for b in args.prefill_batch_list])
    t0 = time.perf_counter()
    ex = build_executor(directory, args.device, args.dtype, kv, max_batch_tokens)
    hf = HfForward(directory, device, dtype)
    log(f"loaded both models in {time.perf_counter() - t0:.1f}s; KV pool {kv} blocks")
    tandem, flops = TandemSide(ex), FlopModel.from_executor(ex)
    rows: list[dict[str, Any]] = []
    for b in args.batch_list:
        rows.append(bench_decode(tandem, hf, flops, b, args))
        log(f"decode batch {b}: tandem {rows[-1]['tandem_ms']:.2f} ms, hf {rows[-1]['hf_ms']:.2f} ms")
    for b in args.prefill_batch_list:
        rows.extend(bench_prefill(tandem, hf, flops, b, args))
        log(f"prefill batch {b}: tandem {rows[-2]['tandem_ms']:.1f} ms, hf {rows[-2]['hf_ms']:.1f} ms")
    peaks.append(matmul_peak(device, dtype, n=args.peak_n, repeats=args.peak_repeats))
    peak = max(p["gflops"] for p in peaks)  # taken before and after: the higher counts
    for r in rows:
        r["tandem_pct_peak"], r["hf_pct_peak"] = 100.0 * r["tandem_gflops"] / peak, 100.0 * r["hf_gflops"] / peak

    print(model_line(directory, ex.model_config))
    print(f"device: {device}  dtype: {args.dtype}  threads: {torch.get_num_threads()}  matmul peak: {peak:.1f} "
          f"GFLOP/s; decode: context {args.context}, {args.steps} timed steps after {args.warmup}; medians\n")
    print(format_table(rows, COLUMNS))
    print("\nhf/tandem > 1: Tandem is faster (wall-clock medians; cpu: from process CPU time). prefill: transformers'"
          " plain forward computes the LM head on every position; prefill/ltk1 with logits_to_keep=1.")
    payload = {"benchmark": "bench_forward", "model": {**model_json(directory, ex.model_config),
                                                        "layer_linear_params": flops.layer_params,
                                                        "lm_head_params": flops.lm_head_params},
               "machine": machine_info(device), "peak": {"gflops": peak, "before": peaks[0], "after": peaks[1]},
               "settings": {k: v for k, v in vars(args).items() if k != "out"} | {"kv_blocks": kv},
               "rows": rows}
    log(f"wrote {write_json(args.out, payload)}")
    return 0

