"""Serving-workload benchmark: Tandem's in-process Executor driven like the scheduler vs transformers' generate.

Workload (defaults): 32 requests of 128 random prompt tokens (fixed seed), 64 generated tokens each, greedy.

- Tandem: one `Executor.unified_decode` call per step, packed as the scheduler does under a token budget
  (--budget, default 2048): every running sequence's decode token first, then prompt chunks first come first
  served, the last one cut to fill the budget (is_final_chunk False until its prompt ends). Output options
  are the default (tokens mode: greedy token + its logprob). Runs until every request has --gen tokens.
- transformers: `model.generate(input_ids[B, L], max_new_tokens=gen, min_new_tokens=gen, do_sample=False)`
  on the same weights (sdpa attention), same threads.

Each repeat runs both sides, alternating which goes first (a shared, noisy machine slows both alike);
ratios come from the same repeat. Also reports Tandem's prefill-phase and decode-phase times (steps with
and without prompt tokens), the median all-decode step, and whether the two sides generated the same tokens.
All times are wall clock; on a machine shared with other work, compare the ratios of one repeat.

    python scripts/bench_step_profile.py                      # SmolLM2-135M-Instruct, 3 repeats
    python scripts/bench_step_profile.py --repeats 1 --profile # + torch.profiler of one prefill / decode step
    python scripts/bench_step_profile.py --no-hf --repeats 5   # Tandem only
    python scripts/bench_step_profile.py --compare-unpacked    # + Tandem without its packed linear path

Benchmark-only (needs transformers unless --no-hf); never imported by the servers.
"""
from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

import models.transformer as transformer
from benchmarks import runtime
from benchmarks.baselines import generate_greedy, load_causal_lm
from benchmarks.cli import make_log
from benchmarks.local_executor import build_executor
from benchmarks.report import format_table, machine_info, write_json
from benchmarks.workloads import kv_blocks, random_prompts
from executor_service.executor import Executor
from executor_service.types import UnifiedItem

log = make_log("bench_step_profile")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="HF model directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64, help="generated tokens per request (the first from prefill)")
    ap.add_argument("--budget", type=int, default=2048, help="tokens per unified_decode call (scheduler budget)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per side (after one untimed warmup)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-hf", action="store_true", help="Tandem only")
    ap.add_argument("--compare-unpacked", action="store_true",
                    help="also run Tandem with its oneDNN-packed linear path off (F.linear for every call), "
                         "interleaved with the others, to measure that path's share")
    ap.add_argument("--profile", action="store_true", help="torch.profiler of a prefill step and a decode step")
    ap.add_argument("--out", type=Path, default=Path("bench_results/bench_step_profile.json"))
    return ap.parse_args(argv)


def tandem_serve(ex: Executor, prompts: list[list[int]], gen: int, budget: int,
                 profiled: dict[int, str] | None = None) -> dict[str, Any]:
    """Runs the workload to completion; returns step times (and their kind) and every request's tokens.
    profiled: step index -> filled with that step's torch.profiler op table."""
    n = len(prompts)
    cache: list[str | None] = [None] * n
    fed = [0] * n  # prompt tokens written
    out: list[list[int]] = [[] for _ in range(n)]
    steps: list[tuple[str, float, int]] = []  # (kind, seconds, tokens in the call)
    while any(len(o) < gen for o in out):
        items, who = [], []
        for i in range(n):  # running decodes first: one token each
            if fed[i] == len(prompts[i]) and 0 < len(out[i]) < gen:
                items.append(UnifiedItem((out[i][-1],), cache[i], fed[i] + len(out[i]) - 1, True))
                who.append(i)
        room = budget - len(items)
        for i in range(n):  # then prompt chunks, first come first served
            if room <= 0:
                break
            if fed[i] < len(prompts[i]):
                part = prompts[i][fed[i]:fed[i] + room]
                items.append(UnifiedItem(tuple(part), cache[i], fed[i], fed[i] + len(part) == len(prompts[i])))
                who.append(i)
                room -= len(part)
        with _maybe_profile(profiled, len(steps)):
            start = time.perf_counter()
            results = ex.unified_decode(items)
            elapsed = time.perf_counter() - start
        tokens = sum(len(it.token_ids) for it in items)
        steps.append(("decode" if tokens == len(items) else "prefill", elapsed, tokens))
        for i, it, res in zip(who, items, results):
            cache[i] = res.cache.cache_id
            if len(it.token_ids) > 1 or fed[i] < len(prompts[i]):
                fed[i] += len(it.token_ids)
            if res.output is not None:
                out[i].append(res.output.tokens[0].token_id)
    ex.release_cache([c for c in cache if c])
    return {"steps": steps, "tokens": out}


def hf_generate(model: Any, input_ids: torch.Tensor, gen: int) -> tuple[float, list[list[int]]]:
    """transformers' generate of exactly `gen` tokens per prompt (EOS masked until then); (seconds, new ids)."""
    new, start, end = generate_greedy(model, input_ids, max_new_tokens=gen, min_new_tokens=gen, do_sample=False,
                                      temperature=None, top_p=None, top_k=None,
                                      pad_token_id=model.config.eos_token_id)
    return end - start, new


@contextmanager
def _maybe_profile(profiled: dict[int, str] | None, step: int) -> Iterator[None]:
    """Runs the block under torch.profiler when `step` is one of `profiled`'s keys and stores the op table
    (self CPU time, grouped by input shapes) there."""
    if profiled is None or step not in profiled:
        yield
        return
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        yield
    profiled[step] = prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=36, max_shapes_column_width=70)


