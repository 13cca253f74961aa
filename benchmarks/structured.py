"""Structured output: which grammar engine (llguidance, xgrammar when installed) fills a batch's token masks
fastest, compiles, and covers JSON Schema (part `engines`, on the model's vocabulary), and what constrained
decoding costs per step through real executor + scheduler processes (part `overhead`). Method: docs/benchmarks.md."""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import numpy as np

from benchmarks import openai_client
from benchmarks.cli import add_common, add_sizes, choices, int_list, make_log, parse, parser, serving_setup, stack
from benchmarks.report import format_table, machine_info, model_json, table, write_json
from benchmarks.structured_engines import (FEATURES, OVERHEAD_GRAMMAR, OVERHEAD_QUESTION, TRAJECTORIES, EngineError,
                                           load, model_vocabulary)
from tandem.token_mask import mask_words

ENGINES, PARTS = ("llguidance", "xgrammar"), ("engines", "overhead")
DEFAULTS = {"batches": "1,32", "steps": 64, "output_len": 64, "repeats": 2}
QUICK = {"batches": "1,4", "steps": 8, "output_len": 8, "repeats": 1}
MASK_COUNTERS = ("tandem:scheduler_token_masks_total", "tandem:scheduler_token_mask_seconds_total",
                 "tandem:scheduler_token_mask_wait_seconds_total", "tandem:scheduler_steps_total")
log = make_log("bench_structured")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = parser("structured", __doc__.split("\n\n")[0])
    add_common(ap, "structured", "batches 1,4, 8 steps, 8 tokens, 1 repeat")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma list of engines, overhead (default both)")
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma list of grammar engines (default llguidance,"
                    "xgrammar; one that is not installed is reported as such)")
    add_sizes(ap, DEFAULTS, {"batches": "batch sizes", "steps": "engines: mask steps timed per run",
                             "output-len": "overhead: tokens per request",
                             "repeats": "overhead: plain/constrained pairs per batch size, alternating order"})
    ap.add_argument("--request-timeout", type=float, default=600.0, help="deadline per request in s")
    args = parse(ap, argv, QUICK, DEFAULTS)
    args.batch_list = int_list(args.batches, "--batches")
    args.part_list = choices(args.parts, PARTS, "--parts")
    args.engine_list = choices(args.engines, ENGINES, "--engines")
    if min(args.steps, args.repeats) < 1 or args.output_len < 2:
        ap.error("--steps and --repeats must be >= 1, --output-len >= 2")
    return args


