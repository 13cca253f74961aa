#!/usr/bin/env python
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
import os
import statistics
import sys
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
QUICK = {"batches": "1,8", "steps": 4, "warmup": 1, "context": 32, "prefill_len": 64, "prefill_batches": "1,4",
         "prefill_repeats": 1, "peak_n": 512, "peak_repeats": 3}
DEFAULTS = {"batches": "1,8,32,64", "steps": 16, "warmup": 2, "context": 128, "prefill_len": 512,
            "prefill_batches": "1,4", "prefill_repeats": 3, "peak_n": 2048, "peak_repeats": 7}


def log(msg: str) -> None:
    print(f"[bench_forward] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None,
                    help="HF model directory (default: SmolLM2-135M-Instruct via scripts/prepare_default_model.py)")
    ap.add_argument("--batches", default=None, help=f"decode batch sizes (default {DEFAULTS['batches']})")
    ap.add_argument("--context", type=int, default=None,
                    help=f"tokens per sequence before decoding (default {DEFAULTS['context']})")
    ap.add_argument("--steps", type=int, default=None, help=f"timed decode steps (default {DEFAULTS['steps']})")
    ap.add_argument("--warmup", type=int, default=None, help=f"untimed decode steps first (default {DEFAULTS['warmup']})")
    ap.add_argument("--prefill-len", type=int, default=None,
                    help=f"prompt length of the prefill phase (default {DEFAULTS['prefill_len']}; 0 skips it)")
    ap.add_argument("--prefill-batches", default=None,
                    help=f"prefill batch sizes (default {DEFAULTS['prefill_batches']})")
    ap.add_argument("--prefill-repeats", type=int, default=None,
                    help=f"timed prefills per side and batch, after one untimed (default {DEFAULTS['prefill_repeats']})")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="default cpu")
    ap.add_argument("--dtype", default="float32", choices=sorted(bc.DTYPES), help="default float32")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: every usable core)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    ap.add_argument("--peak-n", type=int, default=None, help=f"matmul size of the peak measurement (default {DEFAULTS['peak_n']})")
    ap.add_argument("--peak-repeats", type=int, default=None, help="timed matmuls per peak measurement")
    ap.add_argument("--out", type=Path, default=Path("bench_results/bench_forward.json"), help="JSON results file")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: batches 1,8; steps 4; context 32; prefill-len 64 (explicit flags still win)")
    ap.add_argument("--profile-batch", type=int, default=0,
                    help="after the benchmark, profile this many Tandem decode steps' ops at this batch size (0: off)")
    args = ap.parse_args(argv)
    preset = QUICK if args.quick else DEFAULTS
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.batch_list = bc.int_list(args.batches, "--batches")
    args.prefill_batch_list = bc.int_list(args.prefill_batches, "--prefill-batches") if args.prefill_len > 0 else []
    if args.context < 1 or args.steps < 1 or args.warmup < 0 or args.prefill_repeats < 1:
        ap.error("--context and --steps and --prefill-repeats must be >= 1, --warmup >= 0")
    return args


# ---------------------------------------------------------------------------------------------- FLOPs
class FlopModel:
    """Matmul FLOPs of one forward, from the loaded Tandem model's shapes."""

    def __init__(self, ex: Executor) -> None:
        cfg = ex.model_config
        self.layers = cfg.num_layers
        self.hidden, self.vocab = cfg.hidden_size, cfg.vocab_size
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        # Every linear weight of the decoder layers (fused qkv / gate_up included; norms are elementwise).
        self.layer_params = sum(m.weight.numel() for m in ex.model.model.layers.modules()
                                if isinstance(m, torch.nn.Linear))
        self.lm_head_params = ex.model.lm_head.weight.numel()

    def linear(self, tokens: int) -> float:
        return 2.0 * self.layer_params * tokens

    def lm_head(self, rows: int) -> float:
        return 2.0 * self.lm_head_params * rows

    def attention(self, keys_summed: int) -> float:
        """keys_summed: sum over the batch's query tokens of the keys each one attends to."""
        return 4.0 * keys_summed * self.head_dim * self.heads * self.layers

    def decode_step(self, batch: int, keys: int, lm_rows: int | None = None) -> float:
        return self.linear(batch) + self.lm_head(batch if lm_rows is None else lm_rows) + \
            self.attention(batch * keys)

    def prefill(self, batch: int, length: int, lm_rows: int) -> float:
        causal = length * (length + 1) // 2
        return self.linear(batch * length) + self.lm_head(lm_rows) + self.attention(batch * causal)