def run_summary(run: dict[str, Any]) -> dict[str, Any]:
    steps = run["steps"]
    pre = [s for k, s, _ in steps if k == "prefill"]
    dec = [s for k, s, _ in steps if k == "decode"]
    return {"total_s": sum(s for _, s, _ in steps), "prefill_phase_s": sum(pre), "prefill_steps": len(pre),
            "decode_phase_s": sum(dec), "decode_steps": len(dec),
            "decode_step_median_ms": statistics.median(dec) * 1e3 if dec else None,
            "step_tokens": [t for _, _, t in steps]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = runtime.model_dir(args.model)
    ex = build_executor(model_dir, "cpu", "float32", kv_blocks(args.requests, args.prompt_len + args.gen),
                        max(8192, args.budget))
    ids = random_prompts(args.requests, args.prompt_len, ex.model_config.vocab_size, args.seed)  # [B, L]
    prompts = ids.tolist()
    hf = None
    if not args.no_hf:
        hf = load_causal_lm(model_dir, attn_implementation="sdpa")
    log(f"model {model_dir.name}, {torch.get_num_threads()} threads, {args.requests} x ({args.prompt_len} + "
        f"{args.gen}), budget {args.budget}")

    tandem_serve(ex, prompts[:4], 4, args.budget)  # warm up both sides
    if hf is not None:
        hf_generate(hf, ids[:4], 4)
    rows = []
    packed_max = transformer.PACKED_MAX_TOKENS
    sides = ["tandem"] + (["unpacked"] if args.compare_unpacked else []) + (["hf"] if hf is not None else [])
    for rep in range(args.repeats):
        order = sides if rep % 2 == 0 else sides[::-1]
        row: dict[str, Any] = {"repeat": rep}
        for side in order:
            if side == "unpacked":
                transformer.PACKED_MAX_TOKENS = 0  # every linear call takes F.linear
                try:
                    run = tandem_serve(ex, prompts, args.gen, args.budget)
                finally:
                    transformer.PACKED_MAX_TOKENS = packed_max
                row["unpacked_total_s"] = run_summary(run)["total_s"]
                row["unpacked_decode_step_median_ms"] = run_summary(run)["decode_step_median_ms"]
                row["unpacked_over_tandem"] = row["unpacked_total_s"] / row["tandem_total_s"] \
                    if "tandem_total_s" in row else None
            elif side == "tandem":
                run = tandem_serve(ex, prompts, args.gen, args.budget)
                row.update({f"tandem_{k}": v for k, v in run_summary(run).items()})
                t_tokens = run["tokens"]
            else:
                row["hf_total_s"], h_tokens = hf_generate(hf, ids, args.gen)
        if args.compare_unpacked:
            row["unpacked_over_tandem"] = row["unpacked_total_s"] / row["tandem_total_s"]
        if hf is not None:
            row["hf_over_tandem"] = row["hf_total_s"] / row["tandem_total_s"]
            row["same_tokens"] = sum(a == b for a, b in zip(t_tokens, h_tokens))
        rows.append(row)
        log(f"repeat {rep}: tandem {row['tandem_total_s']:.2f}s (prefill {row['tandem_prefill_phase_s']:.2f}s, "
            f"decode step {row['tandem_decode_step_median_ms']:.1f} ms)"
            + (f", hf {row['hf_total_s']:.2f}s, ratio {row['hf_over_tandem']:.3f}" if hf is not None else ""))

    cols = [("repeat", "rep"), ("tandem_total_s", "tandem s"), ("tandem_prefill_phase_s", "prefill s"),
            ("tandem_prefill_steps", "pf steps"), ("tandem_decode_phase_s", "decode s"),
            ("tandem_decode_step_median_ms", "decode step ms", 1)]
    if args.compare_unpacked:
        cols += [("unpacked_total_s", "unpacked s"), ("unpacked_decode_step_median_ms", "unpacked step ms", 1),
                 ("unpacked_over_tandem", "unpacked/tandem", 3)]
    if hf is not None:
        cols += [("hf_total_s", "hf generate s"), ("hf_over_tandem", "hf/tandem", 3),
                 ("same_tokens", f"same tokens /{args.requests}")]
    print(format_table(rows, cols))
    summary = {"tandem_total_s_median": statistics.median(r["tandem_total_s"] for r in rows),
               "decode_step_ms_median": statistics.median(r["tandem_decode_step_median_ms"] for r in rows)}
    if args.compare_unpacked:
        summary["unpacked_over_tandem_median"] = statistics.median(r["unpacked_over_tandem"] for r in rows)
        print(f"unpacked/tandem (median): {summary['unpacked_over_tandem_median']:.3f}  (the packed path's gain)")
    if hf is not None:
        summary["hf_over_tandem_median"] = statistics.median(r["hf_over_tandem"] for r in rows)
        print(f"\nhf/tandem (median of {len(rows)}): {summary['hf_over_tandem_median']:.3f}  (> 1: Tandem faster)")
    profile_text = None
    if args.profile:
        # Step 0: the first prefill (budget // prompt_len whole prompts); step gen // 2: all requests decoding.
        profiled = {0: "", args.gen // 2: ""}
        run = tandem_serve(ex, prompts, args.gen, args.budget, profiled)
        kinds = {i: f"{k} step, {t} tokens" for i, (k, _, t) in enumerate(run["steps"])}
        profile_text = "\n\n".join(f"torch.profiler: step {i} ({kinds.get(i)})\n{text}"
                                    for i, text in profiled.items())
    if profile_text:
        print("\n" + profile_text)
    payload = {"benchmark": "bench_step_profile", "model": str(model_dir), "machine": machine_info("cpu"),
               "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "summary": summary, "rows": rows}
    if profile_text:
        payload["profile"] = profile_text
    log(f"wrote {write_json(args.out, payload)}")
    return 0
