"""Decode-step latency: the in-process Executor vs the same Executor behind gRPC (a real server process on the same
model, threads, device and dtype), the same prompts, calls alternating. Method and columns: docs/benchmarks.md."""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import grpc

from benchmarks.cli import (add_device_args, add_sizes, int_list, make_log, model_dir, parse, parser,
                            set_threads, stop_on_sigterm, torch_device)
from benchmarks.executor_sides import Config, GrpcSide, InProcSide, make_configs
from benchmarks.local_executor import build_executor
from benchmarks.measure import machine_busy_s, other_cores, process_cpu_s, time_stats
from benchmarks.report import format_table, machine_info, model_json, model_line, write_json
from benchmarks.workloads import kv_blocks, random_prompts
from tandem import server_process
from tandem.executor.v1 import executor_pb2 as pb
from tandem.executor.v1 import executor_pb2_grpc as pb_grpc

MAX_MESSAGE_MB = 64  # the server's default --max-message-mb
QUICK = {"batches": "1,4", "steps": 3, "warmup": 1, "context": 16}
DEFAULTS = {"batches": "1,8,32,64", "steps": 16, "warmup": 2, "context": 128}
COLUMNS = [("config", "config"), ("batch", "batch"), ("inproc_ms", "inproc ms/step"), ("grpc_ms", "grpc ms/step"),
           ("grpc_over_inproc", "grpc/inproc", 3), ("grpc_over_inproc_min", "min ratio", 3),
           ("response_bytes", "resp bytes"), ("inproc_tok_s", "inproc tok/s", 1), ("grpc_tok_s", "grpc tok/s", 1)]
log = make_log("bench_executor")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = parser("executor", __doc__, "batches 1,4; steps 3; warmup 1; context 16")
    add_sizes(ap, DEFAULTS, {"batches": "decode batch sizes", "context": "tokens per sequence before decoding",
                             "steps": "timed decode calls per side and configuration",
                             "warmup": "untimed decode calls first"})
    ap.add_argument("--multi-steps", type=int, default=8, help="num_steps of the multi-step configuration (8)")
    ap.add_argument("--configs", default=None,
                    help="comma subset of tokens, logits/f32, logits/bf16, tokens/xN (default: all)")
    add_device_args(ap)
    ap.add_argument("--max-batch-tokens", type=int, default=8192, help="both sides' per-call token limit (8192)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    ap.add_argument("--server-timeout", type=float, default=600.0, help="seconds to wait for the server's READY")
    args = parse(ap, argv, QUICK, DEFAULTS)
    args.batch_list = int_list(args.batches, "--batches")
    if args.context < 1 or args.steps < 1 or args.warmup < 0 or args.multi_steps < 2:
        ap.error("--context and --steps must be >= 1, --warmup >= 0, --multi-steps >= 2")
    configs = make_configs(args.multi_steps)
    names = [n.strip() for n in args.configs.split(",") if n.strip()] if args.configs else list(configs)
    if not names or any(n not in configs for n in names):
        ap.error(f"--configs: choose from {', '.join(configs)}")
    args.config_list = [configs[n] for n in names]
    return args


def bench_config(inproc: InProcSide, remote: GrpcSide, cfg: Config, batch: int, vocab: int, args) -> dict[str, Any]:
    """Both sides prefill the same prompts, warm up, then time their calls alternately: the row of both sides."""
    prompts = random_prompts(batch, args.context, vocab, args.seed + batch).tolist()
    try:
        inproc.prefill(prompts)
        remote.prefill(prompts)
        prefill_agree = inproc.tokens == remote.tokens
        for timed, steps in ((False, args.warmup), (True, args.steps)):
            if timed:
                inproc.reset_timing()
                remote.reset_timing()
                busy0, wall0 = machine_busy_s(), time.perf_counter()
                cpu0 = (time.process_time(), process_cpu_s(remote.server_pid) or 0.0)
            for step in range(steps):
                for side in ((inproc, remote) if step % 2 == 0 else (remote, inproc)):
                    side.step(cfg, timed)
        cpu1 = (time.process_time(), process_cpu_s(remote.server_pid) or 0.0)
        busy1, wall1 = machine_busy_s(), time.perf_counter()
        req_bytes, resp_bytes = remote.last_request.ByteSize(), remote.last_response.ByteSize()
    finally:
        inproc.release()
        remote.release()
    n, i_calls, g_calls = cfg.num_steps, inproc.clock.times, remote.clock.times
    bench_cpu, srv_cpu = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]  # this process also runs the gRPC client
    i_call, g_call = statistics.median(i_calls), statistics.median(g_calls)
    return {"config": cfg.name, "mode": cfg.mode.value, "num_steps": n, "batch": batch, "context": args.context,
            "logits_dtype": None if cfg.wants_tokens else pb.LogitsDtype.Name(cfg.logits_dtype),
            "inproc_ms": 1e3 * i_call / n, "grpc_ms": 1e3 * g_call / n, "grpc_over_inproc": g_call / i_call,
            "grpc_over_inproc_min": min(g_calls) / min(i_calls), "inproc_tok_s": batch * n / i_call,
            "grpc_tok_s": batch * n / g_call, "request_bytes": req_bytes, "response_bytes": resp_bytes,
            "server_cpu_ms": 1e3 * srv_cpu / len(g_calls), "server_cores": srv_cpu / sum(g_calls),
            "other_processes_cores": other_cores(busy0, busy1, bench_cpu + srv_cpu, wall1 - wall0),
            "tokens_agree": sum(a == b for a, b in zip(inproc.history, remote.history)) / len(inproc.history),
            "prefill_tokens_agree": prefill_agree,
            "inproc_times": time_stats(i_calls), "grpc_times": time_stats(g_calls)}


