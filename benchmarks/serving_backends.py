"""The serving benchmark's front-end comparison (--backend grpc,openai-chat): the same workload through gRPC
Generate and through the scheduler's OpenAI-compatible HTTP front (streamed /v1/chat/completions, as vLLM's
`openai-chat` benchmark backend), against one scheduler + executor, in one run.

Equal work. Both backends send the SAME chat: one user message whose text is the detokenized random prompt
(gRPC: GenerateRequest.messages; HTTP: `messages`), so both render the chat template and tokenize in the
scheduler, and both stream exactly --output-len greedy tokens (ignore_eos). What differs is only the front:
HTTP parsing, pydantic validation, SSE/JSON rendering (with per-token logprobs entries: the client asks for
`return_tokens_as_token_ids` to count tokens exactly) versus protobuf over HTTP/2. Token-id prompts for gRPC
against text for HTTP would charge the tokenizer to one side only.

Fairness on a noisy machine: the timed phases alternate, A B B A ... (--rounds, default 2: one each way
round), every phase on the same prompts; the executor runs with --no-prefix-caching (unless --executor-args
says otherwise) so that a later phase does not find the earlier phases' prompts in the KV cache. A backend's
side pools its phases: duration = the sum of its phases' durations, latencies over all its requests."""
from __future__ import annotations

from typing import Any

import httpx

from benchmarks import openai_client, serving_client
from benchmarks.request_metrics import Record
from benchmarks.report import format_table
from benchmarks.workloads import poisson_arrivals

BACKENDS = ("grpc", "openai-chat")
FINISH_LENGTH = {"grpc": "FINISH_REASON_LENGTH", "openai-chat": "length"}  # the two fronts' spelling
SIDE = {"grpc": "tandem", "openai-chat": "openai-chat"}  # JSON side names (gRPC keeps the historic "tandem")
# The targets for openai-chat / grpc (SmolLM2 fp32, 32 clients).
THROUGHPUT_MIN, TTFT_P50_MAX = 0.95, 1.10


def phase_order(backends: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, backend) in run order: even rounds in the given order, odd rounds reversed (A B B A ...)."""
    return [(r, b) for r in range(rounds) for b in (backends if r % 2 == 0 else backends[::-1])]


def chat_texts(http_url: str, prompts: list[list[int]]) -> list[str]:
    """The text of each token-id prompt, decoded by the served model's tokenizer (POST /detokenize)."""
    with httpx.Client(base_url=http_url, timeout=60) as client:
        out = []
        for ids in prompts:
            r = client.post("/detokenize", json={"tokens": ids})
            r.raise_for_status()
            out.append(r.json()["prompt"])
    return out


async def run_phase(backend: str, stub, http: httpx.AsyncClient | None, prompts: list, args, tag: str
                    ) -> list[Record]:
    """One pass over `prompts` through `backend`, closed or open loop as the args say."""
    timeout = args.request_timeout
    if args.request_rate is None:
        if backend == "grpc":
            return await serving_client.closed_loop(stub, prompts, args.output_len, args.concurrency, tag, timeout)
        return await openai_client.closed_loop(http, prompts, args.output_len, args.concurrency, tag, timeout)
    arrivals = poisson_arrivals(len(prompts), args.request_rate, args.seed)
    if backend == "grpc":
        return await serving_client.open_loop(stub, prompts, args.output_len, arrivals, args.concurrency, tag,
                                              timeout)
    return await openai_client.open_loop(http, prompts, args.output_len, arrivals, args.concurrency, tag, timeout)


def bad_records(records: list[Record], backend: str, output_len: int) -> list[Record]:
    """Requests that failed or did not produce exactly output_len tokens (streamed ids, usage, finish)."""
    return [r for r in records if r.error or r.output_len != output_len
            or (r.usage or {}).get("completion_tokens") != output_len or r.finish_reason != FINISH_LENGTH[backend]]


def pooled_cpu(cpus: list[dict[str, Any]]) -> dict[str, Any]:
    """CpuMeter results of several phases as one: CPU seconds summed, cores = CPU s / wall s."""
    wall = sum(c["wall_s"] for c in cpus)
    cpu: dict[str, float | None] = {}
    for c in cpus:
        for k, v in c["cpu_s"].items():
            cpu[k] = None if v is None or (k in cpu and cpu[k] is None) else (cpu.get(k) or 0.0) + v
    others = [c["other_cores"] * c["wall_s"] for c in cpus if c["other_cores"] is not None]
    return {"wall_s": wall, "cpu_s": cpu,
            "cores": {k: (v / wall if v is not None and wall > 0 else None) for k, v in cpu.items()},
            "other_cores": sum(others) / wall if others and wall > 0 else None, "phases": cpus}


