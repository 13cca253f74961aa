"""Decode speed per weight mode: single-stream decode through the full stack, batched decode-step times, and
llama.cpp on the same weights in the same run (when llama-cpp-python is installed), plus each mode's quality
against float32.

Modes: WEIGHTS-KERNEL, weights float32 | bf16 (`--dtype bfloat16`) | fp16 (`--quantization fp16`) | int8
(`--quantization int8`), kernel
eager (`--decode-kernel torch`: the PyTorch forward, oneDNN-packed fp32 / FBGEMM linears), native
(`--decode-kernel native`: the C++ decode step, models/native_decode.py) or compiled (`--compile`, float32
only: the torch.compile'd step; its time to READY includes the compile, and a second start is timed too, from
the compile cache). Every ratio "vs eager" divides by the same weights' eager mode in the same run (else
float32-eager). Parts (--parts, default all four):

- stream: per mode, a real executor (`--threads T`, prefix caching off) and scheduler, started one mode at a
  time (the executor's time to READY is reported); --requests requests one after another (after one warm-up),
  each --prompt-len random vocabulary token ids (fixed seed) and --gen greedy tokens (ignore_eos), streamed
  through GenerateService. Per request: TTFT (send to first token) and decode tokens/s = (tokens - 1) /
  (last token time - first token time); medians over the requests. This is what a single user sees.
- steps: per mode, an in-process Executor; B sequences (--batches, default 1,8,32) prefilled with --prompt-len
  tokens, then --steps decode calls of all B (tokens mode, greedy) after 3 warm-up calls: median ms per step
  and tokens/s = B / step. The modes of one weight format (eager, native, ...) step in turn, one call each,
  so the machine's noise hits them alike and "vs eager" holds.
- llama: llama.cpp (`Llama`, --threads threads) on GGUF files of Tandem's own float32 weights, as f32, bf16, f16 and
  q8_0 (benchmarks/llama_cpp_side.py), the same prompt ids and --gen greedy tokens, --requests runs after a
  warm-up; skipped with a note when `import llama_cpp` fails. The ratios `vs llama.cpp` in the stream table
  compare Tandem's decode tokens/s with llama.cpp f32 (float32), bf16 (bf16), q8_0 (int8) and f16 (fp16).
- quality: per low-precision mode vs float32 (benchmarks/quality.py): on the 4 parity chat prompts (32 greedy
  tokens each) the leading tokens that agree and the teacher-forced argmax agreement, and the mean NLL of a
  fixed text (nats/token) and its difference.

The machine is shared and noisy: compare ratios within one run.

    python scripts/bench_decode.py                                  # SmolLM2, all parts, all modes
    python scripts/bench_decode.py --parts stream,llama --modes float32 --requests 5
    python scripts/bench_decode.py --quick --model /tmp/tiny-llama  # smoke run
"""
from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from benchmarks import llama_cpp_side, runtime
from benchmarks.cli import add_model_arg, add_out_args, int_list, make_log, parse_with_preset, parser
from benchmarks.local_executor import DecodeBatch, build_executor
from benchmarks.quality import QualityReference
from benchmarks.report import format_table, machine_info, model_json, write_json
from benchmarks.workloads import model_vocabulary, vocabulary_prompts
from tandem import server_process
from tandem.common.v1 import common_pb2 as cpb
from tandem.generate.v1 import generate_pb2 as gpb
from tandem.generate.v1 import generate_pb2_grpc as gpb_grpc

log = make_log("bench_decode")
WEIGHTS = {"float32": "none", "bf16": "none", "fp16": "fp16", "int8": "int8"}  # -> --quantization
DTYPES = {"bf16": "bfloat16"}  # -> --dtype (else float32)
KERNELS = {"eager": ("--decode-kernel", "torch"), "native": ("--decode-kernel", "native"), "compiled": ("--compile",)}
MODES = [f"{w}-{k}" for w in WEIGHTS for k in KERNELS if k != "compiled" or w == "float32"]
LLAMA_PEER = {"float32": "f32", "bf16": "bf16", "fp16": "f16", "int8": "q8_0"}  # weights -> llama.cpp's format
PARTS = ("stream", "steps", "llama", "quality")
DEFAULTS = {"modes": "float32-eager,float32-native,bf16-eager,bf16-native,fp16-eager,fp16-native,int8-eager,"
                     "int8-native",
            "parts": ",".join(PARTS), "batches": "1,8,32", "prompt_len": 128, "gen": 128, "requests": 3, "steps": 20}
