"""KV that moves between executors, as a client sees it, on two executors and one scheduler:

- roles: 8 decoding streams beside a stream of long prompts; the decoding streams' inter-token latency
  (p50/p99) while the long prompts run, with `--role prefill` + `--role decode` executors vs two `both` ones,
  plus decode throughput, the long prompts' TTFT and the transfers' bytes and time (scheduler /metrics);
- migration: long streams on both executors; executor 0 is told to stop (SIGTERM: its streams move with their
  KV) vs killed (SIGKILL: they are recomputed on the other); the pause each moved stream saw (its largest gap
  after the signal; p50/max), how long the signalled executor took to exit, and whether both runs' tokens match.
On a loaded machine the absolute figures mean little: compare the rows of one run. See docs/benchmarks.md.
"""
from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import grpc

from benchmarks.cli import add_sizes, choices, make_log, parse, parser, serving_setup
from benchmarks.openai_client import counters, metrics_url
from benchmarks.fleet_failover import Fleet, stream
from benchmarks.measure import summarize
from benchmarks.report import format_table, machine_info, model_json, write_json
from benchmarks.request_metrics import Record
from tandem.generate.v1 import generate_pb2_grpc as gpb_grpc

DEFAULTS = {"decode_streams": 8, "decode_len": 192, "prompt_len": 1024, "prompt_output_len": 4,
            "migration_streams": 8, "migration_prompt_len": 256, "migration_len": 160, "signal_after": 16}
QUICK = {"decode_streams": 4, "decode_len": 64, "prompt_len": 128, "prompt_output_len": 2,
         "migration_streams": 4, "migration_prompt_len": 32, "migration_len": 200, "signal_after": 8}
TRANSFERS, TRANSFER_S = "tandem:kv_transfer_seconds_count", "tandem:kv_transfer_seconds_sum"
COUNTERS = (TRANSFERS, TRANSFER_S, "tandem:kv_transfer_bytes_total", "tandem:requests_migrated_total",
            "tandem:tokens_recomputed_total")  # the scheduler's, read before and after each run
log = make_log("bench_disagg")


def _prompt(n: int, salt: int, vocab: int) -> list[int]:
    return [1] + [(salt * 7919 + 31 * k) % (vocab - 16) + 8 for k in range(n - 1)]


# ----------------------------------------------------------------------------------------------- roles
async def roles_run(pair: Fleet, args: Any, vocab: int) -> dict[str, Any]:
    decode = [Record(i, 16) for i in range(args.decode_streams)]
    prompts: list[Record] = []
    async with grpc.aio.insecure_channel(pair.address) as channel:
        stub = gpb_grpc.GenerateServiceStub(channel)
        await stream(stub, Record(-1, 8), _prompt(8, 999, vocab), 2, 600)  # warm-up
        started = asyncio.Event()
        ready = lambda: all(r.output_len >= 2 for r in decode) and started.set()  # noqa: E731
        streams = asyncio.gather(*(stream(stub, r, _prompt(16, r.index, vocab), args.decode_len, 600, ready)
                                   for r in decode))
        await started.wait()
        window = [time.perf_counter(), 0.0]
        while not all(r.end for r in decode):  # one long prompt after another, while the streams decode
            rec = Record(len(prompts), args.prompt_len)
            prompts.append(rec)
            await stream(stub, rec, _prompt(args.prompt_len, 100 + rec.index, vocab), args.prompt_output_len, 600)
        window[1] = time.perf_counter()
        await streams
    gaps = [(t1 - t0) / n1 for r in decode for (t0, _), (t1, n1) in zip(r.messages, r.messages[1:])
            if window[0] <= t0 and t1 <= window[1]]
    tokens = sum(n for r in decode for t, n in r.messages if window[0] <= t <= window[1])
    return {"itl": summarize(gaps, 1000.0), "decode_tok_s": tokens / max(1e-9, window[1] - window[0]),
            "prompts": len(prompts), "prompt_ttft": summarize([r.messages[0][0] - r.start for r in prompts
                                                              if r.messages], 1000.0),
            "errors": [r.error for r in decode + prompts if r.error]}


