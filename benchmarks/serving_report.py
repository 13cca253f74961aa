"""The serving benchmark's output: the sides compared with Tandem, the throughput and latency tables, the notes
under them, and the JSON payload."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report import format_table, machine_info

TARGETS = {"hf": 1.2, "hf-serial": 6.0}  # the targets (SmolLM2 fp32, 32 clients, 128 in / 64 out)
THROUGHPUT_COLUMNS = [("name", "side"), ("completed", "done"), ("exact_output_len", "exact len"),
                      ("duration_s", "duration s"), ("request_throughput", "req/s", 3),
                      ("output_throughput", "out tok/s", 1), ("total_token_throughput", "total tok/s", 1),
                      ("gflops", "GFLOP/s", 1), ("pct_peak", "% peak", 1), ("speedup", "tandem speedup"),
                      ("target", "target", 1), ("cores", "cores"), ("other_cores", "other cores")]
LATENCY_COLUMNS = [("name", "side")] + [
    (f"{metric}_{stat}", f"{label} {stat}", 1)
    for metric, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"))
    for stat in ("mean", "p50", "p99")]


def compare_sides(sides: list[dict[str, Any]], peak: float) -> None:
    """Adds % peak, the cores text and, to every baseline, Tandem's speedup over it and the target."""
    tandem = sides[0]
    for s in sides:
        if s["gflops"]:
            s["pct_peak"] = 100.0 * s["gflops"] / peak
        cores = s["cpu"]["cores"]
        s["cores_text"] = "/".join(f"{cores[k]:.2f}" for k in ("executor", "scheduler", "client")
                                   if cores.get(k) is not None)
        s["other_cores"] = s["cpu"]["other_cores"]
        if s["name"] not in ("tandem", "openai-chat"):  # baselines; openai-chat: serving_backends.compare
            s["speedup"] = f"{tandem['output_throughput'] / s['output_throughput']:.2f}x"
            s["speedup_value"] = tandem["output_throughput"] / s["output_throughput"]
            s["target"] = TARGETS.get(s["name"])
            s["meets_target"] = s["speedup_value"] >= s["target"] if s["target"] else None


def table_rows(sides: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for s in sides:
        row = {k: s.get(k) for k, *_ in THROUGHPUT_COLUMNS}
        for metric in ("ttft", "tpot", "itl", "e2el"):
            for stat in ("mean", "p50", "p99"):
                row[f"{metric}_{stat}"] = s[f"{metric}_ms"][stat]
        row["cores"] = s.get("cores_text")
        rows.append(row)
    return rows


def print_report(args, sides: list[dict[str, Any]], header: str, workload: str, ex_metrics: dict[str, Any] | None,
                 bad: list[Any], requests: int) -> None:
    """header / workload: the first two lines; bad: the Tandem requests that failed or missed the length."""
    print(header)
    print(workload)
    print()
    rows = table_rows(sides)
    print(format_table(rows, THROUGHPUT_COLUMNS))
    print("\ncores: executor/scheduler/client processes (tandem) or this process (baselines), CPU s per wall s; "
          "other cores: the rest of the machine meanwhile.\ntandem speedup: tandem output tok/s / the side's; "
          "target: the issue's minimum speedup.\n")
    print(format_table(rows, LATENCY_COLUMNS))
    print("\nms; TTFT = first token, TPOT = (E2E - TTFT) / (tokens - 1) per request, ITL = per token "
          "(a message of k tokens counts k gaps of 1/k), E2EL = end-to-end latency.")
    if ex_metrics:
        # a step is one UnifiedDecode, or one Decode of several steps (the scheduler's multi-step decode)
        ops = [ex_metrics["ops"][k] for k in ("unified_decode", "decode") if k in ex_metrics["ops"]]
        rpcs = [ex_metrics["rpcs"][k] for k in ("UnifiedDecode", "Decode") if k in ex_metrics["rpcs"]]
        calls = sum(o["calls"] for o in ops)
        if calls:
            busy = sum(o["busy_share"] for o in ops)
            bursts = ex_metrics["ops"].get("decode", {}).get("calls", 0)
            print(f"executor during the timed run: {calls} calls ({bursts} of them multi-step Decode bursts), "
                  f"{sum(o['mean_ms'] * o['calls'] for o in ops) / calls:.1f} ms of model work per call, busy "
                  f"{100 * busy:.0f}% of the run"
                  + (f" (RPC handlers {100 * sum(r['busy_share'] for r in rpcs):.0f}%)" if rpcs else "")
                  + f"; the rest is the scheduler, streaming and round trips; "
                  f"{ex_metrics['tokens_processed']} tokens processed, {ex_metrics['tokens_sampled']} sampled")
    for s in sides[1:]:
        agree = s.get("agreement_with_tandem")
        if agree:
            print(f"{s['name']}: {agree['identical']}/{agree['compared']} requests generated the same tokens as "
                  f"tandem (mean common prefix {agree['mean_common_prefix']:.1f} of {args.output_len})")
    if any((s.get("other_cores") or 0) > 0.2 for s in sides):
        print("note: other processes used > 0.2 cores during a phase (other cores column): timings are noisy")
    if bad:
        print(f"ERROR: {len(bad)} of {requests} tandem requests failed or did not produce exactly "
              f"{args.output_len} tokens (see stderr)")


def payload(args, run: Any, sides: list[dict[str, Any]], model_dir: Path | None, model_name: str, mode: str,
            threads: int, peak: dict[str, Any], flops: dict[str, Any] | None, all_exact: bool) -> dict[str, Any]:
    """The JSON results; run: the TandemRun, peak: the JSON `peak` entry, flops: the JSON model `flops`."""
    tandem = sides[0]
    return {
        "benchmark": "bench_serving",
        "config": {"model": str(model_dir) if model_dir else None, "target": args.target,
                   "input_len": args.input_len, "output_len": args.output_len, "num_requests": args.num_requests,
                   "concurrency": args.concurrency, "request_rate": args.request_rate, "mode": mode,
                   "baselines": args.baselines, "hf_batch_size": args.hf_batch_size,
                   "hf_serial_requests": args.hf_serial_requests, "threads": threads, "seed": args.seed,
                   "warmup": args.warmup, "executor_args": args.executor_args,
                   "scheduler_args": args.scheduler_args, "quick": args.quick, "backends": args.backends,
                   "rounds": args.rounds, "chat_prompts": run.chat,
                   "prompt_vocabulary": {"ids": int(run.allowed.size), "min": int(run.allowed.min()),
                                         "max": int(run.allowed.max())}},
        "machine": machine_info("cpu"),
        "peak": peak,
        "model": {"name": model_name, "info": run.model_info, "flops": flops},
        "servers": run.servers,
        "all_exact_output_len": all_exact,
        "sides": {s["name"]: {k: v for k, v in s.items() if k != "cores_text"} for s in sides},
        "ratios": {s["name"]: {"output_throughput": s["speedup_value"],
                               "duration": s["duration_s"] / tandem["duration_s"],
                               "target": s["target"], "meets_target": s["meets_target"]}
                   for s in sides[1:] if "speedup_value" in s},
    }