def compare(grpc: dict[str, Any], http: dict[str, Any]) -> dict[str, Any]:
    """openai-chat / grpc ratios of the pooled sides, and the issue's targets."""
    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    out = {
        "request_throughput": ratio(http["request_throughput"], grpc["request_throughput"]),
        "output_throughput": ratio(http["output_throughput"], grpc["output_throughput"]),
        "ttft_p50": ratio(http["ttft_ms"]["p50"], grpc["ttft_ms"]["p50"]),
        "ttft_p99": ratio(http["ttft_ms"]["p99"], grpc["ttft_ms"]["p99"]),
        "tpot_mean": ratio(http["tpot_ms"]["mean"], grpc["tpot_ms"]["mean"]),
        "e2el_mean": ratio(http["e2el_ms"]["mean"], grpc["e2el_ms"]["mean"]),
        "equal_tokens": (http["input_tokens"], http["output_tokens"]) == (grpc["input_tokens"], grpc["output_tokens"]),
    }
    thr = out["output_throughput"]
    ttft = out["ttft_p50"]
    out["targets"] = {
        "output_throughput": {"min": THROUGHPUT_MIN, "met": thr is not None and thr >= THROUGHPUT_MIN},
        "ttft_p50": {"max": TTFT_P50_MAX, "met": ttft is not None and ttft <= TTFT_P50_MAX},
    }
    return out


def identical_outputs(a: list[Record], b: list[Record]) -> tuple[int, int]:
    """(prompts whose first-phase outputs are the same token ids on both backends, prompts compared)."""
    first_a, first_b = {}, {}
    for recs, first in ((a, first_a), (b, first_b)):
        for r in recs:
            first.setdefault(r.index, r.output_ids)
    common = [i for i in first_a if i in first_b]
    return sum(first_a[i] == first_b[i] for i in common), len(common)


def print_comparison(sides: dict[str, dict[str, Any]], cmp: dict[str, Any], phases: list[dict[str, Any]],
                     same: tuple[int, int]) -> None:
    rows = []
    for backend, s in sides.items():
        rows.append({"backend": backend, "done": s["completed"], "in": s["input_tokens"], "out": s["output_tokens"],
                     "dur": s["duration_s"], "rps": s["request_throughput"], "tps": s["output_throughput"],
                     "ttft50": s["ttft_ms"]["p50"], "ttft99": s["ttft_ms"]["p99"], "tpot": s["tpot_ms"]["mean"],
                     "e2el": s["e2el_ms"]["mean"], "other": s["cpu"].get("other_cores")})
    rows.append({"backend": "openai-chat / grpc", "rps": cmp["request_throughput"], "tps": cmp["output_throughput"],
                 "ttft50": cmp["ttft_p50"], "ttft99": cmp["ttft_p99"], "tpot": cmp["tpot_mean"],
                 "e2el": cmp["e2el_mean"]})
    cols = [("backend", "backend"), ("done", "done"), ("in", "prompt tok"), ("out", "out tok"),
            ("dur", "duration s", 2), ("rps", "req/s", 3), ("tps", "out tok/s", 2), ("ttft50", "TTFT p50", 2),
            ("ttft99", "TTFT p99", 2), ("tpot", "TPOT mean", 2), ("e2el", "E2EL mean", 2),
            ("other", "other cores", 2)]
    print("\nfront ends (same chat prompts, same scheduler + executor; phases "
          + " ".join(f"{p['backend']}({p['duration_s']:.1f}s)" for p in phases) + "):")
    print(format_table(rows, cols))
    print("ms; the ratio row divides openai-chat by grpc (times: < 1 is faster over HTTP).")
    t = cmp["targets"]
    print(f"target throughput >= {THROUGHPUT_MIN:.2f}x gRPC: {_x(cmp['output_throughput'])} -> "
          f"{'met' if t['output_throughput']['met'] else 'NOT MET'}; target TTFT p50 <= +{TTFT_P50_MAX - 1:.0%}: "
          f"{_x(cmp['ttft_p50'])} -> {'met' if t['ttft_p50']['met'] else 'NOT MET'}; "
          f"equal prompt/output token counts: {cmp['equal_tokens']}; identical outputs: {same[0]}/{same[1]}")


def _x(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}x"