# --------------------------------------------------------------------------------------------- sides
class TandemSide:
    def __init__(self, ex: Executor) -> None:
        self.ex = ex
        self.device = ex.device
        self.caches: list[str] = []
        self.lengths: list[int] = []
        self.tokens: list[int] = []

    def prefill_many(self, prompts: list[list[int]]) -> tuple[float, float]:
        """Starts one cache per prompt, in calls of at most max_batch_tokens tokens (one call for the timed
        prefill phase); returns (wall, cpu) seconds of all the calls."""
        limit = self.ex.config.max_batch_tokens
        groups, cur, size = [], [], 0
        for p in prompts:
            if cur and size + len(p) > limit:
                groups.append(cur)
                cur, size = [], 0
            cur.append(p)
            size += len(p)
        groups.append(cur)
        clock = bc.Clock(self.device)
        for group in groups:
            with clock:
                if len(group) == 1:
                    res = self.ex.prefill(group[0], output=TOKENS_ONLY)
                    results = [(res.cache, res.output)]
                else:
                    out = self.ex.unified_decode([UnifiedItem(tuple(p), output=TOKENS_ONLY) for p in group])
                    results = [(r.cache, r.output) for r in out]
            for cache, output in results:
                self.caches.append(cache.cache_id)
                self.lengths.append(cache.seq_len)
                self.tokens.append(output.tokens[0].token_id)
        return sum(clock.times), sum(clock.cpu_times)

    def decode_step(self) -> tuple[float, float]:
        items = [DecodeItem(CacheRef(c, n), t, output=TOKENS_ONLY)
                 for c, n, t in zip(self.caches, self.lengths, self.tokens)]
        clock = bc.Clock(self.device)
        with clock:
            results = self.ex.decode(items)
        self.lengths = [r.cache.seq_len for r in results]
        self.tokens = [r.output.tokens[0].token_id for r in results]
        return clock.times[0], clock.cpu_times[0]

    def release(self) -> None:
        self.ex.release_cache(self.caches)
        self.caches, self.lengths, self.tokens = [], [], []


class HfSide:
    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                          attn_implementation="sdpa").to(device).eval()
        self.device = device
        self.cache = None
        self.next_ids: torch.Tensor | None = None

    def _new_cache(self):
        from transformers import DynamicCache
        try:
            return DynamicCache(config=self.model.config)
        except TypeError:  # older transformers
            return DynamicCache()

    @torch.inference_mode()
    def prefill(self, prompts: torch.Tensor, logits_to_keep: int = 0, keep: bool = False) -> tuple[float, float]:
        """One forward of [B, L] with a fresh cache, then argmax of the last position; returns (wall, cpu) s."""
        cache = self._new_cache()
        clock = bc.Clock(self.device)
        with clock:
            out = self.model(input_ids=prompts, past_key_values=cache, use_cache=True,
                             logits_to_keep=logits_to_keep)
            next_ids = out.logits[:, -1].argmax(dim=-1, keepdim=True)  # [B, 1]
            next_ids.tolist()  # the host sees the tokens, as Tandem's caller does
        del out
        if keep:
            self.cache, self.next_ids = cache, next_ids
        return clock.times[0], clock.cpu_times[0]

    @torch.inference_mode()
    def decode_step(self) -> tuple[float, float]:
        clock = bc.Clock(self.device)
        with clock:
            out = self.model(input_ids=self.next_ids, past_key_values=self.cache, use_cache=True)
            self.next_ids = out.logits[:, -1].argmax(dim=-1, keepdim=True)  # [B, 1]
            self.next_ids.tolist()
        return clock.times[0], clock.cpu_times[0]

    def release(self) -> None:
        self.cache, self.next_ids = None, None


# ------------------------------------------------------------------------------------------- phases
def stats(times: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "mean_s": statistics.fmean(times), "times_s": times}


def make_prompts(batch: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    low = min(3, vocab - 1)  # skip the usual special ids (pad/bos/eos)
    return torch.randint(low, vocab, (batch, length), generator=gen)


def bench_decode(tandem: TandemSide, hf: HfSide, flops: FlopModel, batch: int, args) -> dict[str, Any]:
    prompts = make_prompts(batch, args.context, flops.vocab, args.seed + batch)
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


def bench_prefill(tandem: TandemSide, hf: HfSide, flops: FlopModel, batch: int, args) -> list[dict[str, Any]]:
    length = args.prefill_len
    prompts = make_prompts(batch, length, flops.vocab, args.seed + 1000 + batch)
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
        "tandem_times": stats(t_wall), "hf_times": stats(h_wall),
        "tandem_cpu_times": stats(t_cpu), "hf_cpu_times": stats(h_cpu),
    }


# ----------------------------------------------------------------------------------------- profiling
def profile_decode(tandem: TandemSide, flops: FlopModel, batch: int, args) -> str:
    from torch.profiler import ProfilerActivity, profile
    prompts = make_prompts(batch, args.context, flops.vocab, args.seed + batch)
    tandem.prefill_many(prompts.tolist())
    try:
        for _ in range(max(1, args.warmup)):
            tandem.decode_step()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if tandem.device.type == "cuda" else [])
        steps = min(args.steps, 8)
        with profile(activities=activities) as prof:
            for _ in range(steps):
                tandem.decode_step()
    finally:
        tandem.release()
    sort = "self_cuda_time_total" if tandem.device.type == "cuda" else "self_cpu_time_total"
    return f"torch.profiler: Tandem decode, batch {batch}, {steps} steps\n" + \
        prof.key_averages().table(sort_by=sort, row_limit=25)