def time_masks(engine: Any, compiled: list[Any], vocab: Any, batch: int, steps: int) -> dict[str, Any]:
    """`batch` matchers (the trajectories in turn, each started a few tokens further along so the batch is not in
    lockstep) take `steps` steps: fill every mask at once (timed), then every matcher consumes its next token (timed
    apart), starting over at its end; `violations`: a mask that disallowed the next valid token (0 if correct)."""
    paths = [vocab.tokenizer.tokenize_str(t.output) for t in TRAJECTORIES]
    matchers, pos = [], []
    for i in range(batch):
        k = i % len(TRAJECTORIES)
        matchers.append(engine.matcher(compiled[k]))
        pos.append((3 * (i // len(TRAJECTORIES))) % len(paths[k]))
        for tok in paths[k][:pos[-1]]:
            engine.advance(matchers[-1], tok)
    masks = np.zeros((batch, mask_words(vocab.n_vocab)), dtype=np.int32)
    fill_ms, advance_ms, violations = [], [], 0
    for _ in range(steps):
        start = time.perf_counter()
        engine.fill(matchers, masks)
        fill_ms.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        for i, m in enumerate(matchers):
            path = paths[i % len(TRAJECTORIES)]
            tok = path[pos[i]]
            violations += not (int(masks[i, tok // 32]) >> (tok % 32)) & 1
            engine.advance(m, tok)
            pos[i] = (pos[i] + 1) % len(path)
            if pos[i] == 0:
                m.reset()  # both engines' matchers
        advance_ms.append((time.perf_counter() - start) * 1e3)
    ms = sorted(fill_ms)
    return {"vocab": vocab.name, "engine": engine.name, "batch": batch, "steps": steps,
            "mask_ms_mean": statistics.fmean(ms), "mask_ms_p50": ms[len(ms) // 2],
            "mask_ms_p99": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
            "mask_us_per_row": statistics.fmean(ms) * 1e3 / batch,
            "advance_ms_mean": statistics.fmean(advance_ms), "violations": violations}


def coverage(engine: Any) -> dict[str, str]:
    """Feature -> "yes" when its schema compiles, its valid output is accepted and its invalid one rejected (an
    engine that ignores a keyword accepts the invalid output), else why not."""
    out = {}
    for f in FEATURES:
        try:
            compiled = engine.compile("json_schema", json.dumps(f.schema))
            ok, bad = engine.accepts(compiled, f.valid), engine.accepts(compiled, f.invalid)
        except EngineError as exc:
            out[f.name] = f"no (refused: {str(exc)[:60]})"
            continue
        except Exception as exc:  # an engine failing at run time on a schema it compiled
            out[f.name] = f"no ({type(exc).__name__})"
            continue
        out[f.name] = "yes" if ok and not bad else ("no (rejects valid output)" if not ok else
                                                    "no (accepts invalid output: keyword ignored)")
    return out


def engines_part(args, model_dir: Any, cfg: Any) -> dict[str, Any]:
    vocab = model_vocabulary(model_dir, cfg.vocab_size, (cfg.eos_token_ids or (0,))[0])
    timing, compiles, cover, versions = [], [], {}, {}
    for name in args.engine_list:
        try:
            engine = load(name, vocab)
        except ImportError:
            versions[name] = None
            continue
        versions[name] = engine.version()
        compiled, ms = [], []
        for t in TRAJECTORIES:  # cold: a fresh engine
            start = time.perf_counter()
            compiled.append(engine.compile(t.kind, t.text))
            ms.append((time.perf_counter() - start) * 1e3)
        compiles.append({"engine": name, "compile_ms_mean": statistics.fmean(ms), "compile_ms_max": max(ms)})
        for batch in args.batch_list:
            timing.append(time_masks(engine, compiled, vocab, batch, args.steps))
            log(f"{name} batch {batch}: {timing[-1]['mask_ms_mean']:.3f} ms per step")
        cover[name] = coverage(engine)
    return {"vocabulary": vocab.name, "versions": versions, "mask_timing": timing, "compile": compiles,
            "coverage": cover}


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


def print_report(header: str, results: dict[str, Any]) -> None:
    print(header)
    eng = results.get("engines")
    if eng:
        missing = [n for n, v in eng["versions"].items() if v is None]
        print("\nToken masks per step (fill the batch's masks; advance = every matcher consumes its token)"
              + (f"; not installed: {', '.join(missing)}" if missing else ""))
        print(format_table(eng["mask_timing"], [("engine", "engine"), ("batch", "batch"), ("mask_ms_mean", "mask ms"),
                                                ("mask_ms_p50", "p50"), ("mask_ms_p99", "p99"),
                                                ("mask_us_per_row", "us/row", 1), ("advance_ms_mean", "advance ms", 3),
                                                ("violations", "violations")]))
        print("\nCompile (cold, per grammar)\n" + table(eng["compile"], 1))
        names = list(eng["coverage"])
        if names:
            print("\nJSON Schema coverage (compiles, accepts a valid output, rejects an invalid one)")
            print(table([{"feature": f, **{n: eng["coverage"][n][f] for n in names}}
                         for f in eng["coverage"][names[0]]]))
            print("supported: " + ", ".join(f"{n} {sum(v == 'yes' for v in c.values())}/{len(c)}"
                                            for n, c in eng["coverage"].items()))
    over = results.get("overhead")
    if over:
        print("\nStep-time overhead of constrained decoding (real executor + scheduler; TPOT = step time)")
        print(format_table(over["summary"], [
            ("batch", "batch"), ("plain_tpot_ms", "plain TPOT ms", 1), ("constrained_tpot_ms", "constrained ms", 1),
            ("overhead_pct", "overhead %", 1), ("mask_ms_per_step", "mask ms/step", 3),
            ("mask_wait_ms_per_step", "waited ms/step", 3),
            ("mask_ms_per_request", "mask ms/request", 2), ("masks_per_request", "masks/request", 1)]))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads, model_dir, cfg = serving_setup(args)
    results: dict[str, Any] = {}
    if "engines" in args.part_list:
        results["engines"] = engines_part(args, model_dir, cfg)
    if "overhead" in args.part_list:
        results["overhead"] = overhead_part(args, model_dir, threads)
    print_report(f"model: {model_dir.name}  ({cfg.architecture}, vocab {cfg.vocab_size})  threads: {threads}", results)
    config = {k: v for k, v in vars(args).items() if k != "out"} | {"threads": threads}
    path = write_json(args.out, {"benchmark": "bench_structured", "config": config, "machine": machine_info("cpu"),
                                 "model": model_json(model_dir, cfg), **results})
    log(f"wrote {path}")
    bad = any(r["violations"] for r in results.get("engines", {}).get("mask_timing", [])) or \
        not all(r["all_exact_output_len"] for r in results.get("overhead", {}).get("summary", []))
    return 1 if bad else 0
