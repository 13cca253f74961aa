"""`python -m benchmarks NAME [args]`: one entry point for every benchmark (`--help` lists them,
`NAME --help` gives a benchmark's flags). Each prints its tables on stdout and writes JSON (--out)."""
from __future__ import annotations

import importlib
import sys

# NAME -> (module:function, one line). Modules are imported only when their benchmark runs: most import torch.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "block_kernels": ("block_kernels:main", "a GGUF file's block weights on the native kernels: one token's matrix "
                      "products, file layout vs repacked rows (decode and prompt sizes)"),
    "decode": ("decode:main", "decode speed per weight mode (stream, steps, llama.cpp peer)"),
    "device": ("device_figures:main", "one device's figures in process: decode batch 1/64 with CUDA graphs on/off, "
               "prefill 512/4k, capture time, memory, attention backend (scripts/gpu_check)"),
    "disagg": ("disagg:main", "KV that moves: prefill/decode executors vs two `both` (ITL p99), migration pause vs recompute"),
    "draft": ("draft_model:main", "draft-model speculation (--draft-model): tok/s on vs off, acceptance and the "
              "break-even acceptance from measured costs (SmolLM2 drafting for itself; a random 1.7B/135M pair)"),
    "executor": ("executor_step:main", "decode-step latency in-process vs over gRPC"),
    "fleet": ("fleet:main", "one scheduler over several executors: scaling, and failover after a SIGKILL"),
    "forward": ("forward:main", "Tandem's in-process forward vs transformers' (decode and prefill, GFLOP/s)"),
    "kv_restart": ("kv_restart:main", "TTFT of a long prompt after an executor restart: its disk tier vs cold; the tier's read MB/s"),
    "lora": ("lora:main", "multi-LoRA decode throughput: base vs 1 vs N distinct adapters in a batch"),
    "overload": ("overload:main", "2x/5x/10x capacity through the OpenAI front: admitted TTFT p99, refusal latency, "
                 "Retry-After, lost = 0, RSS"),
    "prefix": ("prefix:main", "automatic prefix caching on vs off: shared system prompt and multi-turn chats"),
    "quantized": ("quantized:main", "quantized GGUF files (Q4_K_M, Q4_0, Q8_0) vs llama.cpp on the same files: decode, "
                  "pp512, RSS, 16 streams, quality"),
    "serving": ("serving:main", "concurrent streamed requests through the OpenAI front vs transformers generate"),
    "spec": ("spec:main", "n-gram speculative decoding on vs off, copy-heavy and chat workloads"),
    "startup": ("startup:main", "executor time to READY, memory and first-request latency, cold and warm"),
    "structured": ("structured:main", "constrained decoding's cost per step through real servers (JSON-lines grammar vs plain)"),
    "tp": ("tp:main", "tensor parallelism: decode and prefill time and per-rank memory vs --tensor-parallel-size"),
    "vision": ("vision:main", "one image in process: image processing, vision encoder and TTFT cold / embedding cache / "
               "prefix cache (SmolVLM-256M shapes, random weights)"),
}


def usage() -> str:
    width = max(map(len, BENCHMARKS))
    lines = [f"  {name.ljust(width)}  {desc}" for name, (_, desc) in BENCHMARKS.items()]
    return ("usage: python -m benchmarks NAME [args]   (python -m benchmarks NAME --help: its flags)\n\n"
            "Tandem's benchmarks; each prints tables on stdout and writes JSON (--out). See docs/benchmarks.md.\n\n"
            "benchmarks:\n" + "\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if (name := argv[0]) not in BENCHMARKS:
        print(f"unknown benchmark {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, function = BENCHMARKS[name][0].split(":")
    return getattr(importlib.import_module(f"benchmarks.{module}"), function)(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