QUICK = {"modes": "float32-eager,float32-native,int8-native", "parts": "stream,steps,quality", "batches": "1,4",
         "prompt_len": 16, "gen": 8, "requests": 1, "steps": 3}


def weights_of(mode: str) -> str:
    return mode.split("-")[0]


def kernel_of(mode: str) -> str:
    return mode.split("-")[1]


def dtype_of(mode: str) -> str:
    return DTYPES.get(weights_of(mode), "float32")


def executor_options(mode: str) -> dict[str, Any]:
    """The ExecutorConfig fields of a mode but dtype (for the in-process executors)."""
    kernel = kernel_of(mode)
    return {"quantization": WEIGHTS[weights_of(mode)], "compile": kernel == "compiled",
            "decode_kernel": "native" if kernel == "native" else "torch"}


def parse_args(argv: list[str] | None = None):
    ap = parser(__doc__, epilog="Method: see the module docstring (head -30 benchmarks/decode.py).")
    add_model_arg(ap)
    ap.add_argument("--modes", default=None, help=f"comma list of {', '.join(MODES)} (default: all but "
                                                  "float32-compiled, whose compile takes minutes per start)")
    ap.add_argument("--parts", default=None, help=f"comma list of {', '.join(PARTS)} (default all)")
    ap.add_argument("--batches", default=None, help="decode batch sizes of the steps part (default 1,8,32)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128)")
    ap.add_argument("--gen", type=int, default=None, help="greedy tokens per request (default 128)")
    ap.add_argument("--requests", type=int, default=None, help="timed requests per mode (default 3)")
    ap.add_argument("--steps", type=int, default=None, help="timed decode calls per batch size (default 20)")
    ap.add_argument("--threads", type=int, default=None, help="torch / llama.cpp threads (default: all cores)")
    add_out_args(ap, "bench_decode", "smoke run: float32-eager, float32-native and int8-native, 16-token prompt, "
                                     "8 tokens, batches 1,4")
    args = parse_with_preset(ap, argv, QUICK, DEFAULTS)
    args.mode_list = [m for m in args.modes.split(",") if m]
    args.part_list = [p for p in args.parts.split(",") if p]
    args.batch_list = int_list(args.batches, "--batches")
    if not args.mode_list or any(m not in MODES for m in args.mode_list):
        ap.error(f"--modes: a comma list of {', '.join(MODES)}")
    if not args.part_list or any(p not in PARTS for p in args.part_list):
        ap.error(f"--parts: a comma list of {', '.join(PARTS)}")
    if min(args.prompt_len, args.gen, args.requests, args.steps) < 1 or args.gen < 2:
        ap.error("--prompt-len, --requests and --steps must be >= 1, --gen >= 2")
    return args


async def stream_one(address: str, prompt: list[int], gen: int) -> dict[str, float]:
    req = gpb.GenerateRequest(request_id="bench-decode", token_ids=gpb.TokenIds(ids=prompt),
                              sampling=cpb.SamplingParams(),
                              stopping=gpb.StoppingCriteria(max_new_tokens=gen, ignore_eos=True))
    stamps: list[tuple[float, int]] = []
    async with grpc.aio.insecure_channel(address) as channel:
        start = time.perf_counter()
        async for msg in gpb_grpc.GenerateServiceStub(channel).Generate(req, timeout=600):
            if msg.token_ids:
                stamps.append((time.perf_counter(), len(msg.token_ids)))
    tokens = sum(n for _, n in stamps)
    if tokens != gen:
        raise RuntimeError(f"asked for {gen} tokens, got {tokens}")
    return {"ttft_s": stamps[0][0] - start, "decode_tok_s": (tokens - stamps[0][1]) / (stamps[-1][0] - stamps[0][0])}


