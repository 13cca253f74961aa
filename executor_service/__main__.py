"""`python -m executor_service` / `tandem-executor`: serve a model over tandem.executor.v1."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from executor_service import cpu_cores
from executor_service.config import ExecutorConfig
from executor_service.kv.events.endpoint import ZmqKvConfig
from executor_service.kv.tiers.config import add_flags as add_kv_tier_flags
from executor_service.kv.tiers.config import from_args as kv_tiers_from_args
from executor_service.kv.tiers.disk import check_dir as check_disk_dir
from executor_service.kv.transfer.config import add_flags as add_kv_transfer_flags
from executor_service.malloc_tuning import DEFAULT_ARENA_MAX, DEFAULT_TRIM_S
from executor_service.kv.transfer.config import from_args as kv_transfer_from_args
from executor_service.server import ServerConfig, serve
from executor_service.tp.launch import TpLaunch, add_tp_flags
from executor_service.tp.main import run_tensor_parallel
from models.memory.huge_pages import MODES as HUGE_PAGE_MODES
from tandem.errors import TandemError
from tandem.security.config import add_server_flags, server_security


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="tandem-executor",
        description="Serve an HF model directory or a GGUF file over gRPC (tandem.executor.v1.ExecutorService, "
                    "plus grpc.health.v1 and server reflection). Health turns SERVING once the weights are loaded "
                    "and a warm-up forward ran; a line 'READY <addresses>' is printed to stdout then.")
    ap.add_argument("--model", type=Path, required=True,
                    help="HF model directory (config.json + safetensors) or a GGUF file (FILE.gguf: Llama, Qwen2/3, "
                         "Mistral, Gemma 2/3; Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K matrices stay in their blocks, other types "
                         "are dequantized to --dtype; docs/models.md)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: loopback only)")
    ap.add_argument("--port", type=int, default=50051, help="TCP port (default 50051; 0 = any free port; "
                                                            "-1 = none, with --uds)")
    ap.add_argument("--uds", help="also listen on this Unix domain socket path")
    ap.add_argument("--device", default="auto", help="auto (cuda if available) | cpu | cuda | cuda:N")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="weights and KV dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    ap.add_argument("--quantization", default="none", choices=["none", "fp16", "int8", "int4"],
                    help="linear-layer weights of a safetensors checkpoint (activations, KV and the rest stay "
                         "--dtype): none | fp16 (float16 weights, float32 compute, FBGEMM on x86 CPUs: ~1.4x per "
                         "decode step, greedy tokens unchanged) | int8 (per-channel int8 weights, a quarter of "
                         "float32's bytes: FBGEMM on x86 CPUs, weight-only dequantized per call elsewhere) | int4 "
                         "(llama.cpp's Q4_1 blocks, 5 bits per weight, the LM head Q8_0; the block kernels that run "
                         "GGUF files). Speed and quality vs float32: README, Decode speed; docs/quantization.md. With a GGUF file it "
                         "applies to the matrices the file stores as float only (those in block formats keep them; "
                         "--gguf-dequantize makes every matrix float first)")
    ap.add_argument("--gguf-dequantize", action="store_true",
                    help="dequantize a GGUF file's block-quantized weights (Q4_K, Q8_0, ...) to --dtype at load "
                         "instead of computing on the blocks: 4-8x the memory, and what --deterministic and --compile "
                         "need (they refuse block weights), and tensor parallelism where a rank's share of a layer's "
                         "inputs would cut blocks (K-quants: 256 weights)")
    kv = ap.add_mutually_exclusive_group()
    kv.add_argument("--kv-blocks", type=int, help="KV pool size in blocks (default: see --kv-memory-fraction)")
    kv.add_argument("--kv-memory-fraction", type=float,
                    help="KV pool as a fraction of the free memory after the weights (CUDA: the device's; CPU: "
                         "MemAvailable). Default on CUDA 0.85; on CPU a fixed 4 GiB, less when 64 sequences of the "
                         "model's max length need less or when it exceeds half of MemAvailable. The CPU pool is "
                         "committed as blocks are first used. The startup log and GetInfo say the size and why")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    ap.add_argument("--max-batch-tokens", type=int, default=8192,
                    help="most tokens one call may carry, all items together (default 8192)")
    ap.add_argument("--max-attention-elements", type=int,
                    help="bound on one call's attention workspace, per query head: rows x padded query length x "
                         "longest context of a bucket; a batch over it is split into buckets of similar context "
                         "lengths (same results). Default: 64 x --max-batch-tokens; 0 = no bound")
    ap.add_argument("--max-message-mb", type=int, default=64,
                    help="gRPC request/response size limit in MiB (default 64); a model call whose reply would "
                         "exceed it is refused before it runs (RESOURCE_EXHAUSTED)")
    ap.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                    help="preload a PEFT LoRA adapter directory under NAME (repeatable; inside --adapter-root when "
                         "one is given)")
    ap.add_argument("--adapter-root", type=Path,
                    help="directory LoadAdapter may load from (paths must resolve inside it, symlinks included); "
                         "without it, adapters can only be preloaded with --adapter")
    ap.add_argument("--max-adapters-on-device", type=int, default=8,
                    help="adapters whose weights stay on the device; the least recently used others wait in host "
                         "memory (default 8)")
    ap.add_argument("--max-lora-rank", type=int, default=64, help="largest LoRA rank accepted (default 64)")
    ap.add_argument("--session-ttl", type=float, default=30.0, metavar="SECONDS",
                    help="lease of a client session and of the anonymous session: caches of a session that no call "
                         "named for this long are released (default 30; reaped within 1.25x this)")
    ap.add_argument("--malloc-arena-max", type=int, default=DEFAULT_ARENA_MAX, metavar="N",
                    help=f"glibc malloc arenas (default {DEFAULT_ARENA_MAX}; 0 = glibc's default, 8 per core): each "
                         "arena keeps memory freed in it, so fewer arenas bound the executor's resident memory "
                         "under load (docs/operations.md, 'Memory')")
    ap.add_argument("--malloc-trim-s", type=float, default=DEFAULT_TRIM_S, metavar="SECONDS",
                    help=f"hand free heap pages back to the system (malloc_trim) when the model thread goes idle, at "
                         f"most once per this many seconds (default {DEFAULT_TRIM_S:.0f}; 0 = never)")
    ap.add_argument("--max-queued-calls", type=int, default=64,
                    help="model calls that may wait behind the one running; more are refused at once with "
                         "RESOURCE_EXHAUSTED (default 64). Info, listing, release and session calls never queue")
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="do not index full KV blocks for reuse: CreateCache then creates empty caches and every "
                         "prompt is computed whole (for comparison; prefix caching is on by default)")
    ap.add_argument("--vision-cache-images", type=int, default=64, metavar="N",
                    help="vision-language models: keep the embeddings of the N most recently used images, by content "
                         "hash, so a repeated image runs no vision encoder (0 = keep none; default 64)")
    ap.add_argument("--pooling", choices=("last", "mean"), default=None,
                    help="how embeddings pool the final hidden states: the last token's, or the mean over every token "
                         "(default: the checkpoint's sentence-transformers modules.json + 1_Pooling/config.json, "
                         "else last token as Qwen3-Embedding-style models). Serving embeddings and scores: "
                         "docs/agents.md#embeddings-and-rerank")
    ap.add_argument("--max-kv-subscribers", type=int, default=8,
                    help="SubscribeKvEvents streams served at once; more are refused RESOURCE_EXHAUSTED (default 8)")
    ap.add_argument("--kv-events-buffer", type=int, default=10_000,
                    help="KV events a subscriber may leave unread; one further behind is dropped (its stream ends "
                         "RESOURCE_EXHAUSTED) so that it never slows the model (default 10000)")
    ap.add_argument("--kv-events-endpoint", metavar="tcp://HOST:PORT",
                    help="also publish KV events on ZMQ in vLLM's format (v0.28.0's layout: topic, u64 sequence, "
                         "msgpack EventBatch; for llm-d and vllm-router kv_aware): tcp://*:PORT binds a PUB socket "
                         "on --host, tcp://HOST:PORT connects to HOST. No TLS on ZMQ: an address off loopback is "
                         "refused unless --insecure (the events carry prompts' token ids). Default: off")
    ap.add_argument("--kv-events-replay-endpoint", metavar="tcp://HOST:PORT",
                    help="with --kv-events-endpoint: bind a ROUTER socket that answers replay requests (an 8-byte "
                         "big-endian start sequence) with the batches still held, then vLLM's end marker; "
                         "tcp://*:PORT binds on --host. Same loopback rule")
    ap.add_argument("--kv-events-topic",
                    help="the ZMQ topic frame (default empty, as vLLM's: what vllm-router --kv-event-source "
                         "reads; llm-d's KV event pool wants kv@<pod IP>:<port>@<model>)")
    ap.add_argument("--kv-events-replay-buffer", type=int, default=10_000, metavar="BATCHES",
                    help="batches kept for --kv-events-replay-endpoint (default 10000, as vLLM's buffer_steps)")
    ap.add_argument("--no-cpu-packed-weights", action="store_true",
                    help="CPU float32 with the eager decode step (--decode-kernel torch, or where the native "
                         "step does not run): keep the linear weights plain instead of in oneDNN's packed layout "
                         "(the same memory; ~1.1-1.3x slower decode steps)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                    help="run decode steps (batches where every item adds one token, without LoRA) through a "
                         "torch.compile'd forward: one graph for every batch size, compiled before READY (SmolLM2 on "
                         "2 CPU cores: ~2 minutes, at every start); prefill, mixed batches and LoRA stay eager. "
                         "Not with --quantization. Default --no-compile (eager: on CPUs the compiled step measured "
                         "about as fast). Speed: README, Decode speed")
    ap.add_argument("--compile-cache-dir", type=Path,
                    help="where the compiler keeps compiled kernels across restarts (default: torch's, "
                         "a torchinductor_<user> directory under the system temp directory)")
    ap.add_argument("--decode-kernel", choices=("auto", "native", "torch"), default="auto",
                    help="what runs decode calls (every item adds one token, no LoRA, no drafts): 'native', one C++ "
                         "call per step (CPU, float32 activations with float32/fp16/int8 weights, no MoE; built "
                         "once with g++, ~2-3 s; ~2x faster decode on a small CPU model); 'torch', the PyTorch "
                         "forward (compiled with --compile); 'auto' (default): native where it can run and "
                         "--compile is not given, else torch (the log says why). Speed: README, Decode speed")
    ap.add_argument("--attention-backend", choices=("auto", "flex", "flashinfer", "gathered"), default="auto",
                    help="paged attention of prefill, mixed and draft-verify batches (docs/cuda.md): 'flex', "
                         "FlexAttention over the KV pool in place (compiled on CUDA); 'flashinfer', FlashInfer's "
                         "paged kernel (CUDA with flashinfer-python); 'gathered', each item's K/V copied out "
                         "through its block table, one SDPA call; 'auto' (default): flashinfer, else flex on CUDA, "
                         "gathered on CPU (measured fastest there). GetInfo reports the one in use")
    ap.add_argument("--kv-dtype", choices=("auto", "float32", "bfloat16", "float16", "fp8_e4m3"), default="auto",
                    help="the KV pool's element type: 'auto' (default), the weights' (--dtype); another one "
                         "stores K/V converted (bfloat16/float16: half of float32's bytes; fp8_e4m3: a quarter, "
                         "scale 1.0) and converts them back on read; decode steps then run the PyTorch forward (the "
                         "native kernel reads only the weights' dtype). GetInfo kv_dtype, docs/cuda.md")
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="all-decode steps replay CUDA graphs captured per batch-size bucket before READY "
                         "(docs/cuda.md). Default: where they can run (CUDA, the PyTorch decode forward, a dense "
                         "model), else the log says why; --cuda-graphs: exit 2 where they cannot")
    ap.add_argument("--cuda-graph-max-batch", type=int, default=64,
                    help="largest decode batch captured as a CUDA graph (buckets 1, 2, 4, 8, 16, ... up to it); "
                         "larger batches run the decode forward eagerly (default 64)")
    ap.add_argument("--huge-pages", choices=HUGE_PAGE_MODES, default="auto",
                    help="CPU: copy the weights into one mapping advised for transparent huge pages (the native "
                         "float32 step ~10-15%% faster at batch 1). 'auto' (default) gives them up when they fault "
                         "in slowly (some VMs back each 2 MiB page lazily: seconds per GB at start; logged); 'on' "
                         "keeps them anyway; 'off' leaves the weights where they are")
    ap.add_argument("--deterministic", action="store_true",
                    help="bit-identical tokens and logprobs for a request whatever it is batched with, however its prompt is "
                         "chunked, and across preemption, restarts and executors of the same build: every call runs "
                         "the native step one row per token and samples each row alone (CPU x86 with AVX2; no LoRA, "
                         "MoE, --compile or --decode-kernel torch: refused at start). Slower prefill; see "
                         "docs/deterministic.md for the promise and its cost. Default off")
    ap.add_argument("--native-cache-dir", type=Path,
                    help="where the native decode kernel's compiled library is kept (default ~/.cache/tandem/native)")
    ap.add_argument("--metrics-port", type=int,
                    help="serve Prometheus metrics (GET /metrics) on --host at this port (0 = any free port, logged "
                         "as 'metrics on http(s)://...'), under this server's security: https with --tls-cert (a "
                         "client certificate with --tls-client-ca), an admin token with --auth-token-file; "
                         "default: none")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: one per --cpu-cores core, else torch's "
                                                "choice)")
    cpu_cores.add_flags(ap)
    ap.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    sp = ap.add_argument_group("speculative decoding with a draft model")
    sp.add_argument("--draft-model", type=Path, metavar="PATH",
                    help="a smaller model of the same tokenizer (checkpoint directory or GGUF file) run here beside "
                         "the served model: it guesses draft tokens for requests that ask (a scheduler's "
                         "--speculative auto does, where its suffix/n-gram lookup finds nothing), which the served "
                         "model verifies in the same step (output unchanged). Refused at start when its vocabulary "
                         "differs. Default: none")
    sp.add_argument("--draft-kv-blocks", type=int, metavar="N",
                    help="the draft model's own KV pool, in blocks of --block-size tokens (one draft cache per "
                         "drafting request; least recently used ones evicted when full). Default: a quarter of the "
                         "served model's pool, at least 16")
    add_tp_flags(ap)
    add_kv_transfer_flags(ap)
    add_kv_tier_flags(ap)
    add_server_flags(ap)
    return ap.parse_args(argv)


def _adapter_flags(values: list[str]) -> list[tuple[str, Path]]:
    pairs = []
    for v in values:
        name, sep, path = v.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"tandem-executor: error: --adapter wants NAME=PATH, got {v!r}")
        pairs.append((name, Path(path)))
    return pairs


def _zmq_flags(args: argparse.Namespace) -> ZmqKvConfig | None:
    if args.kv_events_endpoint is None:
        if args.kv_events_replay_endpoint is not None or args.kv_events_topic is not None:
            raise SystemExit("tandem-executor: error: --kv-events-replay-endpoint and --kv-events-topic need "
                             "--kv-events-endpoint")
        return None
    return ZmqKvConfig(args.kv_events_endpoint, args.kv_events_replay_endpoint, args.kv_events_topic or "",
                       args.kv_events_replay_buffer)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        rank_cores = cpu_cores.share_with_local_ranks(args)  # TP started here: a slice of --cpu-cores per rank
        cpu_cores.apply(args)  # --cpu-cores: every thread of this process, now and later, on those cores
    except ValueError as exc:
        print(f"tandem-executor: error: {exc}", file=sys.stderr)
        return 2
    try:
        kv_transfer = kv_transfer_from_args(args)
        kv_tiers = kv_tiers_from_args(args)
        if kv_tiers.disk_dir is not None:
            check_disk_dir(kv_tiers.disk_dir)  # a directory that cannot hold the tier fails before the model loads
    except ValueError as exc:
        print(f"tandem-executor: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)  # this thread's; serve() sets the model thread's too
    executor_cfg = ExecutorConfig(model_dir=args.model, device=args.device, dtype=args.dtype,
                                  quantization=args.quantization, gguf_dequantize=args.gguf_dequantize,
                                  kv_blocks=args.kv_blocks, kv_memory_fraction=args.kv_memory_fraction,
                                  block_size=args.block_size, max_batch_tokens=args.max_batch_tokens,
                                  max_attention_elements=args.max_attention_elements,
                                  progress=True, cpu_packed_weights=not args.no_cpu_packed_weights,
                                  compile=args.compile, compile_cache_dir=args.compile_cache_dir,
                                  decode_kernel=args.decode_kernel, native_cache_dir=args.native_cache_dir,
                                  attention_backend=args.attention_backend, kv_dtype=args.kv_dtype,
                                  cuda_graphs=args.cuda_graphs, cuda_graph_max_batch=args.cuda_graph_max_batch,
                                  huge_pages=args.huge_pages, deterministic=args.deterministic,
                                  adapter_root=args.adapter_root, adapters=tuple(_adapter_flags(args.adapter)),
                                  max_adapters_on_device=args.max_adapters_on_device,
                                  max_lora_rank=args.max_lora_rank, session_ttl_s=args.session_ttl,
                                  prefix_caching=not args.no_prefix_caching, pooling=args.pooling,
                                  vision_cache_images=args.vision_cache_images,
                                  max_kv_subscribers=args.max_kv_subscribers, kv_events_buffer=args.kv_events_buffer,
                                  kv_transfer=kv_transfer, kv_tiers=kv_tiers, draft_model=args.draft_model,
                                  draft_kv_blocks=args.draft_kv_blocks)
    server_cfg = ServerConfig(host=args.host, port=args.port, uds=args.uds, max_message_mb=args.max_message_mb,
                              threads=args.threads, max_queued_calls=args.max_queued_calls,
                              metrics_port=args.metrics_port, security=server_security(args),
                              kv_events_zmq=_zmq_flags(args), malloc_arena_max=args.malloc_arena_max,
                              malloc_trim_s=args.malloc_trim_s)
    try:
        tp = TpLaunch.from_args(args, rank_cores)  # None: the whole model in this process
        if tp is not None:
            return run_tensor_parallel(tp, executor_cfg, server_cfg, sys.argv[1:] if argv is None else list(argv))
        return serve(executor_cfg, server_cfg)
    except (TandemError, ValueError, OSError) as exc:
        print(f"tandem-executor: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