# ---------------------------------------------------------------------------------------------- main
COLUMNS = [("phase", "phase"), ("batch", "batch"), ("context", "ctx"), ("tandem_ms", "tandem ms"),
           ("hf_ms", "hf ms"), ("hf_over_tandem", "hf/tandem"), ("hf_over_tandem_cpu", "cpu hf/tandem"), ("tandem_tok_s", "tandem tok/s", 1),
           ("hf_tok_s", "hf tok/s", 1), ("tandem_gflops", "tandem GFLOP/s", 1),
           ("tandem_pct_peak", "tandem %peak", 1), ("hf_gflops", "hf GFLOP/s", 1), ("hf_pct_peak", "hf %peak", 1),
           ("hf_lm_head_rows", "hf lm-head rows")]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = args.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    torch.set_num_threads(max(1, threads))
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    dtype = bc.DTYPES[args.dtype]
    model_dir = Path(args.model) if args.model else bc.default_model_dir()
    log(f"model {model_dir}, device {device}, dtype {args.dtype}, {torch.get_num_threads()} threads")

    peak_before = bc.measure_matmul_peak(device, dtype, n=args.peak_n, repeats=args.peak_repeats)
    log(f"matmul peak (before): {peak_before.gflops:.1f} GFLOP/s")

    max_b = max(args.batch_list + [args.profile_batch])
    decode_tokens = args.context + args.warmup + args.steps + 1
    per_seq_blocks = -(-decode_tokens // DEFAULT_BLOCK_SIZE)
    prefill_blocks = max([b * -(-args.prefill_len // DEFAULT_BLOCK_SIZE) for b in args.prefill_batch_list],
                         default=0)
    kv_blocks = max(max_b * per_seq_blocks, prefill_blocks) + 16  # + slack
    max_batch_tokens = max([8192, args.context] + [b * args.prefill_len for b in args.prefill_batch_list])
    t0 = time.perf_counter()
    ex = Executor(ExecutorConfig(model_dir, device=args.device, dtype=args.dtype, kv_blocks=kv_blocks,
                                 max_batch_tokens=max_batch_tokens, progress=False))
    hf = HfSide(model_dir, device, dtype)
    log(f"loaded both models in {time.perf_counter() - t0:.1f}s; KV pool {kv_blocks} blocks")
    tandem = TandemSide(ex)
    flops = FlopModel(ex)

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

    peak_after = bc.measure_matmul_peak(device, dtype, n=args.peak_n, repeats=args.peak_repeats)
    peak = max(peak_before.gflops, peak_after.gflops)
    log(f"matmul peak (after): {peak_after.gflops:.1f} GFLOP/s")
    for r in rows:
        r["tandem_pct_peak"] = 100.0 * r["tandem_gflops"] / peak
        r["hf_pct_peak"] = 100.0 * r["hf_gflops"] / peak

    profile_text = profile_decode(tandem, flops, args.profile_batch, args) if args.profile_batch else None

    cfg = ex.model_config
    print(f"model: {model_dir.name}  ({cfg.architecture}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_heads} heads / {cfg.num_kv_heads} kv, vocab {cfg.vocab_size})")
    print(f"device: {device}  dtype: {args.dtype}  threads: {torch.get_num_threads()}  "
          f"{args.dtype} matmul peak: {peak:.1f} GFLOP/s (n={args.peak_n}; before {peak_before.gflops:.1f}, "
          f"after {peak_after.gflops:.1f})")
    print(f"decode: context {args.context}, {args.steps} timed steps after {args.warmup}; "
          f"prefill: {args.prefill_repeats} timed after 1 warmup; medians\n")
    print(bc.format_table(rows, COLUMNS))
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
        "model": {"dir": str(model_dir), "name": model_dir.name, "architecture": cfg.architecture,
                  "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "num_heads": cfg.num_heads,
                  "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
                  "layer_linear_params": flops.layer_params, "lm_head_params": flops.lm_head_params},
        "machine": bc.machine_info(device),
        "settings": {"batches": args.batch_list, "context": args.context, "steps": args.steps,
                     "warmup": args.warmup, "prefill_len": args.prefill_len,
                     "prefill_batches": args.prefill_batch_list, "prefill_repeats": args.prefill_repeats,
                     "dtype": args.dtype, "seed": args.seed, "kv_blocks": kv_blocks, "quick": args.quick,
                     "hf_attn_implementation": "sdpa"},
        "peak": {"gflops": peak, "before": peak_before.as_dict(), "after": peak_after.as_dict()},
        "rows": rows,
    }
    if profile_text:
        payload["profile"] = profile_text
    path = bc.write_json(args.out, payload)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
