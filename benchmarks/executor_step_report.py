"""The executor benchmark's output: ratios derived across rows, the latency and breakdown tables with their
notes, and the JSON payload."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from benchmarks import omp_policy
from benchmarks.report import format_table, machine_info, model_json, model_line

COLUMNS = [("config", "config"), ("batch", "batch"), ("inproc_ms", "inproc ms/step"), ("grpc_ms", "grpc ms/step"),
           ("grpc_over_inproc", "grpc/inproc", 3), ("grpc_over_inproc_min", "min ratio", 3),
           ("response_bytes", "resp bytes"),
           ("inproc_tok_s", "inproc tok/s", 1), ("grpc_tok_s", "grpc tok/s", 1),
           ("grpc_multi_over_single", "grpc xN/x1", 3), ("inproc_multi_over_single", "inproc xN/x1", 3),
           ("multi_gain_grpc_vs_inproc", "g/i", 3)]
BREAKDOWN_COLUMNS = [("config", "config"), ("batch", "batch"), ("overhead", "grpc-inproc ms"),
                     ("op_diff", "op diff"), ("servicer", "servicer"), ("transport", "transport"),
                     ("client_diff", "client diff"), ("micro_serde", "serde (micro)"),
                     ("micro_codec", "codec (micro)"), ("inproc_op", "inproc op"), ("server_op", "srv op"),
                     ("inproc_cpu", "inproc cpu"), ("server_cpu", "srv cpu"), ("inproc_cores", "inproc cores"),
                     ("server_cores", "srv cores"), ("inproc_threads", "inproc thr"), ("server_threads", "srv thr")]


def with_derived_columns(rows: list[dict[str, Any]]) -> None:
    """Adds the multi-step rows' ratios to the tokens row of their batch, and the breakdown's columns."""
    single = {(r["batch"]): r for r in rows if r["config"] == "tokens"}
    for r in rows:
        one = single.get(r["batch"])
        if r["num_steps"] > 1 and r["mode"] == "tokens" and one:
            r["grpc_multi_over_single"] = r["grpc_ms"] / one["grpc_ms"]
            r["inproc_multi_over_single"] = r["inproc_ms"] / one["inproc_ms"]
            r["multi_gain_grpc_vs_inproc"] = r["grpc_multi_over_single"] / r["inproc_multi_over_single"]
        bd, micro = r["breakdown_ms"], r["micro_ms"]
        bd["client_diff"] = bd["grpc_client"] - bd["inproc_client"]
        bd["micro_serde"] = micro["req_serialize"] + micro["req_parse"] + micro["resp_serialize"] + micro["resp_parse"]
        bd["micro_codec"] = micro["codec_in"] + micro["codec_out"]
        bd["inproc_cpu"], bd["server_cpu"] = r["inproc_cpu_ms"], r["server_cpu_ms"]
        bd["inproc_threads"], bd["server_threads"] = r["inproc_busy_threads"], r["server_busy_threads"]
        bd["inproc_cores"], bd["server_cores"] = r["inproc_cores"], r["server_cores"]


def print_report(args, rows: list[dict[str, Any]], model_dir: Path, cfg: Any, device: torch.device, threads: int,
                 empty_rpc: dict[str, Any], interceptor_ms: float) -> None:
    print(model_line(model_dir, cfg))
    print(f"device: {device}  dtype: {args.dtype}  threads per side: {threads}  "
          f"OMP_WAIT_POLICY: {omp_policy.current()}  context {args.context}, "
          f"{args.steps} timed calls after {args.warmup} per side and configuration; medians")
    print(f"empty RPC round trip: {empty_rpc['before']['median_ms']:.3f} ms before, "
          f"{empty_rpc['after']['median_ms']:.3f} ms after; "
          f"interceptor wrapper: {interceptor_ms * 1e3:.2f} us per call\n")
    print(format_table(rows, COLUMNS))
    print("\ngrpc/inproc: median call time over gRPC / in-process (request building and response reading "
          "included on both sides); min ratio: of the fastest calls.\nxN/x1: per-token time of the multi-step "
          "call / the tokens row's (longer contexts included); g/i: grpc xN/x1 / inproc xN/x1.")
    print("\nwhere the gRPC time goes (ms per call, means): op diff = server executor - in-process executor; "
          "servicer = handler - executor (codec);\ntransport = stub call - handler (serde + channel); "
          "client diff = gRPC client build+read - in-process build+read; micro: pieces timed alone here.\n")
    print(format_table([{**r["breakdown_ms"], "config": r["config"], "batch": r["batch"]} for r in rows],
                       BREAKDOWN_COLUMNS))
    busy = [f"{r['config']}@{r['batch']} ({r['other_processes_cores']:.2f})" for r in rows
            if (r["other_processes_cores"] or 0) > 0.25]
    if busy:
        print(f"\nnote: other processes kept > 0.25 cores busy (mean cores in brackets) while timing "
              f"{', '.join(busy)}; those ratios are not the idle-machine ones")
    disagree = [f"{r['config']}@{r['batch']}" for r in rows if (r["tokens_agree"] < 1 or not r["prefill_tokens_agree"])
                and r["logits_dtype"] != "LOGITS_DTYPE_BFLOAT16"]  # bf16-rounded logits: other argmax ties, expected
    if disagree:
        print(f"\nnote: the two sides fed back different tokens in {', '.join(disagree)} (numerics differ)")


def results_json(model_dir: Path, cfg: Any, device: torch.device, settings: dict[str, Any],
                 server: dict[str, Any], empty_rpc: dict[str, Any], interceptor_ms: float,
                 rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "benchmark": "bench_executor",
        "model": model_json(model_dir, cfg),
        "machine": machine_info(device),
        "settings": settings,
        "server": server,
        "empty_rpc": empty_rpc,
        "interceptor_overhead_ms": interceptor_ms,
        "rows": rows,
    }
