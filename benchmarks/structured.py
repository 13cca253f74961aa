"""Structured output: what constrained decoding costs per step through real executor + scheduler processes,
batches of chat requests plain and under a never-ending JSON-lines grammar, alternating. (The grammar-library
comparison that chose llguidance, docs/performance.md, runs no Tandem code and is not a Tandem benchmark.)
Method: docs/benchmarks.md."""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from typing import Any

from benchmarks import openai_client
from benchmarks.cli import add_sizes, int_list, make_log, parse, parser, serving_setup, stack
from benchmarks.report import format_table, machine_info, model_json, write_json
from scheduler.structured.grammar import JSON_OPTIONS

DEFAULTS = {"batches": "1,32", "output_len": 64, "repeats": 2}
QUICK = {"batches": "1,4", "output_len": 8, "repeats": 1}
MASK_COUNTERS = ("tandem:scheduler_token_masks_total", "tandem:scheduler_token_mask_seconds_total",
                 "tandem:scheduler_token_mask_wait_seconds_total", "tandem:scheduler_steps_total")
# JSON objects, one per line, for ever: the grammar is never complete, so every request runs its whole length (EOS
# is held off by min_tokens as in the plain runs) and every step masks every row.
LINE_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["sku", "name", "qty", "price"],
               "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                              "qty": {"type": "integer", "minimum": 1, "maximum": 999},
                              "price": {"type": "number", "minimum": 0}, "name": {"type": "string", "maxLength": 24}}}
OVERHEAD_GRAMMAR = 'start: (item "\\n")+\nitem: %json ' + json.dumps({**LINE_SCHEMA, "x-guidance": JSON_OPTIONS})
OVERHEAD_QUESTION = "List products of a hardware store, one JSON object per line with sku, name, qty and price."
log = make_log("bench_structured")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = parser("structured", __doc__, "batches 1,4, 8 tokens, 1 repeat")
    add_sizes(ap, DEFAULTS, {"batches": "batch sizes", "output-len": "tokens per request",
                             "repeats": "plain/constrained pairs per batch size, alternating order"})
    ap.add_argument("--request-timeout", type=float, default=600.0, help="deadline per request in s")
    args = parse(ap, argv, QUICK, DEFAULTS)
    args.batch_list = int_list(args.batches, "--batches")
    if args.repeats < 1 or args.output_len < 2:
        ap.error("--repeats must be >= 1, --output-len >= 2")
    return args


def run_batch(url: str, batch: int, constrained: bool, output_len: int, timeout: float) -> dict[str, Any]:
    """`batch` chat requests at once, exactly output_len tokens each (min_tokens holds EOS off in both modes);
    constrained: the JSON-lines grammar, never complete, so every step masks every row. TPOT averaged over the
    requests is the step time (the batch runs in lockstep); the scheduler's mask counters around the run."""
    before = openai_client.counters(url, MASK_COUNTERS)
    extra = {"min_tokens": output_len} | ({"guided_grammar": OVERHEAD_GRAMMAR} if constrained else {})
    texts = [f"{OVERHEAD_QUESTION} (list {i})" for i in range(batch)]
    records = asyncio.run(openai_client.run(url, texts, output_len, batch, timeout, greedy_exact=False, **extra))
    d = {k: v - before[k] for k, v in openai_client.counters(url, MASK_COUNTERS).items()}
    steps = max(1.0, d["tandem:scheduler_steps_total"])
    tpot = [m["tpot"] * 1e3 for m in (r.metrics() for r in records) if m["tpot"] is not None]
    return {"mode": "constrained" if constrained else "plain", "batch": batch,
            "exact_output_len": sum(r.output_len == output_len and not r.error for r in records),
            "tpot_ms": statistics.fmean(tpot) if tpot else None, "steps": int(steps),
            "masks": int(d["tandem:scheduler_token_masks_total"]),
            "mask_ms_per_step": d["tandem:scheduler_token_mask_seconds_total"] * 1e3 / steps,
            "mask_wait_ms_per_step": d["tandem:scheduler_token_mask_wait_seconds_total"] * 1e3 / steps,
            "mask_ms_per_request": d["tandem:scheduler_token_mask_seconds_total"] * 1e3 / batch}


def overhead_part(args, model_dir: Any, threads: int) -> dict[str, Any]:
    """One executor + scheduler serve every run; per batch size, plain and constrained alternate (plain,
    constrained, constrained, plain, ...) over --repeats pairs to spread the machine's drift over both."""
    with stack(model_dir, ["--threads", str(threads)]) as servers:
        url = servers[1].http_url
        for constrained in (False, True):  # warm-up: the grammar compiled, llguidance's tokenizer built
            run_batch(url, 1, constrained, min(args.output_len, 8), args.request_timeout)
        runs = []
        for batch in args.batch_list:
            for r in range(args.repeats):
                for constrained in ((False, True) if r % 2 == 0 else (True, False)):
                    runs.append(run_batch(url, batch, constrained, args.output_len, args.request_timeout))
                    log(f"batch {batch} {runs[-1]['mode']}: TPOT {runs[-1]['tpot_ms']:.1f} ms")
    rows = []
    for batch in args.batch_list:
        mine = [r for r in runs if r["batch"] == batch]
        con = [r for r in mine if r["mode"] == "constrained"]
        plain, tpot = (statistics.fmean(r["tpot_ms"] for r in mine if r["mode"] == m) for m in ("plain", "constrained"))
        rows.append({"batch": batch, "plain_tpot_ms": plain, "constrained_tpot_ms": tpot,
                     "overhead_pct": 100.0 * (tpot / plain - 1.0),
                     **{k: statistics.fmean(r[k] for r in con) for k in ("mask_ms_per_step", "mask_wait_ms_per_step",
                                                                         "mask_ms_per_request")},
                     "masks_per_request": statistics.fmean(r["masks"] / batch for r in con),
                     "all_exact_output_len": all(r["exact_output_len"] == batch for r in mine)})
    return {"runs": runs, "summary": rows}


def print_report(header: str, over: dict[str, Any]) -> None:
    print(header)
    print("\nStep-time overhead of constrained decoding (real executor + scheduler; TPOT = step time)")
    print(format_table(over["summary"], [
        ("batch", "batch"), ("plain_tpot_ms", "plain TPOT ms", 1), ("constrained_tpot_ms", "constrained ms", 1),
        ("overhead_pct", "overhead %", 1), ("mask_ms_per_step", "mask ms/step", 3),
        ("mask_wait_ms_per_step", "waited ms/step", 3),
        ("mask_ms_per_request", "mask ms/request", 2), ("masks_per_request", "masks/request", 1)]))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads, model_dir, cfg = serving_setup(args)
    overhead = overhead_part(args, model_dir, threads)
    print_report(f"model: {model_dir.name}  ({cfg.architecture}, vocab {cfg.vocab_size})  threads: {threads}", overhead)
    config = {k: v for k, v in vars(args).items() if k != "out"} | {"threads": threads}
    path = write_json(args.out, {"benchmark": "bench_structured", "config": config, "machine": machine_info("cpu"),
                                 "model": model_json(model_dir, cfg), "overhead": overhead})
    log(f"wrote {path}")
    return 0 if all(r["all_exact_output_len"] for r in overhead["summary"]) else 1
