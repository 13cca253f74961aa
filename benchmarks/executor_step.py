"""Decode-step latency: the in-process Executor vs the same Executor behind gRPC (a real server process).

The script starts `python -m executor_service --port 0` on the same model, with the same --threads, device
and dtype as the in-process `Executor` it builds itself, and drives both with the same random prompts
(fixed seed). Both processes exist at once; while one side is timed the other is idle.

Configurations (each at every --batches size B, greedy sampling):

- tokens:      output mode TOKENS, num_steps 1 (the sampled token and its logprob come back);
- logits/f32:  output mode LOGITS, num_steps 1; gRPC returns float32 logits (B x vocab x 4 bytes);
- logits/bf16: the same with LOGITS_DTYPE_BFLOAT16 over the wire (half the bytes). The in-process API has
               no wire dtype: that side is the same call as logits/f32 (float32 tensors, nothing encoded);
- tokens/x8:   output mode TOKENS, num_steps --multi-steps (8): one call runs 8 steps, feeding each sampled
               token back inside the executor. ms/step = call time / 8; `xN/x1` = that per-token time over
               the tokens row's (num_steps 1) per-step time at the same batch, per side. Each timed call
               advances 8 positions, so these steps attend to longer contexts than the tokens row's; the
               in-process xN/x1 measures that effect alone, and `g/i` = grpc xN/x1 / inproc xN/x1 is what
               amortising the round trip over 8 steps buys gRPC (< 1: it helps).

Per configuration and side: prefill B prompts of --context tokens (untimed, UnifiedDecode in calls of at
most --max-batch-tokens tokens), --warmup untimed steps, then --steps timed calls, feeding the sampled
token (logits modes: the argmax of the returned logits, computed outside the timed region on both sides)
back; then the caches are released. The two sides' calls alternate (in-process first on even steps,
gRPC first on odd ones), so a noisy, shared machine slows both alike: compare the ratios of one run, not
absolute times across runs.

What one timed call covers, on each side (the same client work, so the ratio is fair):
- in-process: building the B `DecodeItem`s from the previous step's (cache id, length, token) +
  `Executor.decode()` + reading the results (token ids and lengths; logits modes: the float32 tensors);
- gRPC: building the `DecodeRequest` message from the same state (client-side request construction is
  part of the gRPC cost and is timed) + `stub.Decode()` (serialisation, loopback round trip, the server's
  interceptor, codec and executor, response parsing) + reading the response (token ids and lengths;
  logits modes: `codec.decode_logits` of every row into a float32 array, as a client needs them).
Columns: ms/step = median call time / num_steps; grpc/inproc = ratio of the medians (min ratio: of the
fastest calls, steadier when other jobs share the machine); resp bytes = the serialised DecodeResponse;
tok/s = B x num_steps / median call time.

Where gRPC time goes (the breakdown table, means over the timed calls, ms per call): `grpc-inproc` = the
difference of the mean call times, split into `op diff` = the server's executor decode time
(GetMetrics operations["decode"]) minus the in-process one (the same work in two processes), `servicer`
= the server's interceptor-timed handler time (rpcs["Decode"]) minus its executor time (codec proto <->
domain, response building, logits encoding), `transport` = the client's stub.Decode time minus the
handler time (request/response (de)serialisation on both ends, loopback channel, gRPC threads) and
`client diff` = the gRPC client's request building + response reading minus the in-process side's.
`serde (micro)` / `codec (micro)` time those pieces alone in this process on the last call's messages
(JSON `micro_ms`); JSON `empty_rpc` is the round trip of an empty ReleaseCache (channel + interceptor +
gRPC's per-call cost without payload), `interceptor_overhead_ms` the interceptor wrapper alone.
`inproc cpu` / `srv cpu`: CPU ms per call of this process (process time) and of the server (/proc, all
threads); `cores`: that CPU time per wall-clock second of the side's calls; `inproc thr` / `srv thr`:
threads that used >= 10% of the side's timed wall time. JSON `other_processes_cores`: cores other processes
kept busy during the row's timed calls (/proc/stat; null for windows under 2 s); above 0.25 a note flags
the row, as its ratios are not the idle-machine ones.

Reading `op diff`: torch's CPU ops run on OpenMP (libgomp), and every thread that has run model ops owns
its own team of T - 1 worker threads for as long as it lives. The server therefore runs load, warm-up and
every RPC's model work on one dedicated thread (executor_service/model_thread.py); `srv thr` <= T confirms
it. Before that fix the server's extra idle teams made libgomp park its workers instead of spinning, and
`op diff` showed a ~18 % slower step for the same CPU time.

    python scripts/bench_executor.py                        # SmolLM2-135M-Instruct (prepared if needed)
    python scripts/bench_executor.py --quick --model /tmp/tiny-llama
    python scripts/bench_executor.py --batches 32 --configs tokens --steps 32

Benchmark-only; never imported by the servers.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import grpc
import torch

from benchmarks import omp_policy, runtime
from benchmarks.cli import (add_batch_args, add_device_args, add_model_arg, add_out_args, int_list, make_log, parser,
                            parse_with_preset)
from benchmarks.cpu import busy_threads, loadavg, machine_busy_s, other_cores, thread_cpu_s
from benchmarks.executor_server import ServerProcess
from benchmarks.executor_sides import Config, GrpcSide, InProcSide, make_configs
from benchmarks.executor_step_report import print_report, results_json, with_derived_columns
from benchmarks.grpc_costs import empty_rpc_ms, interceptor_overhead_ms, micro_breakdown
from benchmarks.local_executor import build_executor
from benchmarks.measure import time_stats
from benchmarks.report import write_json
from benchmarks.workloads import kv_blocks, random_prompts
from tandem.executor.v1 import executor_pb2 as pb
from tandem.executor.v1 import executor_pb2_grpc as pb_grpc

MAX_MESSAGE_MB = 64  # the server's default --max-message-mb
QUICK = {"batches": "1,4", "steps": 3, "warmup": 1, "context": 16, "empty_rpcs": 20, "micro_repeats": 5}
DEFAULTS = {"batches": "1,8,32,64", "steps": 16, "warmup": 2, "context": 128, "empty_rpcs": 200,
            "micro_repeats": 20}

log = make_log("bench_executor")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = parser(__doc__)
    add_model_arg(ap)
    add_batch_args(ap, DEFAULTS)
    ap.add_argument("--steps", type=int, default=None,
                    help=f"timed decode calls per side and configuration (default {DEFAULTS['steps']})")
    ap.add_argument("--warmup", type=int, default=None,
                    help=f"untimed decode calls first (default {DEFAULTS['warmup']})")
    ap.add_argument("--multi-steps", type=int, default=8,
                    help="num_steps of the multi-step configuration (default 8)")
    ap.add_argument("--configs", default=None,
                    help="comma-separated subset of: tokens, logits/f32, logits/bf16, tokens/xN (default: all)")
    add_device_args(ap)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of each side (the server gets --threads T; default: every usable core)")
    ap.add_argument("--omp-wait-policy", choices=omp_policy.OMP_WAIT_POLICIES, type=str.lower, default=None,
                    help="OMP_WAIT_POLICY of both sides: passive, active, or unset = libgomp's default "
                         "(default: the environment's, i.e. as a server started by hand runs)")
    ap.add_argument("--max-batch-tokens", type=int, default=8192,
                    help="both sides' per-call token limit (default 8192)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    ap.add_argument("--empty-rpcs", type=int, default=None, help="timed empty RPCs for the baseline round trip")
    ap.add_argument("--micro-repeats", type=int, default=None, help="repeats of each serialisation micro-timing")
    ap.add_argument("--server-timeout", type=float, default=600.0, help="seconds to wait for the server's READY")
    add_out_args(ap, "bench_executor",
                 "smoke run: batches 1,4; steps 3; warmup 1; context 16 (explicit flags still win)")
    args = parse_with_preset(ap, argv, QUICK, DEFAULTS)
    args.batch_list = int_list(args.batches, "--batches")
    if args.context < 1 or args.steps < 1 or args.warmup < 0 or args.multi_steps < 2:
        ap.error("--context and --steps must be >= 1, --warmup >= 0, --multi-steps >= 2")
    if args.empty_rpcs < 1 or args.micro_repeats < 1:
        ap.error("--empty-rpcs and --micro-repeats must be >= 1")
    all_configs = make_configs(args.multi_steps)
    names = [n.strip() for n in args.configs.split(",") if n.strip()] if args.configs else list(all_configs)
    unknown = [n for n in names if n not in all_configs]
    if unknown or not names:
        ap.error(f"--configs: unknown {unknown}; choose from {', '.join(all_configs)}")
    args.config_list = [all_configs[n] for n in names]
    return args


def mean_ms(seconds: list[float]) -> float:
    return 1e3 * statistics.fmean(seconds)


def mean_between(before: tuple[int, float], after: tuple[int, float]) -> float | None:
    """Mean ms of the calls recorded between two (count, total ms) snapshots."""
    n = after[0] - before[0]
    return (after[1] - before[1]) / n if n > 0 else None


def bench_config(inproc: InProcSide, grpc_side: GrpcSide, cfg: Config, batch: int, vocab: int, args,
                 device: torch.device) -> dict[str, Any]:
    """One configuration at one batch size: both sides prefill the same prompts, warm up, then time their
    calls alternately; the row of results (both sides' times, ratios, CPU use, breakdown)."""
    prompts = random_prompts(batch, args.context, vocab, args.seed + batch).tolist()
    try:
        inproc.prefill(prompts)
        grpc_side.prefill(prompts)
        first_agree = inproc.tokens == grpc_side.tokens
        for step in range(args.warmup):
            for side in ((inproc, grpc_side) if step % 2 == 0 else (grpc_side, inproc)):
                side.step(cfg, timed=False)
        inproc.reset_timing(device)
        grpc_side.reset_timing(device)
        op0, srv0 = inproc.op_stats(), grpc_side.server_stats()
        load0, busy0, wall0 = loadavg(), machine_busy_s(), time.perf_counter()
        threads0 = (thread_cpu_s(os.getpid()), thread_cpu_s(grpc_side.server_pid))
        for step in range(args.steps):  # alternate who goes first
            for side in ((inproc, grpc_side) if step % 2 == 0 else (grpc_side, inproc)):
                side.step(cfg, timed=True)
        threads1 = (thread_cpu_s(os.getpid()), thread_cpu_s(grpc_side.server_pid))
        load1, busy1, wall1 = loadavg(), machine_busy_s(), time.perf_counter()
        op1, srv1 = inproc.op_stats(), grpc_side.server_stats()
        micro = micro_breakdown(inproc, grpc_side, args.micro_repeats)
        req_bytes, resp_bytes = grpc_side.last_request.ByteSize(), grpc_side.last_response.ByteSize()
    finally:
        inproc.release()
        grpc_side.release()

    n = cfg.num_steps
    i_calls, g_calls = inproc.clock.times, grpc_side.clock.times
    # This process's threads also run the gRPC client (little CPU); the server's only serve the gRPC side.
    bench_cpu, bench_busy = busy_threads(threads0[0], threads1[0], sum(i_calls))
    srv_cpu, srv_busy = busy_threads(threads0[1], threads1[1], sum(g_calls))
    # Cores that other processes kept busy meanwhile (the machine's busy time minus both sides' CPU time).
    others = other_cores(busy0, busy1, bench_cpu + srv_cpu, wall1 - wall0)
    i_call, g_call = statistics.median(i_calls), statistics.median(g_calls)
    agree = sum(a == b for a, b in zip(inproc.history, grpc_side.history)) / len(inproc.history)
    inproc_op = mean_between(op0, op1)
    srv_op, srv_rpc = mean_between(srv0["op"], srv1["op"]), mean_between(srv0["rpc"], srv1["rpc"])
    g_mean, i_mean = mean_ms(g_calls), mean_ms(i_calls)
    breakdown = {  # means over the timed calls, ms per call
        "inproc_call": i_mean, "grpc_call": g_mean, "overhead": g_mean - i_mean,
        "inproc_op": inproc_op, "server_op": srv_op, "server_rpc": srv_rpc,
        "op_diff": None if srv_op is None or inproc_op is None else srv_op - inproc_op,
        "servicer": None if srv_rpc is None or srv_op is None else srv_rpc - srv_op,
        "transport": None if srv_rpc is None else mean_ms(grpc_side.parts["call"]) - srv_rpc,
        "grpc_client": mean_ms(grpc_side.parts["build"]) + mean_ms(grpc_side.parts["read"]),
        "inproc_client": mean_ms(inproc.parts["build"]) + mean_ms(inproc.parts["read"]),
        "grpc_build": mean_ms(grpc_side.parts["build"]), "grpc_read": mean_ms(grpc_side.parts["read"]),
        "grpc_stub_call": mean_ms(grpc_side.parts["call"]),
        "inproc_build": mean_ms(inproc.parts["build"]), "inproc_read": mean_ms(inproc.parts["read"]),
        "inproc_decode_call": mean_ms(inproc.parts["call"]),
    }
    return {
        "config": cfg.name, "mode": cfg.mode.value, "logits_dtype": pb.LogitsDtype.Name(cfg.logits_dtype)
        if not cfg.wants_tokens else None, "num_steps": n, "batch": batch, "context": args.context,
        "inproc_ms": 1e3 * i_call / n, "grpc_ms": 1e3 * g_call / n, "grpc_over_inproc": g_call / i_call,
        "grpc_over_inproc_min": min(g_calls) / min(i_calls),
        "inproc_call_ms": 1e3 * i_call, "grpc_call_ms": 1e3 * g_call,
        "inproc_tok_s": batch * n / i_call, "grpc_tok_s": batch * n / g_call,
        "request_bytes": req_bytes, "response_bytes": resp_bytes,
        "inproc_cpu_ms": 1e3 * statistics.median(inproc.clock.cpu_times),
        "grpc_client_cpu_ms": 1e3 * statistics.median(grpc_side.clock.cpu_times),
        "server_cpu_ms": 1e3 * srv_cpu / len(g_calls), "server_busy_threads": srv_busy,
        # CPU per wall second while each side ran: ~T when a side had its T cores, less when others competed.
        "inproc_cores": statistics.fmean(inproc.clock.cpu_times) / statistics.fmean(i_calls),
        "server_cores": srv_cpu / sum(g_calls),
        "inproc_busy_threads": bench_busy, "loadavg_1m": [load0, load1], "other_processes_cores": others,
        "tokens_agree": agree, "prefill_tokens_agree": first_agree,
        "breakdown_ms": breakdown, "micro_ms": micro,
        "inproc_times": time_stats(i_calls), "grpc_times": time_stats(g_calls),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.omp_wait_policy and args.omp_wait_policy != omp_policy.applied:
        log(f"warning: --omp-wait-policy {args.omp_wait_policy} only acts when the script is run as a program "
            f"(torch is imported by then); OMP_WAIT_POLICY is {omp_policy.current()}")
    runtime.exit_on_sigterm()
    threads = runtime.set_threads(args.threads)
    device = runtime.torch_device(args.device)
    model_dir = runtime.model_dir(args.model)
    max_steps = max(c.num_steps for c in args.config_list)
    per_seq_tokens = args.context + 1 + (args.warmup + args.steps) * max_steps
    kv = kv_blocks(max(args.batch_list), per_seq_tokens)
    max_batch_tokens = max(args.max_batch_tokens, args.context)
    log(f"model {model_dir}, device {device}, dtype {args.dtype}, {threads} threads per side, "
        f"KV {kv} blocks per side")

    cmd = [sys.executable, "-m", "executor_service", "--model", str(model_dir), "--port", "0",
           "--kv-blocks", str(kv), "--threads", str(threads), "--device", args.device, "--dtype", args.dtype,
           "--max-batch-tokens", str(max_batch_tokens), "--max-message-mb", str(MAX_MESSAGE_MB),
           "--log-level", "WARNING"]
    t0 = time.perf_counter()
    server = ServerProcess(cmd)  # loads while this process loads its own copy
    channel = None
    try:
        ex = build_executor(model_dir, args.device, args.dtype, kv, max_batch_tokens)
        warm = ex.prefill([ex.info().bos_token_id or 0] * 4)  # as the server does before READY
        ex.release_cache([warm.cache.cache_id])
        address = server.wait_ready(args.server_timeout)
        limit = MAX_MESSAGE_MB * 1024 * 1024
        channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", limit),
                                                          ("grpc.max_send_message_length", limit)])
        grpc.channel_ready_future(channel).result(timeout=30)
        stub = pb_grpc.ExecutorServiceStub(channel)
        info = stub.GetInfo(pb.GetInfoRequest())
        log(f"server {address} (pid {server.proc.pid}) and in-process executor ready in "
            f"{time.perf_counter() - t0:.1f}s")
        inproc, grpc_side = InProcSide(ex), GrpcSide(stub, max_batch_tokens, device, server.proc.pid)
        vocab, max_len = ex.model_config.vocab_size, ex.model_config.max_position_embeddings
        if per_seq_tokens > max_len:
            raise SystemExit(f"error: --context {args.context} + 1 + (--warmup {args.warmup} + --steps {args.steps}) x "
                             f"{max_steps} steps per call = {per_seq_tokens} tokens per sequence; the model takes at "
                             f"most {max_len}")

        empty_before = empty_rpc_ms(stub, args.empty_rpcs)
        interceptor_ms = interceptor_overhead_ms()
        log(f"empty RPC round trip {empty_before['median_ms']:.3f} ms; "
            f"interceptor wrapper {interceptor_ms * 1e3:.2f} us")
        rows: list[dict[str, Any]] = []
        for b in args.batch_list:
            for cfg in args.config_list:
                t1 = time.perf_counter()
                r = bench_config(inproc, grpc_side, cfg, b, vocab, args, device)
                rows.append(r)
                log(f"{cfg.name} batch {b}: inproc {r['inproc_ms']:.2f} ms/step, grpc {r['grpc_ms']:.2f} ms/step, "
                    f"grpc/inproc {r['grpc_over_inproc']:.3f} ({time.perf_counter() - t1:.1f}s)")
        empty_after = empty_rpc_ms(stub, args.empty_rpcs)
        server_info = {"address": address, "pid": server.proc.pid, "command": cmd, "model_id": info.model_id,
                       "dtype": info.dtype, "device": info.device, "kv_total_blocks": info.kv.total_blocks}
    finally:
        if channel is not None:
            channel.close()
        code = server.stop()
    log(f"server stopped (exit code {code})")

    with_derived_columns(rows)
    empty_rpc = {"before": empty_before, "after": empty_after}
    print_report(args, rows, model_dir, ex.model_config, device, threads, empty_rpc, interceptor_ms)
    settings = {"batches": args.batch_list, "configs": [c.name for c in args.config_list],
                "context": args.context, "steps": args.steps, "warmup": args.warmup,
                "multi_steps": args.multi_steps, "threads_per_side": threads, "dtype": args.dtype,
                "seed": args.seed, "kv_blocks": kv, "max_batch_tokens": max_batch_tokens,
                "max_message_mb": MAX_MESSAGE_MB, "quick": args.quick,
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY") or "unset (libgomp default)",
                "timed_region": "request/items building + decode call + reading tokens (logits: "
                                "decode_logits to float32) on both sides"}
    path = write_json(args.out, results_json(model_dir, ex.model_config, device, settings, server_info, empty_rpc,
                                             interceptor_ms, rows))
    log(f"wrote {path}")
    return 0
