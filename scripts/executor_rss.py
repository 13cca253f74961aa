#!/usr/bin/env python
"""The executor's resident memory under load (issue 47, docs/operations.md 'Memory'): starts a real executor and
scheduler on a model, drives N short generations at some concurrency through the scheduler (prompts of varied
lengths, so the batches vary in size), and samples the executor's RSS from /proc every interval.

    python scripts/executor_rss.py --model /tmp/tiny-llama --requests 2000 --concurrency 32 \\
        --executor-args='--malloc-arena-max 0'

Prints one line per sample (seconds, requests done, RSS MB) and a summary (RSS at READY, after the first 10% of
the requests, at the end, peak). The test tests/executor/test_executor_rss.py drives the same load (run_load).
Test/measurement only; never imported by the servers.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import random
import shlex
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from tandem import server_process  # noqa: E402
from tandem.generate.v1 import generate_pb2 as gpb  # noqa: E402
from tandem.generate.v1 import generate_pb2_grpc as gpb_grpc  # noqa: E402


def rss_mb(pid: int) -> float:
    """VmRSS of a process in MB (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


@dataclass
class LoadResult:
    done: int = 0
    failed: list[str] = field(default_factory=list)
    samples: list[tuple[float, int, float]] = field(default_factory=list)  # (s since start, requests done, RSS MB)
    ready_mb: float = 0.0


def run_load(scheduler_address: str, executor_pid: int, requests: int, concurrency: int, max_tokens: int,
             vocab: int, interval_s: float = 0.5, seed: int = 0, echo: bool = False,
             lengths: tuple[int, ...] = (4, 16, 40, 90, 200)) -> LoadResult:
    """Drives `requests` greedy generations of max_tokens tokens (prompts of random token ids below vocab, their
    lengths drawn from `lengths`) at `concurrency`, sampling the executor's RSS every interval_s (printed as they come with echo)."""
    out = LoadResult(ready_mb=rss_mb(executor_pid))
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.choice(lengths))] for _ in range(requests)]
    channel = grpc.insecure_channel(scheduler_address)
    stub = gpb_grpc.GenerateServiceStub(channel)
    guard = threading.Lock()

    def one(n: int) -> None:
        req = gpb.GenerateRequest(request_id=f"rss-{n}", token_ids=gpb.TokenIds(ids=prompts[n]),
                                  stopping=gpb.StoppingCriteria(max_new_tokens=max_tokens, ignore_eos=True))
        try:
            for _ in stub.Generate(req, timeout=120):
                pass
        except grpc.RpcError as exc:
            with guard:
                out.failed.append(f"{exc.code().name}: {exc.details()}")
            return
        with guard:
            out.done += 1

    start = time.monotonic()
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(interval_s):
            out.samples.append((time.monotonic() - start, out.done, rss_mb(executor_pid)))
            if echo:
                t, done, mb = out.samples[-1]
                print(f"{t:7.1f}s {done:6d} done  RSS {mb:7.1f} MB", flush=True)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with cf.ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, range(requests)))
    finally:
        stop.set()
        sampler.join()
        channel.close()
    out.samples.append((time.monotonic() - start, out.done, rss_mb(executor_pid)))
    return out


def summary(r: LoadResult) -> dict[str, float]:
    """RSS at READY, once a tenth of the requests were done (warm), at the end, and the peak (MB)."""
    warm = next((mb for _, done, mb in r.samples if done >= r.done // 10), r.samples[0][2])
    return {"ready": r.ready_mb, "warm": warm, "end": r.samples[-1][2], "peak": max(mb for _, _, mb in r.samples),
            "seconds": r.samples[-1][0]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="HF model directory (a tiny random one is enough)")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=400, help="prompt token ids are drawn below this")
    ap.add_argument("--lengths", default="4,16,40,90,200", help="prompt lengths drawn from (comma list)")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between RSS samples")
    ap.add_argument("--executor-args", default="", help="extra executor flags, one quoted string")
    args = ap.parse_args(argv)
    ex = server_process.launch_executor(args.model, "--device", "cpu", *shlex.split(args.executor_args))
    try:
        sch = server_process.launch_scheduler(ex.address)
        try:
            r = run_load(sch.address, ex.proc.pid, args.requests, args.concurrency, args.max_tokens, args.vocab,
                         args.interval, echo=True, lengths=tuple(int(n) for n in args.lengths.split(",")))
        finally:
            sch.stop()
    finally:
        ex.stop()
    s = summary(r)
    print(f"executor args: {args.executor_args or '(defaults)'}; {r.done} done, {len(r.failed)} failed; RSS MB: "
          f"READY {s['ready']:.0f}, warm (10%) {s['warm']:.0f}, end {s['end']:.0f}, peak {s['peak']:.0f}; "
          f"{s['seconds']:.1f} s")
    return 1 if r.failed else 0


if __name__ == "__main__":
    sys.exit(main())