# ----------------------------------------------------------------------------------------------- migration
async def migration_run(pair: Fleet, args: Any, vocab: int, sig: signal.Signals) -> dict[str, Any]:
    recs = [Record(i, args.migration_prompt_len) for i in range(args.migration_streams)]
    async with grpc.aio.insecure_channel(pair.address) as channel:
        stub = gpb_grpc.GenerateServiceStub(channel)
        await stream(stub, Record(-1, 8), _prompt(8, 999, vocab), 2, 600)  # warm-up
        started = asyncio.Event()
        ready = lambda: all(r.output_len >= args.signal_after for r in recs) and started.set()  # noqa: E731
        streams = asyncio.ensure_future(asyncio.gather(*(stream(
            stub, r, _prompt(args.migration_prompt_len, 500 + r.index, vocab), args.migration_len, 600, ready)
            for r in recs)))
        await started.wait()
        victim = pair.executors[0]
        t_signal = time.perf_counter()
        victim.proc.send_signal(sig)
        exit_s = await asyncio.get_running_loop().run_in_executor(None, victim.proc.wait)
        exit_s = time.perf_counter() - t_signal
        await streams
    # The signalled executor held about half of the streams (the router spreads them): the moved ones are the half
    # whose largest gap after the signal exceeds their usual gap (a burst's, before it) the most.
    seen = []
    for r in recs:
        before = [(t1 - t0) for (t0, _), (t1, _) in zip(r.messages, r.messages[1:]) if t1 <= t_signal]
        after = [(t1 - max(t0, t_signal)) for (t0, _), (t1, _) in zip(r.messages, r.messages[1:]) if t1 > t_signal]
        typical = sorted(before)[len(before) // 2] if before else 0.0
        seen.append((max(after, default=0.0) - typical, max(after, default=0.0), typical))
    pauses = [largest for _, largest, _ in sorted(seen, reverse=True)[:max(1, len(seen) // 2)]]
    steps = sorted(typical for _, _, typical in seen if typical)
    return {"pause": summarize(pauses, 1000.0), "exit_s": exit_s,
            "step_ms": 1000 * steps[len(steps) // 2] if steps else None,
            "outputs": [r.output_ids for r in recs], "errors": [r.error for r in recs if r.error]}


def measured(model_dir: Path, threads: int, roles: tuple[str, str], run: Any) -> tuple[dict[str, Any], dict]:
    """A fresh pair (two executors, their --role; a scheduler with /metrics): run(pair) (a coroutine) and the
    scheduler counters' change over it; the pair stopped."""
    pair = Fleet(model_dir, [["--threads", str(threads), "--role", r] for r in roles], ["--metrics-port", "0"])
    try:
        before = counters(metrics_url(pair.scheduler), COUNTERS)
        out = asyncio.run(run(pair))
        after = counters(metrics_url(pair.scheduler), COUNTERS)
    finally:
        pair.stop()
    return out, {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after.keys() | before.keys()}


def main(argv: list[str] | None = None) -> int:
    ap = parser("disagg", __doc__, "the tiny shapes, short streams")
    ap.add_argument("--parts", default="roles,migration", help="roles, migration (comma list)")
    add_sizes(ap, DEFAULTS, {"decode-streams": "decoding streams beside the long prompts",
                             "decode-len": "tokens each decoding stream generates",
                             "prompt-len": "tokens of each long prompt", "prompt-output-len": "tokens each generates",
                             "migration-streams": "streams in the migration part",
                             "migration-prompt-len": "their prompt tokens", "migration-len": "their output tokens",
                             "signal-after": "tokens every stream has when executor 0 is signalled"})
    args = parse(ap, argv, QUICK, DEFAULTS)
    threads, model_dir, cfg = serving_setup(args)
    threads, vocab = max(1, threads // 2), cfg.vocab_size
    parts = choices(args.parts, ("roles", "migration"), "--parts")
    results: dict[str, Any] = {"machine": machine_info(), "model": model_json(model_dir, cfg),
                               "threads_per_executor": threads, "args": {k: v for k, v in vars(args).items()
                                                                         if isinstance(v, (int, str, float))}}
    if "roles" in parts:
        rows = []
        for name, roles in (("prefill + decode", ("prefill", "decode")), ("both + both", ("both", "both"))):
            out, delta = measured(model_dir, threads, roles, lambda pair: roles_run(pair, args, vocab))
            n, s = delta.get(TRANSFERS, 0.0), delta.get(TRANSFER_S, 0.0)
            rows.append({"config": name, "itl_p50": out["itl"]["p50"], "itl_p99": out["itl"]["p99"],
                         "decode_tok_s": out["decode_tok_s"], "prompts": out["prompts"],
                         "prompt_ttft_p50": out["prompt_ttft"]["p50"], "transfers": int(n),
                         "transfer_ms_mean": 1000 * s / n if n else None,
                         "transfer_kib": delta.get("tandem:kv_transfer_bytes_total", 0.0) / 1024,
                         "errors": len(out["errors"])})
            log(f"{name}: ITL p99 {out['itl']['p99']} ms")
        results["roles"] = rows
        if rows[0]["itl_p99"] and rows[1]["itl_p99"]:
            results["itl_p99_ratio"] = rows[1]["itl_p99"] / rows[0]["itl_p99"]
        print(format_table(rows, [("config", "config"), ("itl_p50", "ITL p50 ms"), ("itl_p99", "ITL p99 ms"),
                                  ("decode_tok_s", "decode tok/s"), ("prompts", "long prompts"),
                                  ("prompt_ttft_p50", "their TTFT p50 ms"), ("transfers", "transfers"),
                                  ("transfer_ms_mean", "ms each"), ("transfer_kib", "KiB moved"),
                                  ("errors", "errors")]))
        print(f"ITL p99, two `both` / prefill + decode: {results.get('itl_p99_ratio', float('nan')):.2f}x\n")
    if "migration" in parts:
        rows, outputs = [], []
        for name, sig in (("migrate (SIGTERM)", signal.SIGTERM), ("recompute (SIGKILL)", signal.SIGKILL)):
            out, delta = measured(model_dir, threads, ("both", "both"),
                                  lambda pair: migration_run(pair, args, vocab, sig))
            outputs.append(out["outputs"])
            n = delta.get(TRANSFERS, 0.0)
            rows.append({"path": name, "pause_p50": out["pause"]["p50"], "pause_max": out["pause"]["max"],
                         "step_ms": out["step_ms"],
                         "transfer_ms_mean": 1000 * delta.get(TRANSFER_S, 0.0) / n if n else None,
                         "exit_s": out["exit_s"], "migrated": int(delta.get("tandem:requests_migrated_total", 0)),
                         "recomputed_tokens": int(delta.get("tandem:tokens_recomputed_total", 0)),
                         "errors": len(out["errors"])})
        results["migration"] = rows
        results["migration_tokens_identical"] = outputs[0] == outputs[1]
        if rows[0]["pause_p50"] and rows[1]["pause_p50"]:
            results["pause_p50_ratio"] = rows[1]["pause_p50"] / rows[0]["pause_p50"]
        print(format_table(rows, [("path", "path"), ("pause_p50", "pause p50 ms"),
                                  ("pause_max", "pause max ms"), ("step_ms", "usual gap ms"),
                                  ("transfer_ms_mean", "transfer ms"), ("exit_s", "executor exit s"),
                                  ("migrated", "migrated"), ("recomputed_tokens", "tokens recomputed"),
                                  ("errors", "errors")]))
        print(f"tokens identical between the two paths: {results['migration_tokens_identical']}")
    log(f"wrote {write_json(args.out, results)}")
    return 0
