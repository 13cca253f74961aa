#!/usr/bin/env python
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
1. Peak: the fp32 matmul GFLOP/s of this machine with --threads threads (bench_common; measured again at
   the end, the higher counts) — the denominator of "% peak".
2. Tandem: unless --target names a running scheduler, `python -m executor_service --threads T` and
   `python -m scheduler` are started (scripts/server_process.py). --warmup requests first (other
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

Benchmark-only (baselines need transformers, the plot matplotlib); never imported by the servers.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import grpc
import numpy as np
import torch

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
for p in (str(ROOT), str(SCRIPTS)):
    if p not in sys.path:
        sys.path.insert(0, p)

import bench_common as bc  # noqa: E402
from tandem import server_process  # noqa: E402
from models.config import ModelConfig, read_generation_defaults  # noqa: E402
from tandem.common.v1 import common_pb2 as cpb  # noqa: E402
from tandem.executor.v1 import executor_pb2 as epb  # noqa: E402
from tandem.executor.v1 import executor_pb2_grpc as epb_grpc  # noqa: E402
from tandem.generate.v1 import generate_pb2 as gpb  # noqa: E402
from tandem.generate.v1 import generate_pb2_grpc as gpb_grpc  # noqa: E402

BASELINES = ("hf", "hf-serial")
TARGETS = {"hf": 1.2, "hf-serial": 6.0}  # the targets (SmolLM2 fp32, 32 clients, 128 in / 64 out)
KV_BLOCK_SIZE = 16  # the executor's default --block-size, used to size --kv-blocks
QUICK = {"num_requests": 4, "input_len": 16, "output_len": 8, "concurrency": 2, "warmup": 1,
         "hf_serial_requests": 0, "peak_n": 256, "peak_repeats": 3}
DEFAULTS = {"num_requests": 32, "input_len": 128, "output_len": 64, "concurrency": 32, "warmup": 2,
            "hf_serial_requests": 8, "peak_n": 2048, "peak_repeats": 7}


def log(msg: str) -> None:
    print(f"[bench_serving] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Method and how to read the output: see the module docstring "
                                        "(head -60 scripts/bench_serving.py).")
    ap.add_argument("--model", type=Path, default=None,
                    help="HF model directory served by the executor, used for the prompts' vocabulary, the "
                         "FLOP count and the baselines (default: SmolLM2-135M-Instruct via "
                         "scripts/prepare_default_model.py; with --target and no --model, the vocabulary comes "
                         "from GetModelInfo, FLOPs are not counted and no baseline can run)")
    ap.add_argument("--target", default=None, metavar="HOST:PORT",
                    help="benchmark this running scheduler instead of starting an executor and a scheduler "
                         "(it is left running; --threads, --executor-args and --scheduler-args do not apply)")
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
    ap.add_argument("--executor-args", default="",
                    help="extra arguments for `python -m executor_service`, one shell-quoted string given with '=' "
                         "(--executor-args='--max-batch-tokens 4096'); they come after the script's own: "
                         "--threads T, --kv-blocks sized for the run (unless --kv-blocks or "
                         "--kv-memory-fraction is given here), --log-level WARNING")
    ap.add_argument("--scheduler-args", default="",
                    help="extra arguments for `python -m scheduler`, one shell-quoted string given with '=', e.g. "
                         "--scheduler-args='--max-batch-tokens 2048 --max-running 64' (default: none, the "
                         "scheduler's defaults)")
    ap.add_argument("--request-timeout", type=float, default=600.0,
                    help="gRPC deadline of each Generate call in seconds (default 600)")
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
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            if key == "concurrency" and args.request_rate is not None:
                continue  # open loop: no cap unless asked for
            setattr(args, key, value)
    if args.input_len < 1 or args.output_len < 1 or args.num_requests < 1 or args.warmup < 0:
        ap.error("--input-len, --output-len and --num-requests must be >= 1, --warmup >= 0")
    if args.concurrency is not None and args.concurrency < 1:
        ap.error("--concurrency must be >= 1")
    if args.request_rate is not None and not args.request_rate > 0:
        ap.error("--request-rate must be > 0")
    if args.hf_serial_requests < 0:
        ap.error("--hf-serial-requests must be >= 0")
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


# --------------------------------------------------------------------------------------------- prompts
def prompt_vocabulary(model_dir: Path | None, vocab_size: int, special_ids: Sequence[int]) -> np.ndarray:
    """Token ids a random prompt may use: below both the model's and the tokenizer's vocabulary size
    (a tiny checkpoint's embedding table is padded past its tokenizer), minus the tokenizer's added tokens
    and the given special ids (bos/eos/pad)."""
    limit, banned = vocab_size, {int(i) for i in special_ids if i is not None}
    tok_file = model_dir / "tokenizer.json" if model_dir else None
    if tok_file is not None and tok_file.is_file():
        data = json.loads(tok_file.read_text(encoding="utf-8"))
        vocab = (data.get("model") or {}).get("vocab") or {}
        added = {int(t["id"]) for t in data.get("added_tokens", [])}
        size = max(list(vocab.values() if isinstance(vocab, dict) else range(len(vocab))) + list(added),
                   default=vocab_size - 1) + 1
        limit = min(limit, size)
        banned |= added
    else:  # no tokenizer to read: skip the low ids, where most vocabularies keep their special tokens
        banned |= set(range(min(32, vocab_size // 4)))
    allowed = np.array([i for i in range(limit) if i not in banned], dtype=np.int64)
    if allowed.size == 0:
        raise SystemExit("error: no regular token ids to draw prompts from")
    return allowed


def make_prompts(n: int, length: int, allowed: np.ndarray, seed: int, stream: int) -> list[list[int]]:
    """n prompts of `length` ids drawn uniformly from `allowed`; `stream` separates timed and warm-up prompts."""
    rng = np.random.default_rng([seed, stream])
    return rng.choice(allowed, size=(n, length)).tolist()


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets (s) of n requests: the first at 0, then exponential gaps of mean 1 / rate."""
    rng = np.random.default_rng([seed, 2])
    gaps = rng.exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


# ---------------------------------------------------------------------------------------------- FLOPs
class WorkloadFlops:
    """Useful forward FLOPs of one request (see the module docstring), from the model's config.json."""

    def __init__(self, cfg: ModelConfig) -> None:
        h = cfg.hidden_size
        self.layers, self.heads, self.head_dim = cfg.num_layers, cfg.num_heads, cfg.head_dim
        attn = h * cfg.q_size + 2 * h * cfg.kv_size + cfg.q_size * h
        mlp = 3 * h * cfg.intermediate_size
        self.layer_weights = cfg.num_layers * (attn + mlp)
        self.lm_head_weights = h * cfg.vocab_size

    def request(self, prompt: int, output: int) -> dict[str, float]:
        processed = prompt + output - 1
        # query at position q (0-based) attends q + 1 keys: positions 0 .. prompt + output - 2 are processed
        pairs = processed * (processed + 1) // 2
        linear = 2.0 * self.layer_weights * processed
        lm_head = 2.0 * self.lm_head_weights * output
        attention = 4.0 * self.heads * self.head_dim * self.layers * pairs
        return {"linear": linear, "lm_head": lm_head, "attention": attention,
                "total": linear + lm_head + attention}

    def as_dict(self) -> dict[str, Any]:
        return {"decoder_linear_weights": self.layer_weights, "lm_head_weights": self.lm_head_weights,
                "layers": self.layers, "heads": self.heads, "head_dim": self.head_dim}


# ------------------------------------------------------------------------------------- request records
@dataclass
class Record:
    """One request's raw timings, seconds on one perf_counter clock."""
    index: int
    prompt_len: int
    start: float = 0.0  # sent (Tandem) / its generate call began (baselines)
    arrival: float | None = None  # open loop: when it was due (it may wait for a --concurrency slot)
    end: float = 0.0
    messages: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens) of token-carrying messages
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    usage: dict[str, int] | None = None
    error: str | None = None

    @property
    def output_len(self) -> int:
        return sum(n for _, n in self.messages)

    def metrics(self) -> dict[str, Any]:
        """ttft / latency / tpot (s), itl (one per token after the first), itl_messages (raw gaps)."""
        out: dict[str, Any] = {"ttft": None, "latency": self.end - self.start, "tpot": None, "itl": [],
                               "itl_messages": []}
        if not self.messages:
            return out
        t_first, n_first = self.messages[0]
        out["ttft"] = t_first - self.start
        itl = [0.0] * (n_first - 1)
        prev = t_first
        for t, n in self.messages[1:]:
            gap = t - prev
            out["itl_messages"].append(gap)
            itl += [gap / n] * n
            prev = t
        out["itl"] = itl
        if self.output_len > 1:
            out["tpot"] = (out["latency"] - out["ttft"]) / (self.output_len - 1)
        return out

    def as_json(self, t0: float) -> dict[str, Any]:
        m = self.metrics()
        return {"index": self.index, "prompt_len": self.prompt_len, "output_len": self.output_len,
                "start_s": self.start - t0, "arrival_s": None if self.arrival is None else self.arrival - t0,
                "end_s": self.end - t0, "ttft_ms": _ms(m["ttft"]), "latency_ms": _ms(m["latency"]),
                "tpot_ms": _ms(m["tpot"]), "message_times_s": [t - t0 for t, _ in self.messages],
                "message_tokens": [n for _, n in self.messages], "finish_reason": self.finish_reason,
                "usage": self.usage, "error": self.error, "output_ids": self.output_ids}


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1e3


def aggregate(name: str, records: list[Record], t0: float, duration: float, flops_per_request: float | None,
              peak_gflops: float | None, expected_output: int) -> dict[str, Any]:
    """vLLM-style serving metrics of one side."""
    ok = [r for r in records if r.error is None]
    ms = [r.metrics() for r in ok]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    gflops = flops_per_request * len(ok) / duration / 1e9 if flops_per_request and duration > 0 else None
    return {
        "name": name,
        "requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "exact_output_len": sum(r.output_len == len(r.output_ids) == expected_output for r in ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "input_tokens": in_tokens, "output_tokens": out_tokens,
        "ttft_ms": bc.summarize([m["ttft"] for m in ms if m["ttft"] is not None], 1e3),
        "tpot_ms": bc.summarize([m["tpot"] for m in ms if m["tpot"] is not None], 1e3),
        "itl_ms": bc.summarize([g for m in ms for g in m["itl"]], 1e3),
        "itl_messages_ms": bc.summarize([g for m in ms for g in m["itl_messages"]], 1e3),
        "e2el_ms": bc.summarize([m["latency"] for m in ms], 1e3),
        "gflops": gflops,
        "pct_peak": 100.0 * gflops / peak_gflops if gflops and peak_gflops else None,
        "per_request": [r.as_json(t0) for r in records],
    }


# ----------------------------------------------------------------------------------------- CPU meters
class CpuMeter:
    """CPU seconds of named processes and of the whole machine between start() and stop()."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self._before: dict[str, float | None] = {}
        self._busy = self._t = 0.0

    def start(self) -> None:
        self._before = {k: bc.process_cpu_s(pid) for k, pid in self.pids.items()}
        self._busy, self._t = bc.machine_busy_s() or 0.0, time.perf_counter()

    def stop(self) -> dict[str, Any]:
        wall = time.perf_counter() - self._t
        busy = (bc.machine_busy_s() or 0.0) - self._busy
        cpu = {}
        for k, pid in self.pids.items():
            now, before = bc.process_cpu_s(pid), self._before.get(k)
            cpu[k] = None if now is None or before is None else now - before
        ours = sum(v for v in cpu.values() if v is not None)
        return {"wall_s": wall, "cpu_s": cpu,
                "cores": {k: (v / wall if v is not None and wall > 0 else None) for k, v in cpu.items()},
                "other_cores": max(0.0, busy - ours) / wall if wall > 0 and busy else None}


# -------------------------------------------------------------------------------------- Tandem client
def generate_request(index: int, prompt: list[int], output_len: int, tag: str) -> gpb.GenerateRequest:
    return gpb.GenerateRequest(
        request_id=f"bench-{tag}-{index}", token_ids=gpb.TokenIds(ids=prompt),
        sampling=cpb.SamplingParams(),  # temperature 0: greedy
        stopping=gpb.StoppingCriteria(max_new_tokens=output_len, ignore_eos=True))


async def send_one(stub: gpb_grpc.GenerateServiceStub, rec: Record, prompt: list[int], output_len: int,
                   tag: str, timeout: float) -> Record:
    req = generate_request(rec.index, prompt, output_len, tag)
    rec.start = time.perf_counter()
    try:
        async for msg in stub.Generate(req, timeout=timeout):
            t = time.perf_counter()
            if msg.token_ids:
                rec.messages.append((t, len(msg.token_ids)))
                rec.output_ids.extend(msg.token_ids)
            if msg.finish_reason:
                rec.finish_reason = gpb.FinishReason.Name(msg.finish_reason)
            if msg.HasField("usage"):
                u = msg.usage
                rec.usage = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                             "cached_tokens": u.cached_tokens, "preemptions": u.preemptions}
    except grpc.aio.AioRpcError as exc:
        rec.error = f"{exc.code().name}: {exc.details()}"
    rec.end = time.perf_counter()
    return rec


async def closed_loop(stub, prompts: list[list[int]], output_len: int, concurrency: int, tag: str,
                      timeout: float) -> list[Record]:
    records = [Record(i, len(p)) for i, p in enumerate(prompts)]
    todo = iter(range(len(prompts)))

    async def client() -> None:
        for i in todo:  # one shared iterator: each finished request starts the next one
            await send_one(stub, records[i], prompts[i], output_len, tag, timeout)

    await asyncio.gather(*(client() for _ in range(min(concurrency, len(prompts)))))
    return records


async def open_loop(stub, prompts: list[list[int]], output_len: int, arrivals: list[float],
                    cap: int | None, tag: str, timeout: float) -> list[Record]:
    records = [Record(i, len(p)) for i, p in enumerate(prompts)]
    slots = asyncio.Semaphore(cap) if cap else None
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        records[i].arrival = time.perf_counter()
        if slots is None:
            await send_one(stub, records[i], prompts[i], output_len, tag, timeout)
            return
        async with slots:
            await send_one(stub, records[i], prompts[i], output_len, tag, timeout)

    tasks = []
    for i, offset in enumerate(arrivals):
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(i)))
    await asyncio.gather(*tasks)
    return records


def executor_totals(m: epb.GetMetricsResponse) -> dict[str, Any]:
    """Cumulative counters of the executor's GetMetrics: calls and total ms per operation and RPC."""
    return {"ops": {k: (v.count, v.count * v.mean_ms) for k, v in m.operations.items()},
            "rpcs": {k: (v.count, v.count * v.mean_ms) for k, v in m.rpcs.items()},
            "forward_passes": m.forward_passes, "tokens_processed": m.tokens_processed,
            "tokens_sampled": m.tokens_sampled}


def executor_delta(before: dict[str, Any], after: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """What the executor did during the timed run: calls, mean ms and busy share of the wall time per
    operation (model work, lock wait included) and per RPC (as its gRPC handler saw it). The wall time not
    covered by executor operations is the scheduler's planning, streaming and the loopback round trips."""
    out: dict[str, Any] = {"wall_s": wall_s}
    for group in ("ops", "rpcs"):
        out[group] = {}
        for k, (n, ms) in after[group].items():
            n0, ms0 = before[group].get(k, (0, 0.0))
            if n > n0:
                out[group][k] = {"calls": n - n0, "mean_ms": (ms - ms0) / (n - n0),
                                 "busy_share": (ms - ms0) / 1e3 / wall_s if wall_s > 0 else None}
    for k in ("forward_passes", "tokens_processed", "tokens_sampled"):
        out[k] = after[k] - before[k]
    return out


async def tandem_load(address: str, prompts: list[list[int]], warmup_prompts: list[list[int]], args,
                      meter: CpuMeter, executor_address: str | None
                      ) -> tuple[list[Record], dict[str, Any], dict[str, Any], dict[str, Any] | None]:
    ex_channel = grpc.aio.insecure_channel(executor_address) if executor_address else None
    ex_stub = epb_grpc.ExecutorServiceStub(ex_channel) if ex_channel else None
    async with grpc.aio.insecure_channel(address) as channel:
        await asyncio.wait_for(channel.channel_ready(), timeout=60)
        stub = gpb_grpc.GenerateServiceStub(channel)
        info = await stub.GetModelInfo(gpb.GetModelInfoRequest(), timeout=30)
        if warmup_prompts:
            t = time.perf_counter()
            warm = await closed_loop(stub, warmup_prompts, args.output_len, args.concurrency or len(warmup_prompts),
                                     "warmup", args.request_timeout)
            bad = [r.error for r in warm if r.error]
            if bad:
                raise RuntimeError(f"warm-up request failed: {bad[0]}")
            log(f"warm-up: {len(warm)} requests in {time.perf_counter() - t:.1f}s")
        ex_before = executor_totals(await ex_stub.GetMetrics(epb.GetMetricsRequest(), timeout=30)) if ex_stub else None
        t_start = time.perf_counter()
        meter.start()
        if args.request_rate is None:
            records = await closed_loop(stub, prompts, args.output_len, args.concurrency, "timed",
                                        args.request_timeout)
        else:
            arrivals = poisson_arrivals(len(prompts), args.request_rate, args.seed)
            records = await open_loop(stub, prompts, args.output_len, arrivals, args.concurrency, "timed",
                                      args.request_timeout)
        cpu = meter.stop()
        wall = time.perf_counter() - t_start
        ex_metrics = None
        if ex_stub is not None:
            ex_after = executor_totals(await ex_stub.GetMetrics(epb.GetMetricsRequest(), timeout=30))
            ex_metrics = executor_delta(ex_before, ex_after, wall)
            await ex_channel.close()
    return records, model_info_dict(info), cpu, ex_metrics


def model_info_dict(info: gpb.GetModelInfoResponse) -> dict[str, Any]:
    from google.protobuf import json_format
    return json_format.MessageToDict(info, preserving_proto_field_name=True)


# ------------------------------------------------------------------------------------------ baselines
def step_timer():
    """A transformers streamer that records when each generation step's tokens exist (generate's first
    put() is the prompt, not a step)."""
    from transformers.generation.streamers import BaseStreamer

    class StepTimes(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._prompt_seen = False

        def put(self, value: torch.Tensor) -> None:
            if not self._prompt_seen:
                self._prompt_seen = True
                return
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    return StepTimes()


class HfBaseline:
    def __init__(self, model_dir: Path, pad_id: int) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig
        t = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self._config_cls = GenerationConfig
        self.pad_id = pad_id
        log(f"transformers model loaded in {time.perf_counter() - t:.1f}s "
            f"(attention: {getattr(self.model.config, '_attn_implementation', '?')})")

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[float], float, float]:
        """One batched greedy generate; returns (new ids per prompt, step times, start, end)."""
        ids = torch.tensor(prompts, dtype=torch.long)
        # eos_token_id [] (not None, which falls back to generation_config.json): EOS neither stops
        # generation nor is masked, like Tandem's ignore_eos.
        gc = self._config_cls(max_new_tokens=new_tokens, do_sample=False, eos_token_id=[],
                              pad_token_id=self.pad_id, use_cache=True)
        streamer = step_timer()
        start = time.perf_counter()
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gc,
                                  streamer=streamer)
        end = time.perf_counter()
        new = out[:, ids.shape[1]:].tolist()
        return new, streamer.times, start, end

    def run(self, name: str, prompts: list[list[int]], batch_size: int, output_len: int,
            warmup: bool) -> tuple[list[Record], float, float]:
        """Runs the prompts in batches, one after the other; returns (records, t0, measured duration)."""
        if warmup:
            self.generate(prompts[:batch_size], min(4, output_len))
        records: list[Record] = []
        t0 = time.perf_counter()
        for b in range(0, len(prompts), batch_size):
            batch = prompts[b:b + batch_size]
            new, steps, start, end = self.generate(batch, output_len)
            for j, (p, ids) in enumerate(zip(batch, new)):
                rec = Record(b + j, len(p), start=start, end=end, output_ids=ids,
                             messages=[(t, 1) for t in steps], finish_reason="FINISH_REASON_LENGTH")
                if len(ids) != output_len or len(steps) != output_len:
                    rec.finish_reason = f"{len(ids)} ids, {len(steps)} steps"
                records.append(rec)
            log(f"{name}: {min(b + batch_size, len(prompts))}/{len(prompts)} prompts, last batch "
                f"{end - start:.2f}s")
        return records, t0, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------- output
def agreement(a: list[Record], b: list[Record]) -> dict[str, Any] | None:
    """How many requests two sides generated identically (greedy on both: fp32 rounding of differently
    batched kernels can flip a near-tie, after which the continuations differ), and the mean common prefix."""
    by = {r.index: r for r in b}
    pairs = [(r.output_ids, by[r.index].output_ids) for r in a if r.index in by and r.error is None]
    if not pairs:
        return None
    prefixes = []
    for x, y in pairs:
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefixes.append(n)
    return {"compared": len(pairs), "identical": sum(x == y for x, y in pairs),
            "mean_common_prefix": float(np.mean(prefixes))}


THROUGHPUT_COLUMNS = [("name", "side"), ("completed", "done"), ("exact_output_len", "exact len"),
                      ("duration_s", "duration s"), ("request_throughput", "req/s", 3),
                      ("output_throughput", "out tok/s", 1), ("total_token_throughput", "total tok/s", 1),
                      ("gflops", "GFLOP/s", 1), ("pct_peak", "% peak", 1), ("speedup", "tandem speedup"),
                      ("target", "target", 1), ("cores", "cores"), ("other_cores", "other cores")]
LATENCY_COLUMNS = [("name", "side")] + [
    (f"{metric}_{stat}", f"{label} {stat}", 1)
    for metric, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"))
    for stat in ("mean", "p50", "p99")]


def table_rows(sides: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for s in sides:
        row = {k: s.get(k) for k, *_ in THROUGHPUT_COLUMNS}
        for metric in ("ttft", "tpot", "itl", "e2el"):
            for stat in ("mean", "p50", "p99"):
                row[f"{metric}_{stat}"] = s[f"{metric}_ms"][stat]
        row["cores"] = s.get("cores_text")
        rows.append(row)
    return rows


def write_plot(path: Path, sides: list[dict[str, Any]], records: dict[str, list[Record]],
               t0s: dict[str, float], title: str) -> Path | None:
    """The 4-panel PNG described in the module docstring; None (with a warning) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("warning: matplotlib is not installed; no plot (pip install matplotlib)")
        return None
    colors = {"tandem": "tab:blue", "hf": "tab:orange", "hf-serial": "tab:green"}
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    (ax_tl, ax_cum), (ax_itl, ax_thr) = axes

    tandem = records.get("tandem", [])
    t0 = t0s.get("tandem", 0.0)
    for r in tandem:
        if r.error is None:
            ax_tl.hlines(r.index, r.start - t0, r.end - t0, color="tab:blue", lw=1.5)
            if r.messages:
                ax_tl.plot(r.messages[0][0] - t0, r.index, "o", color="tab:red", ms=3)
        else:
            ax_tl.plot(r.start - t0, r.index, "x", color="black")
    ax_tl.set(title="(a) Tandem requests: send -> end, dot = first token", xlabel="s since the run began",
              ylabel="request")
    ax_tl.yaxis.get_major_locator().set_params(integer=True)
    ax_tl.invert_yaxis()

    for name, recs in records.items():
        times = sorted(t - t0s[name] for r in recs if r.error is None for t, n in r.messages for _ in range(n))
        if times:
            ax_cum.step(times, np.arange(1, len(times) + 1), where="post", color=colors.get(name), label=name)
    ax_cum.set(title="(b) output tokens delivered", xlabel="s since the side's run began", ylabel="tokens")
    ax_cum.legend()

    all_itl = {name: [1e3 * g for r in recs if r.error is None for g in r.metrics()["itl"]]
               for name, recs in records.items()}
    hi = max([np.percentile(v, 99.5) for v in all_itl.values() if v] or [1.0])
    bins = np.linspace(0, hi * 1.05, 60)
    for name, v in all_itl.items():
        if v:
            ax_itl.hist(np.clip(v, 0, bins[-1]), bins=bins, histtype="step", lw=1.5, color=colors.get(name),
                        label=f"{name} (p50 {np.percentile(v, 50):.1f} ms)")
    ax_itl.set(title="(c) inter-token latency (per token; clipped at p99.5)", xlabel="ms", ylabel="tokens")
    ax_itl.legend()

    names = [s["name"] for s in sides]
    values = [s["output_throughput"] for s in sides]
    bars = ax_thr.bar(names, values, color=[colors.get(n, "gray") for n in names])
    for bar, s in zip(bars, sides):
        v = s["output_throughput"]
        label = (f"{v:.0f}" if v >= 100 else f"{v:.3g}") + (f"\n(tandem {s['speedup']})" if s.get("speedup") else "")
        ax_thr.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    ax_thr.set(title="(d) output-token throughput", ylabel="tokens/s")
    ax_thr.margins(y=0.2)

    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------ main
def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def has_flag(args: list[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in args for f in flags)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally/atexit cleanup on SIGTERM too
    threads = max(1, args.threads or usable_cores())
    torch.set_num_threads(threads)
    model_dir = Path(args.model) if args.model else (None if args.target else bc.default_model_dir())
    if args.baselines and model_dir is None:
        raise SystemExit("error: --baseline needs --model DIR (the model the --target scheduler serves)")
    cfg = ModelConfig.from_dir(model_dir) if model_dir else None
    flop_model = WorkloadFlops(cfg) if cfg else None
    flops_req = flop_model.request(args.input_len, args.output_len) if flop_model else None
    if cfg and args.input_len + args.output_len > cfg.max_position_embeddings:
        raise SystemExit(f"error: --input-len + --output-len = {args.input_len + args.output_len} is past the "
                         f"model's {cfg.max_position_embeddings} positions")
    mode = (f"closed loop, {args.concurrency} in flight" if args.request_rate is None else
            f"Poisson {args.request_rate:g} req/s" + (f", at most {args.concurrency} in flight"
                                                       if args.concurrency else ""))
    log(f"model {model_dir or args.target}; {args.num_requests} requests x ({args.input_len} in, "
        f"{args.output_len} out), {mode}; {threads} threads; baselines: {', '.join(args.baselines) or 'none'}")

    peak_before = bc.measure_matmul_peak("cpu", torch.float32, n=args.peak_n, repeats=args.peak_repeats)
    log(f"fp32 matmul peak (before): {peak_before.gflops:.1f} GFLOP/s")

    # ---- Tandem phase
    executor = scheduler = None
    servers: dict[str, Any] = {}
    try:
        if args.target:
            address = args.target
        else:
            ex_args = shlex.split(args.executor_args)
            in_flight = args.concurrency or args.num_requests
            kv_blocks = (in_flight + max(args.warmup, 1)) * -(-(args.input_len + args.output_len) // KV_BLOCK_SIZE) + 16
            extra = ["--threads", str(threads)]
            if not has_flag(ex_args, "--kv-blocks", "--kv-memory-fraction"):
                extra += ["--kv-blocks", str(kv_blocks)]
            if not has_flag(ex_args, "--log-level"):
                extra += ["--log-level", "WARNING"]
            t = time.perf_counter()
            executor = server_process.launch_executor(model_dir, *extra, *ex_args)
            scheduler = server_process.launch_scheduler(executor.address, *shlex.split(args.scheduler_args))
            address = scheduler.address
            servers = {"executor": {"address": executor.address, "pid": executor.proc.pid, "command": executor.args},
                       "scheduler": {"address": address, "pid": scheduler.proc.pid, "command": scheduler.args}}
            log(f"executor {executor.address} and scheduler {address} ready in {time.perf_counter() - t:.1f}s")
        pids = {"client": os.getpid()}
        if executor is not None:
            pids.update(executor=executor.proc.pid, scheduler=scheduler.proc.pid)

        # prompts: the vocabulary from the model dir, or (with --target alone) from GetModelInfo
        if cfg is not None:
            gen = read_generation_defaults(model_dir, cfg)
            raw = json.loads((model_dir / "config.json").read_text())
            special = [cfg.bos_token_id, gen.bos_token_id, raw.get("pad_token_id"), *cfg.eos_token_ids,
                       *gen.eos_token_ids]
            vocab_size = cfg.vocab_size
        else:
            with grpc.insecure_channel(address) as ch:
                info = gpb_grpc.GenerateServiceStub(ch).GetModelInfo(gpb.GetModelInfoRequest(), timeout=30)
            special, vocab_size = list(info.eos_token_ids), info.vocab_size
        allowed = prompt_vocabulary(model_dir, vocab_size, special)
        prompts = make_prompts(args.num_requests, args.input_len, allowed, args.seed, stream=0)
        warmup_prompts = make_prompts(args.warmup, args.input_len, allowed, args.seed, stream=1)

        meter = CpuMeter(pids)
        records, model_info, cpu, ex_metrics = asyncio.run(
            tandem_load(address, prompts, warmup_prompts, args, meter, executor.address if executor else None))
        t0 = min(r.start for r in records)
        duration = max(r.end for r in records) - t0
        log(f"tandem: {len(records)} requests in {duration:.2f}s")
        if executor is not None and any(r.error for r in records):
            log(f"a request failed; scheduler log tail:\n{scheduler.log(4000)}\nexecutor log tail:\n"
                f"{executor.log(4000)}")
        if executor is not None:
            codes = {"scheduler": scheduler.stop(), "executor": executor.stop()}
            log(f"servers stopped (exit codes: scheduler {codes['scheduler']}, executor {codes['executor']})")
            servers["exit_codes"] = codes
    finally:
        for s in (scheduler, executor):
            if s is not None:
                s.stop()

    tandem = aggregate("tandem", records, t0, duration, flops_req and flops_req["total"], None, args.output_len)
    tandem["cpu"] = cpu
    tandem["executor_metrics"] = ex_metrics
    sides = [tandem]
    all_records = {"tandem": records}
    t0s = {"tandem": t0}
    bad = [r for r in records if r.error or r.output_len != args.output_len
           or (r.usage or {}).get("completion_tokens") != args.output_len or r.finish_reason != "FINISH_REASON_LENGTH"]
    for r in bad[:5]:
        log(f"tandem request {r.index}: error {r.error}, {r.output_len} streamed tokens, usage {r.usage}, "
            f"finish {r.finish_reason or '-'}")

    # ---- baselines, with the servers stopped
    baseline_info: dict[str, Any] = {}
    if args.baselines:
        hf_model = HfBaseline(model_dir, pad_id=int(json.loads((model_dir / "config.json").read_text())
                                                    .get("pad_token_id") or 0))
        for name in args.baselines:
            meter = CpuMeter({"client": os.getpid()})
            meter.start()
            if name == "hf":
                recs, b_t0, measured = hf_model.run(name, prompts, args.hf_batch_size, args.output_len,
                                                    warmup=args.warmup > 0)
                duration_b, info = measured, {"batch_size": args.hf_batch_size}
            else:
                k = args.hf_serial_requests or args.num_requests
                k = min(k, args.num_requests)
                recs, b_t0, measured = hf_model.run(name, prompts[:k], 1, args.output_len, warmup=args.warmup > 0)
                duration_b = measured * args.num_requests / k
                info = {"timed_requests": k, "measured_s": measured, "extrapolated": k < args.num_requests}
            cpu_b = meter.stop()
            side = aggregate(name, recs, b_t0, measured, flops_req and flops_req["total"], None, args.output_len)
            side["duration_s"] = duration_b  # hf-serial: extrapolated to every request (rates: measured)
            side.update(cpu=cpu_b, settings=info, agreement_with_tandem=agreement(recs, records))
            sides.append(side)
            all_records[name] = recs
            t0s[name] = b_t0
            baseline_info[name] = info
            log(f"{name}: {side['output_throughput']:.1f} output tok/s (measured {measured:.2f}s)")

    peak_after = bc.measure_matmul_peak("cpu", torch.float32, n=args.peak_n, repeats=args.peak_repeats)
    peak = max(peak_before.gflops, peak_after.gflops)
    log(f"fp32 matmul peak (after): {peak_after.gflops:.1f} GFLOP/s")

    for s in sides:
        if s["gflops"]:
            s["pct_peak"] = 100.0 * s["gflops"] / peak
        cores = s["cpu"]["cores"]
        s["cores_text"] = "/".join(f"{cores[k]:.2f}" for k in ("executor", "scheduler", "client")
                                   if cores.get(k) is not None)
        s["other_cores"] = s["cpu"]["other_cores"]
        if s["name"] != "tandem":
            s["speedup"] = f"{tandem['output_throughput'] / s['output_throughput']:.2f}x"
            s["speedup_value"] = tandem["output_throughput"] / s["output_throughput"]
            s["target"] = TARGETS.get(s["name"])
            s["meets_target"] = s["speedup_value"] >= s["target"] if s["target"] else None

    # ---- report
    model_name = model_dir.name if model_dir else model_info.get("model_id", "?")
    print(f"model: {model_name}  ({cfg.architecture if cfg else model_info.get('architecture')}, "
          f"{model_info.get('dtype', '?')} on {model_info.get('device', '?')})  threads: {threads}  "
          f"peak fp32 matmul: {peak:.1f} GFLOP/s")
    print(f"workload: {args.num_requests} requests x ({args.input_len} prompt, {args.output_len} output tokens), "
          f"{mode}, seed {args.seed}; tandem = scheduler {address}"
          + (f"; hf batch {args.hf_batch_size}" if "hf" in args.baselines else "")
          + (f"; hf-serial timed {baseline_info['hf-serial']['timed_requests']} of {args.num_requests}"
             f"{' (duration extrapolated)' if baseline_info['hf-serial']['extrapolated'] else ''}"
             if "hf-serial" in baseline_info else ""))
    print()
    rows = table_rows(sides)
    print(bc.format_table(rows, THROUGHPUT_COLUMNS))
    print("\ncores: executor/scheduler/client processes (tandem) or this process (baselines), CPU s per wall s; "
          "other cores: the rest of the machine meanwhile.\ntandem speedup: tandem output tok/s / the side's; "
          "target: the issue's minimum speedup.\n")
    print(bc.format_table(rows, LATENCY_COLUMNS))
    print("\nms; TTFT = first token, TPOT = (E2E - TTFT) / (tokens - 1) per request, ITL = per token "
          "(a message of k tokens counts k gaps of 1/k), E2EL = end-to-end latency.")
    if ex_metrics:
        op = ex_metrics["ops"].get("unified_decode")
        rpc = ex_metrics["rpcs"].get("UnifiedDecode")
        if op:
            print(f"executor during the timed run: {op['calls']} steps (UnifiedDecode), {op['mean_ms']:.1f} ms of model "
                  f"work per step, busy {100 * op['busy_share']:.0f}% of the run"
                  + (f" (RPC handler {100 * rpc['busy_share']:.0f}%)" if rpc else "")
                  + f"; the rest is the scheduler, streaming and round trips; "
                  f"{ex_metrics['tokens_processed']} tokens processed, {ex_metrics['tokens_sampled']} sampled")
    for s in sides[1:]:
        agree = s.get("agreement_with_tandem")
        if agree:
            print(f"{s['name']}: {agree['identical']}/{agree['compared']} requests generated the same tokens as "
                  f"tandem (mean common prefix {agree['mean_common_prefix']:.1f} of {args.output_len})")
    if any((s.get("other_cores") or 0) > 0.2 for s in sides):
        print("note: other processes used > 0.2 cores during a phase (other cores column): timings are noisy")
    if bad:
        print(f"ERROR: {len(bad)} of {len(records)} tandem requests failed or did not produce exactly "
              f"{args.output_len} tokens (see stderr)")

    payload = {
        "benchmark": "bench_serving",
        "config": {"model": str(model_dir) if model_dir else None, "target": args.target,
                   "input_len": args.input_len, "output_len": args.output_len, "num_requests": args.num_requests,
                   "concurrency": args.concurrency, "request_rate": args.request_rate, "mode": mode,
                   "baselines": args.baselines, "hf_batch_size": args.hf_batch_size,
                   "hf_serial_requests": args.hf_serial_requests, "threads": threads, "seed": args.seed,
                   "warmup": args.warmup, "executor_args": args.executor_args,
                   "scheduler_args": args.scheduler_args, "quick": args.quick,
                   "prompt_vocabulary": {"ids": int(allowed.size), "min": int(allowed.min()),
                                         "max": int(allowed.max())}},
        "machine": bc.machine_info("cpu"),
        "peak": {"gflops": peak, "before": peak_before.as_dict(), "after": peak_after.as_dict()},
        "model": {"name": model_name, "info": model_info,
                  "flops": None if flop_model is None else {**flop_model.as_dict(), "per_request": flops_req}},
        "servers": servers,
        "all_exact_output_len": not bad,
        "sides": {s["name"]: {k: v for k, v in s.items() if k != "cores_text"} for s in sides},
        "ratios": {s["name"]: {"output_throughput": s["speedup_value"],
                               "duration": s["duration_s"] / tandem["duration_s"],
                               "target": s["target"], "meets_target": s["meets_target"]} for s in sides[1:]},
    }
    title = (f"{model_name}: {args.num_requests} x ({args.input_len} in, {args.output_len} out), {mode}, "
             f"{threads} threads")
    plot = write_plot(args.plot, sides, all_records, t0s, title)
    payload["plot"] = str(plot) if plot else None
    path = bc.write_json(args.out, payload)
    log(f"wrote {path}" + (f" and {plot}" if plot else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