def stream_part(args, model_dir: Path, threads: int, mode: str, prompts: list[list[int]]) -> dict[str, Any]:
    servers = []
    try:
        compiled = kernel_of(mode) == "compiled"
        flags = ("--threads", str(threads), "--no-prefix-caching", "--quantization", WEIGHTS[weights_of(mode)],
                 "--dtype", dtype_of(mode),
                 "--log-level", "WARNING") + KERNELS[kernel_of(mode)]
        restart_s, wait = None, {"ready_timeout": 900.0} if compiled else {}  # compiling on 2 cores: minutes
        if compiled:  # a first start fills the compile cache; the timed one below is a restart
            t0 = time.perf_counter()
            server_process.launch_executor(model_dir, *flags, **wait).stop()
            first_s = time.perf_counter() - t0
            log(f"stream {mode}: first start (compiling) {first_s:.1f} s")
        t0 = time.perf_counter()
        ex = server_process.launch_executor(model_dir, *flags, **wait)
        ready_s = time.perf_counter() - t0
        if compiled:
            ready_s, restart_s = first_s, ready_s
        servers.append(ex)
        sched = server_process.launch_scheduler(ex.address, "--log-level", "WARNING")
        servers.append(sched)
        asyncio.run(stream_one(sched.address, prompts[-1], min(args.gen, 8)))  # warm-up
        runs = [asyncio.run(stream_one(sched.address, p, args.gen)) for p in prompts[:args.requests]]
    finally:
        for s in reversed(servers):
            s.stop()
    out = {"ready_s": ready_s, "restart_s": restart_s, "runs": runs,
           "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
           "ttft_ms": 1e3 * statistics.median(r["ttft_s"] for r in runs)}
    log(f"stream {mode}: {out['decode_tok_s']:.1f} tok/s decode, TTFT {out['ttft_ms']:.0f} ms, ready {ready_s:.1f} s")
    return out