def print_report(args, rows: list[dict[str, Any]], header: list[str]) -> None:
    print("\n".join(header) + "\n")
    print(format_table(rows, COLUMNS))
    print("\ncolumns (docs/benchmarks.md): grpc/inproc = median call time over gRPC / in-process")
    busy = [f"{r['config']}@{r['batch']} ({r['other_processes_cores']:.2f})" for r in rows
            if (r["other_processes_cores"] or 0) > 0.25]
    if busy:
        print(f"\nnote: other processes kept > 0.25 cores busy while timing {', '.join(busy)}: not idle-machine ratios")
    differ = [f"{r['config']}@{r['batch']}" for r in rows if (r["tokens_agree"] < 1 or not r["prefill_tokens_agree"])
              and r["logits_dtype"] != "LOGITS_DTYPE_BFLOAT16"]  # bf16-rounded logits: other argmax ties, expected
    if differ:
        print(f"\nnote: the two sides fed back different tokens in {', '.join(differ)} (numerics differ)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()
    threads, device, directory = set_threads(args.threads), torch_device(args.device), model_dir(args.model)
    max_steps = max(c.num_steps for c in args.config_list)
    per_seq = args.context + 1 + (args.warmup + args.steps) * max_steps
    kv, max_batch_tokens = kv_blocks(max(args.batch_list), per_seq), max(args.max_batch_tokens, args.context)
    log(f"model {directory}, device {device}, dtype {args.dtype}, {threads} threads per side, KV {kv} blocks per side")
    flags = ["--model", str(directory), "--port", "0", "--kv-blocks", str(kv), "--threads", str(threads), "--device",
             args.device, "--dtype", args.dtype, "--max-batch-tokens", str(max_batch_tokens), "--max-message-mb",
             str(MAX_MESSAGE_MB), "--log-level", "WARNING"]
    t0 = time.perf_counter()
    server = server_process.start("executor", "executor_service", *flags)  # loads while this process loads its own
    channel = None
    try:
        ex = build_executor(directory, args.device, args.dtype, kv, max_batch_tokens)
        warm = ex.prefill([ex.info().bos_token_id or 0] * 4)  # as the server does before READY
        ex.release_cache([warm.cache.cache_id])
        address = server.wait_ready(args.server_timeout)
        limit = MAX_MESSAGE_MB * 1024 * 1024
        channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", limit),
                                                          ("grpc.max_send_message_length", limit)])
        stub = pb_grpc.ExecutorServiceStub(channel)
        info = stub.GetInfo(pb.GetInfoRequest(), timeout=30)
        log(f"server {address} and in-process executor ready in {time.perf_counter() - t0:.1f}s")
        if per_seq > ex.model_config.max_position_embeddings:
            raise SystemExit(f"error: {per_seq} tokens per sequence; the model takes "
                             f"{ex.model_config.max_position_embeddings}")
        inproc, remote = InProcSide(ex), GrpcSide(stub, max_batch_tokens, device, server.proc.pid)
        rows = []
        for b in args.batch_list:
            for cfg in args.config_list:
                rows.append(bench_config(inproc, remote, cfg, b, ex.model_config.vocab_size, args))
                log(f"{cfg.name} batch {b}: inproc {rows[-1]['inproc_ms']:.2f} ms/step, grpc "
                    f"{rows[-1]['grpc_ms']:.2f} ms/step")
        server_info = {"address": address, "pid": server.proc.pid, "command": server.args, "model_id": info.model_id,
                       "dtype": info.dtype, "device": info.device, "kv_total_blocks": info.kv.total_blocks}
    finally:
        if channel is not None:
            channel.close()
        code = server.stop()
    log(f"server stopped (exit code {code})")
    policy = os.environ.get("OMP_WAIT_POLICY") or "unset"
    print_report(args, rows, [
        model_line(directory, ex.model_config),
        f"device: {device}  dtype: {args.dtype}  threads per side: {threads}  OMP_WAIT_POLICY: {policy}  context "
        f"{args.context}, {args.steps} timed calls after {args.warmup} per side and configuration; medians"])
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "config_list")} | {
        "configs": [c.name for c in args.config_list], "threads_per_side": threads, "kv_blocks": kv,
        "omp_wait_policy": policy}
    path = write_json(args.out, {"benchmark": "bench_executor", "model": model_json(directory, ex.model_config),
                                 "machine": machine_info(device), "settings": settings, "server": server_info,
                                 "server_exit_code": code, "rows": rows})
    log(f"wrote {path}")
    return 0
