"""Serving benchmark: many concurrent streaming requests against Tandem's Generate service (scheduler +
executor processes), compared with transformers' `generate` on the same prompts, in one run.

Workload. --num-requests prompts of exactly --input-len token ids each, drawn uniformly with a fixed
seed (numpy, --seed) from the model's regular vocabulary: ids below the tokenizer's size, minus its
added/special tokens and the bos/eos/pad ids. Every request asks for exactly --output-len tokens
(Tandem: `stopping.max_new_tokens = --output-len`, `stopping.ignore_eos = true`, greedy; transformers:
`max_new_tokens = --output-len`, greedy, `eos_token_id = []` so that EOS neither stops nor is masked,
as with ignore_eos). The script checks that every request produced exactly --output-len tokens (Tandem:
the streamed ids, usage.completion_tokens and finish_reason LENGTH) and fails (exit 1) when one did not.

Phases, one after the other so that they never share the CPU:
1. Peak: the fp32 matmul GFLOP/s of this machine with --threads threads (benchmarks/measure.py; measured again at
   the end, the higher counts) — the denominator of "% peak".
2. Tandem: unless --target names a running scheduler, `python -m executor_service --threads T` and
   `python -m scheduler` are started (tandem/server_process.py). --warmup requests first (other
   prompts, same shape; untimed), then the timed run from a grpc.aio client in this process:
   - closed loop (default): --concurrency N requests in flight; each finished one starts the next;
   - open loop (--request-rate R): Poisson arrivals at R requests/s (exponential gaps, fixed seed);
     --concurrency, when given, caps the requests in flight (a request then waits for a slot and its
     clock starts when it is sent).
   The servers are stopped before the baselines run (with --target the scheduler is left alone, idle).
   The scheduler's and this client's CPU time are part of Tandem's cost: on a 2-core machine they
   compete with the executor's threads.
3. Baselines (--baseline, a comma list), in this process with torch.set_num_threads(--threads), the
   executor's thread count; `AutoModelForCausalLM.from_pretrained(dtype=float32)` + `generate`:
   - hf: batches of --hf-batch-size prompts (default: --concurrency), one `generate` per batch, batches
     one after the other (all prompts have one length: no padding; the attention mask is passed);
   - hf-serial: one prompt at a time, as a naive server would. Only the first --hf-serial-requests
     prompts are timed (0 = all) and the duration for all of them is extrapolated (mean time per
     request x --num-requests); throughputs are those of the timed requests.
   One untimed warm-up `generate` per baseline first (the same batch shape, 4 new tokens).

Per-request timings (all sides the same way; seconds from the request's start, reported in ms):
- TTFT: first response message that carries >= 1 token (transformers: the first token step seen by a
  `BaseStreamer`, the same instant for every request of a batch);
- E2E latency: until the stream ended (transformers: `generate` returned);
- TPOT: (E2E latency - TTFT) / (output tokens - 1), one value per request;
- ITL: the gaps between successive token-carrying messages, one value per token: a message carrying
  k tokens contributes k values of gap / k (and the first message's extra tokens count as 0 gaps), so
  each request gives output-len - 1 values. JSON `itl_messages_ms` keeps the raw per-message gaps.
A request's start is when it was sent (Tandem), its batch's `generate` call began (hf; later batches
start when the previous one returned, as in a closed loop with --hf-batch-size clients), or its own
`generate` call began (hf-serial).
Throughputs: requests / duration, output tokens / duration, (prompt + output tokens) / duration;
duration = first request start to last request end.

FLOPs (the same useful work for every side, whatever each implementation executes on top, e.g.
padding or recomputation after a preemption): per request with prompt P and output O, the forward
passes process P + O - 1 tokens (the last sampled token is never fed back): 2 x (linear weights of the
decoder layers: q, k, v, o, gate, up, down) per processed token + 2 x hidden x vocab (LM head) for each
of the O sampled tokens + attention 4 x heads x head_dim x layers per (query, key) pair, causal
(prefill: P (P + 1) / 2 pairs; the decode token at position p: p + 1 keys). GFLOP/s = all requests'
FLOPs / duration; % peak = that / the measured fp32 matmul peak (phase 1).

Output: two tables on stdout (throughput with the speedups of Tandem over each baseline and the
targets; latency mean / p50 / p99 in ms), JSON (--out, default bench_results/bench_serving.json: config,
machine, model, every metric, per-request raw timings and CPU use per process) and a PNG (--plot,
default: the JSON path with .png): (a) Tandem's request timeline — one line per request from send to
end, a dot at its first token; (b) output tokens delivered over time, per side; (c) ITL histograms;
(d) output-token throughput per side. The "cores" columns say how many cores each process kept busy
during its phase (/proc), and "other cores" how many the rest of the machine used meanwhile: above ~0.2
on a 2-core machine the timings were disturbed by another job.

    python scripts/bench_serving.py --baseline hf,hf-serial     # SmolLM2, 32 x (128 in, 64 out), 32 clients
    python scripts/bench_serving.py --quick --model /tmp/tiny-llama --baseline hf,hf-serial
    python scripts/bench_serving.py --target 127.0.0.1:50052 --request-rate 4 --num-requests 64

Front ends (--backend grpc,openai-chat): the same workload also through the scheduler's OpenAI-compatible
HTTP front (streamed chat completions, as vLLM's `openai-chat` backend), alternating with gRPC over
--rounds; both then send the prompts as one user chat message (the text of the random ids), the baselines get
the rendered ids; a third table compares the two (benchmarks/serving_backends.py says how and why).

    python scripts/bench_serving.py --backend grpc,openai-chat --num-requests 64   # HTTP vs gRPC, 32 clients

Benchmark-only (baselines need transformers, the plot matplotlib); never imported by the servers.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch

from benchmarks import runtime
from benchmarks.baselines import HfBaseline
from benchmarks.cli import add_process_args, apply_preset, make_log, parser
from benchmarks.cpu import CpuMeter
from benchmarks.flops import FlopModel
from benchmarks.measure import measure_matmul_peak
from benchmarks.plot import write_plot
from benchmarks.report import write_json
from benchmarks.request_metrics import Record, aggregate, agreement
from benchmarks.serving_backends import BACKENDS, bad_records, compare, identical_outputs, print_comparison
from benchmarks.serving_report import compare_sides, payload, print_report
from benchmarks.serving_tandem import TandemRun, run_tandem
from models.config import ModelConfig

BASELINES = ("hf", "hf-serial")
QUICK = {"num_requests": 4, "input_len": 16, "output_len": 8, "concurrency": 2, "warmup": 1,
         "hf_serial_requests": 0, "peak_n": 256, "peak_repeats": 3}
DEFAULTS = {"num_requests": 32, "input_len": 128, "output_len": 64, "concurrency": 32, "warmup": 2,
            "hf_serial_requests": 8, "peak_n": 2048, "peak_repeats": 7}

log = make_log("bench_serving")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = parser(__doc__, epilog="Method and how to read the output: see the module docstring "
                                "(head -60 benchmarks/serving.py).")
    ap.add_argument("--model", type=Path, default=None,
                    help="HF model directory served by the executor, used for the prompts' vocabulary, the "
                         "FLOP count and the baselines (default: SmolLM2-135M-Instruct via "
                         "scripts/prepare_default_model.py; with --target and no --model, the vocabulary comes "
                         "from GetModelInfo, FLOPs are not counted and no baseline can run)")
    ap.add_argument("--target", default=None, metavar="HOST:PORT",
                    help="benchmark this running scheduler instead of starting an executor and a scheduler "
                         "(it is left running; --threads, --executor-args and --scheduler-args do not apply)")
    ap.add_argument("--target-http", default=None, metavar="URL",
                    help="with --target and --backend openai-chat: the scheduler's HTTP front (http://HOST:PORT)")
    ap.add_argument("--backend", default="grpc",
                    help="comma list of front ends the timed run goes through: grpc (Generate), openai-chat "
                         "(HTTP /v1/chat/completions, streamed); default grpc. grpc,openai-chat compares them on the "
                         "same chat prompts (see benchmarks/serving_backends.py)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="timed passes per backend, alternating A B B A ... (default: 2 with two backends, else 1)")
    ap.add_argument("--input-len", type=int, default=None,
                    help=f"prompt tokens per request (default {DEFAULTS['input_len']})")
    ap.add_argument("--output-len", type=int, default=None,
                    help=f"generated tokens per request, exactly (default {DEFAULTS['output_len']})")
    ap.add_argument("--num-requests", type=int, default=None,
                    help=f"timed requests (default {DEFAULTS['num_requests']})")
    ap.add_argument("--concurrency", type=int, default=None,
                    help=f"closed loop: requests in flight (default {DEFAULTS['concurrency']}); with "
                         f"--request-rate: the most in flight (default: no cap)")
    ap.add_argument("--request-rate", type=float, default=None,
                    help="open loop: Poisson arrivals at this many requests/s (default: closed loop)")
    ap.add_argument("--baseline", default="",
                    help="comma list of baselines run after Tandem on the same prompts: hf (batched generate), "
                         "hf-serial (one request at a time); default none")
    ap.add_argument("--hf-batch-size", type=int, default=None,
                    help="prompts per generate call of the hf baseline (default: --concurrency, or every "
                         "request with an uncapped --request-rate)")
    ap.add_argument("--hf-serial-requests", type=int, default=None,
                    help="hf-serial: time only the first K prompts and extrapolate the duration to all "
                         f"(default {DEFAULTS['hf_serial_requests']}; 0 = all; --quick: all)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of the executor and of the baselines (default: every usable core)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts and of the arrival times (default 0)")
    ap.add_argument("--warmup", type=int, default=None,
                    help=f"untimed Tandem requests before the timed run (default {DEFAULTS['warmup']}; "
                         f"baselines: one untimed generate each, unless 0)")
    add_process_args(ap, "they come after the script's own: --threads T, --kv-blocks sized for the run (unless "
                         "--kv-blocks or --kv-memory-fraction is given here), --log-level WARNING")
    ap.add_argument("--peak-n", type=int, default=None,
                    help=f"matmul size of the peak measurement (default {DEFAULTS['peak_n']})")
    ap.add_argument("--peak-repeats", type=int, default=None,
                    help=f"timed matmuls per peak measurement (default {DEFAULTS['peak_repeats']})")
    ap.add_argument("--out", type=Path, default=Path("bench_results/bench_serving.json"),
                    help="JSON results file (default bench_results/bench_serving.json)")
    ap.add_argument("--plot", type=Path, default=None,
                    help="PNG plot file (default: --out with the suffix .png)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 4 requests, input 16, output 8, concurrency 2, warmup 1, every hf-serial "
                         "request timed, a small peak matmul (explicit flags still win)")
    args = ap.parse_args(argv)
    preset = QUICK if args.quick else DEFAULTS
    # open loop: no cap on the requests in flight unless asked for
    apply_preset(args, preset, keep_unset=("concurrency",) if args.request_rate is not None else ())
    if args.input_len < 1 or args.output_len < 1 or args.num_requests < 1 or args.warmup < 0:
        ap.error("--input-len, --output-len and --num-requests must be >= 1, --warmup >= 0")
    if args.concurrency is not None and args.concurrency < 1:
        ap.error("--concurrency must be >= 1")
    if args.request_rate is not None and not args.request_rate > 0:
        ap.error("--request-rate must be > 0")
    if args.hf_serial_requests < 0:
        ap.error("--hf-serial-requests must be >= 0")
    args.backends = list(dict.fromkeys(b.strip() for b in args.backend.split(",") if b.strip()))
    if "grpc" not in args.backends or any(b not in BACKENDS for b in args.backends):
        ap.error(f"--backend: a comma list of {', '.join(BACKENDS)} that includes grpc")
    if args.target and "openai-chat" in args.backends and not args.target_http:
        ap.error("--backend openai-chat with --target needs --target-http URL")
    if args.rounds is None:
        args.rounds = 2 if len(args.backends) > 1 else 1
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    args.baselines = [b.strip() for b in args.baseline.split(",") if b.strip()]
    unknown = [b for b in args.baselines if b not in BASELINES]
    if unknown:
        ap.error(f"--baseline: unknown {', '.join(unknown)} (choose from {', '.join(BASELINES)})")
    if args.hf_batch_size is None:
        args.hf_batch_size = args.concurrency or args.num_requests
    args.hf_batch_size = max(1, min(args.hf_batch_size, args.num_requests))
    if args.plot is None:
        args.plot = args.out.with_suffix(".png")
    return args


def run_baselines(args, model_dir: Path, run: TandemRun, flops_total: float | None, sides: list[dict[str, Any]],
                  all_records: dict[str, list[Record]], t0s: dict[str, float]) -> dict[str, Any]:
    """transformers on the same prompts, with the servers stopped: appends a side per baseline; returns each
    one's settings."""
    baseline_info: dict[str, Any] = {}
    hf_model = HfBaseline(model_dir, pad_id=int(json.loads((model_dir / "config.json").read_text())
                                                .get("pad_token_id") or 0), log=log)
    for name in args.baselines:
        meter = CpuMeter({"client": os.getpid()})
        meter.start()
        if name == "hf":
            recs, b_t0, measured = hf_model.run(name, run.prompts, args.hf_batch_size, args.output_len,
                                                warmup=args.warmup > 0)
            duration_b, info = measured, {"batch_size": args.hf_batch_size}
        else:
            k = args.hf_serial_requests or args.num_requests
            k = min(k, args.num_requests)
            recs, b_t0, measured = hf_model.run(name, run.prompts[:k], 1, args.output_len, warmup=args.warmup > 0)
            duration_b = measured * args.num_requests / k
            info = {"timed_requests": k, "measured_s": measured, "extrapolated": k < args.num_requests}
        cpu_b = meter.stop()
        side = aggregate(name, recs, b_t0, measured, flops_total, None, args.output_len)
        side["duration_s"] = duration_b  # hf-serial: extrapolated to every request (rates: measured)
        side.update(cpu=cpu_b, settings=info, agreement_with_tandem=agreement(recs, run.records))
        sides.append(side)
        all_records[name] = recs
        t0s[name] = b_t0
        baseline_info[name] = info
        log(f"{name}: {side['output_throughput']:.1f} output tok/s (measured {measured:.2f}s)")
    return baseline_info


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runtime.exit_on_sigterm()
    threads = runtime.set_threads(args.threads)
    model_dir = Path(args.model) if args.model else (None if args.target else runtime.default_model_dir())
    if args.baselines and model_dir is None:
        raise SystemExit("error: --baseline needs --model DIR (the model the --target scheduler serves)")
    cfg = ModelConfig.from_dir(model_dir) if model_dir else None
    flop_model = FlopModel.from_config(cfg) if cfg else None
    flops_req = flop_model.request(args.input_len, args.output_len) if flop_model else None
    flops_total = flops_req and flops_req["total"]
    if cfg and args.input_len + args.output_len > cfg.max_position_embeddings:
        raise SystemExit(f"error: --input-len + --output-len = {args.input_len + args.output_len} is past the "
                         f"model's {cfg.max_position_embeddings} positions")
    mode = (f"closed loop, {args.concurrency} in flight" if args.request_rate is None else
            f"Poisson {args.request_rate:g} req/s" + (f", at most {args.concurrency} in flight"
                                                       if args.concurrency else ""))
    log(f"model {model_dir or args.target}; {args.num_requests} requests x ({args.input_len} in, "
        f"{args.output_len} out), {mode}; {threads} threads; baselines: {', '.join(args.baselines) or 'none'}")

    peak_before = measure_matmul_peak("cpu", torch.float32, n=args.peak_n, repeats=args.peak_repeats)
    log(f"fp32 matmul peak (before): {peak_before.gflops:.1f} GFLOP/s")

    run = run_tandem(args, model_dir, cfg, threads)
    if run.chat and flop_model:  # chat prompts: their rendered lengths vary
        flops_total = sum(flop_model.request(len(p), args.output_len)["total"] for p in run.prompts) / len(run.prompts)
    records = run.records
    tandem = aggregate("tandem", records, run.t0, run.duration, flops_total, None, args.output_len)
    tandem["cpu"] = run.cpu
    tandem["executor_metrics"] = run.executor_metrics
    sides = [tandem]
    all_records = {"tandem": records}
    t0s = {"tandem": run.t0}
    bad = bad_records(records, "grpc", args.output_len)
    if "openai-chat" in run.backends:
        b = run.backends["openai-chat"]
        http_side = aggregate("openai-chat", b["records"], b["t0"], b["duration"], flops_total, None, args.output_len)
        http_side["cpu"] = b["cpu"]
        sides.append(http_side)
        all_records["openai-chat"] = b["records"]
        t0s["openai-chat"] = b["t0"]
        bad += bad_records(b["records"], "openai-chat", args.output_len)
    for r in bad[:5]:
        log(f"request {r.index}: error {r.error}, {r.output_len} streamed tokens, usage {r.usage}, "
            f"finish {r.finish_reason or '-'}")

    baseline_info = run_baselines(args, model_dir, run, flops_total, sides, all_records, t0s) \
        if args.baselines else {}

    peak_after = measure_matmul_peak("cpu", torch.float32, n=args.peak_n, repeats=args.peak_repeats)
    peak = max(peak_before.gflops, peak_after.gflops)
    log(f"fp32 matmul peak (after): {peak_after.gflops:.1f} GFLOP/s")
    compare_sides(sides, peak)

    model_info = run.model_info
    model_name = model_dir.name if model_dir else model_info.get("model_id", "?")
    header = (f"model: {model_name}  ({cfg.architecture if cfg else model_info.get('architecture')}, "
              f"{model_info.get('dtype', '?')} on {model_info.get('device', '?')})  threads: {threads}  "
              f"peak fp32 matmul: {peak:.1f} GFLOP/s")
    workload = (f"workload: {args.num_requests} requests x ({args.input_len} prompt, {args.output_len} output "
                f"tokens), {mode}, seed {args.seed}; tandem = scheduler {run.address}"
                + (f"; backends {', '.join(args.backends)}, {args.rounds} rounds, prompts sent as one user chat "
                   f"message: {sum(map(len, run.prompts)) / len(run.prompts):.1f} tokens rendered on average"
                   if run.chat else "")
                + (f"; hf batch {args.hf_batch_size}" if "hf" in args.baselines else "")
                + (f"; hf-serial timed {baseline_info['hf-serial']['timed_requests']} of {args.num_requests}"
                   f"{' (duration extrapolated)' if baseline_info['hf-serial']['extrapolated'] else ''}"
                   if "hf-serial" in baseline_info else ""))
    print_report(args, sides, header, workload, run.executor_metrics, bad, len(records))
    comparison = None
    if "openai-chat" in run.backends:
        same = identical_outputs(records, run.backends["openai-chat"]["records"])
        comparison = {**compare(tandem, sides[1]), "identical_outputs": {"identical": same[0], "compared": same[1]},
                      "phases": run.phases}
        print_comparison({"grpc": tandem, "openai-chat": sides[1]}, comparison, run.phases, same)

    flops = None if flop_model is None else {**flop_model.as_dict(), "per_request": flops_req}
    results = payload(args, run, sides, model_dir, model_name, mode, threads,
                      {"gflops": peak, "before": peak_before.as_dict(), "after": peak_after.as_dict()}, flops,
                      not bad)
    title = (f"{model_name}: {args.num_requests} x ({args.input_len} in, {args.output_len} out), {mode}, "
             f"{threads} threads")
    plot = write_plot(args.plot, sides, all_records, t0s, title, log)
    results["plot"] = str(plot) if plot else None
    results["backends"] = {b: ("tandem" if b == "grpc" else b) for b in run.backends}  # backend -> its side
    results["backend_comparison"] = comparison
    path = write_json(args.out, results)
    log(f"wrote {path}" + (f" and {plot}" if plot else ""))
    return 1 if bad else 0