def steps_part(args, model_dir: Path, modes: list[str], prompt_pool: list[list[int]]) -> dict[str, Any]:
    """The modes of one weight format (e.g. float32-eager and float32-native), each its own executor, stepped
    in turn — one step of each, then again — so that a noisy stretch of the shared machine hits every mode
    alike and the ratio between them holds."""
    blocks = (max(args.batch_list) * (args.prompt_len + args.steps + 8) // 16) + 64
    exs = {m: build_executor(model_dir, "cpu", dtype_of(m), kv_blocks=blocks, max_batch_tokens=4096,
                             prefix_caching=False, **executor_options(m)) for m in modes}
    out: dict[str, Any] = {m: {} for m in modes}
    for b in args.batch_list:
        batches = {m: DecodeBatch(ex) for m, ex in exs.items()}
        for batch in batches.values():
            batch.prefill([prompt_pool[i % len(prompt_pool)] for i in range(b)])
        times: dict[str, list[float]] = {m: [] for m in modes}
        for i in range(args.steps + 3):
            for m, batch in batches.items():
                start = time.perf_counter()
                batch.advance(exs[m].decode(batch.decode_items()))
                if i >= 3:
                    times[m].append(time.perf_counter() - start)
        for m, batch in batches.items():
            batch.release()
            ms = 1e3 * statistics.median(times[m])
            out[m][str(b)] = {"step_ms": ms, "tok_s": b / ms * 1e3}
            log(f"steps {m} B={b}: {ms:.1f} ms/step")
    return out


def quality_part(model_dir: Path, modes: list[str]) -> dict[str, Any]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    encode = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    ref = QualityReference(build_executor(model_dir, "cpu", "float32", kv_blocks=128, max_batch_tokens=4096,
                                          prefix_caching=False, decode_kernel="torch"), encode)
    out = {}
    for mode in modes:
        ex = build_executor(model_dir, "cpu", dtype_of(mode), kv_blocks=128, max_batch_tokens=4096,
                            prefix_caching=False, **executor_options(mode))
        out[mode] = ref.measure(ex).as_json()
        log(f"quality {mode}: {out[mode]['agreed_tokens']}/{out[mode]['total_tokens']} greedy tokens agree "
            f"({out[mode]['top1_matches']} teacher-forced), "
            f"NLL {out[mode]['nll']:.4f} vs {out[mode]['nll_float32']:.4f}")
    return out


def llama_part(args, model_dir: Path, threads: int, prompt: list[int]) -> dict[str, Any]:
    if not llama_cpp_side.available():
        log("llama: llama-cpp-python is not installed (pip install llama-cpp-python): llama.cpp rows skipped")
        return {}
    source = llama_cpp_side.shipped_gguf()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fmt_name in sorted({LLAMA_PEER[weights_of(m)] for m in args.mode_list}, key=llama_cpp_side.FORMATS.index):
            path = llama_cpp_side.write_gguf(source, Path(tmp) / f"model-{fmt_name}.gguf", fmt_name)
            out[fmt_name] = llama_cpp_side.decode_run(path, prompt, args.gen, threads, args.requests)
            log(f"llama.cpp {fmt_name}: {out[fmt_name]['decode_tok_s']:.1f} tok/s decode, "
                f"TTFT {out[fmt_name]['ttft_ms']:.0f} ms")
    return out


def ratio(run: dict[str, Any], base: dict[str, Any] | None) -> str | None:
    """Decode tokens/s of a stream run over a baseline run's, as "1.23x" (None when either is missing)."""
    return f"{run['decode_tok_s'] / base['decode_tok_s']:.2f}x" if run and base else None


def print_tables(args, results: dict[str, Any], header: str) -> None:
    print(header)
    stream, llama, steps, quality = (results.get(k, {}) for k in ("stream", "llama", "steps", "quality"))
    if stream or llama:
        rows = []
        for mode in args.mode_list:
            s, peer = stream.get(mode, {}), llama.get(LLAMA_PEER[weights_of(mode)], {})
            rows.append({"mode": mode, "decode tok/s": s.get("decode_tok_s"), "TTFT ms": s.get("ttft_ms"),
                         "ready s": s.get("ready_s"), "restart s": s.get("restart_s"),
                         "llama.cpp": LLAMA_PEER[weights_of(mode)],
                         "llama tok/s": peer.get("decode_tok_s"), "llama TTFT ms": peer.get("ttft_ms"),
                         "vs llama.cpp": (f"{s['decode_tok_s'] / peer['decode_tok_s']:.2f}x" if s and peer else None),
                         "vs eager": ratio(s, stream.get(f"{weights_of(mode)}-eager") or stream.get("float32-eager"))})
        print(f"\nsingle stream: {args.prompt_len}-token prompt, {args.gen} greedy tokens, through gRPC")
        print(format_table(rows, [(k, k, 1) for k in rows[0]]))
    if steps:
        rows = []
        for m in args.mode_list:
            base = steps.get(f"{weights_of(m)}-eager") or steps.get("float32-eager", {})
            rows += [{"mode": m, "batch": int(b), "ms/step": v["step_ms"], "tok/s": v["tok_s"],
                      "vs eager": (f"{base[b]['step_ms'] / v['step_ms']:.2f}x" if b in base else None),
                      "vs float32-eager": (f"{steps['float32-eager'][b]['step_ms'] / v['step_ms']:.2f}x"
                                           if b in steps.get("float32-eager", {}) else None)}
                     for b, v in steps.get(m, {}).items()]
        print(f"\ndecode steps (in-process Executor, context {args.prompt_len})")
        print(format_table(rows, [(k, k, 1) for k in rows[0]]))
    if quality:
        rows = [{"mode": m, "greedy agree": f"{q['agreed_tokens']}/{q['total_tokens']}",
                 "top-1 agree": f"{q['top1_matches']}/{q['total_tokens']}", "NLL": q["nll"],
                 "NLL float32": q["nll_float32"], "delta": q["nll_delta"]} for m, q in quality.items()]
        print("\nquality vs float32 (4 chat prompts x 32 greedy tokens: leading tokens equal, and teacher-forced "
              "argmax equal; mean NLL of a fixed text)")
        print(format_table(rows, [(k, k, 4) for k in rows[0]]))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads, model_dir, cfg = runtime.serving_setup(args)
    prompts = vocabulary_prompts(args.requests + max(args.batch_list), args.prompt_len,
                                 model_vocabulary(model_dir, cfg), seed=0, stream=0)
    results: dict[str, Any] = {}
    if "stream" in args.part_list:
        results["stream"] = {m: stream_part(args, model_dir, threads, m, prompts) for m in args.mode_list}
    if "llama" in args.part_list:
        results["llama"] = llama_part(args, model_dir, threads, prompts[0])
    if "steps" in args.part_list:
        results["steps"] = {}
        for w in dict.fromkeys(weights_of(m) for m in args.mode_list):  # a weight format's modes interleaved
            results["steps"].update(steps_part(args, model_dir, [m for m in args.mode_list if weights_of(m) == w],
                                               prompts))
    if "quality" in args.part_list:
        # float32 modes agree with the eager float32 reference to the parity tests' 1e-4: measured for fp16 / int8
        results["quality"] = quality_part(model_dir, [m for m in args.mode_list if weights_of(m) != "float32"])
    header = f"model: {model_dir.name} ({cfg.architecture}), {threads} threads, CPU"
    print_tables(args, results, header)
    config = {k: getattr(args, k) for k in ("modes", "parts", "batches", "prompt_len", "gen", "requests", "steps",
                                            "quick")}
    config.update(model=str(model_dir), threads=threads)
    path = write_json(args.out, {"benchmark": "bench_decode", "config": config, "machine": machine_info("cpu"),
                                 "model": model_json(model_dir, cfg), **results})
    log(f"wrote {path}")
    return 0
