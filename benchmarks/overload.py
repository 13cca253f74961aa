"""Overload: what admitted requests and refused ones see at 2x, 5x and 10x capacity, through real executor +
scheduler processes and the OpenAI front (streamed completions, open-loop arrivals).

Capacity is measured first: --max-running clients in a closed loop for --calibrate-s, requests finished per
second. Then each load sends requests at that rate times the multiplier, evenly spaced, for --seconds, and waits
for every answer. Per load: requests sent, admitted (200) and refused (429, with its Retry-After), lost (any
other ending, an admitted stream cut short or without all its tokens: must be 0), admitted requests' wait for
their status line p99 (sent once the request is admitted into a batch: the queue's part of TTFT), TTFT p50 /
p99 (to the first token's chunk: the requests ask logprobs 1, so a token whose text is still empty makes one too), refusal latency (request sent to 429 read) p50 / p99 split by reason — refused on arrival (queue full, or a
wait estimated past the bound: these must be fast), ended in the queue at --max-queue-time-s (these wait the
bound by design), refused by the connection guard (--http-max-connections-per-client: must not happen, the
run raises the cap past the load's connections) — the Retry-After given, and both processes' RSS after the
load. The scheduler runs --max-queue-time-s (default 5 here) and --max-running as given. Method:
docs/benchmarks.md#overload."""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import httpx

from benchmarks.cli import add_process_args, add_sizes, int_list, make_log, parse, parser, serving_setup, stack
from benchmarks.measure import proc_memory, summarize
from benchmarks.report import format_table, machine_info, model_json, write_json

DEFAULTS = {"loads": "2,5,10", "output_len": 32, "seconds": 20, "calibrate_s": 10, "max_running": 8}
QUICK = {"loads": "2,5", "output_len": 8, "seconds": 4, "calibrate_s": 3, "max_running": 2}
PROMPT = "Tell me about the sea, the wind and the ships that cross it."
MAX_CONNECTIONS = 16384  # the scheduler's HTTP connection caps for the run: every request has its own connection
# A 429's reason, from its message (scheduler/engine/admission.py, scheduler/http/connections.py), first match.
REASONS = (("HTTP connections open", "connection_cap"), ("not admitted within", "queue_time"),
           ("queue is full", "arrival"), ("would wait about", "arrival"))
log = make_log("bench_overload")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = parser("overload", __doc__, "loads 2,5; 8 tokens; 4 s each; 2 running")
    add_sizes(ap, DEFAULTS, {"loads": "multiples of the measured capacity, comma-separated",
                             "output-len": "tokens per request (ignore_eos)", "seconds": "seconds of arrivals per load",
                             "calibrate-s": "seconds of the closed-loop capacity measurement",
                             "max-running": "the scheduler's --max-running"})
    ap.add_argument("--max-queue-time-s", type=float, default=5.0, help="the scheduler's bound (default 5)")
    add_process_args(ap)
    args = parse(ap, argv, QUICK, DEFAULTS)
    args.load_list = int_list(args.loads, "--loads")
    return args


async def one(http: httpx.AsyncClient, output_len: int) -> dict[str, Any]:
    """One streamed completion: its ending ("done", "refused", or what went wrong), TTFT or refusal latency."""
    body = {"model": "", "prompt": PROMPT, "max_tokens": output_len, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            "logprobs": 1}  # (every token then makes a chunk, also one whose text is empty: TTFT is the first token's)
    t0 = time.perf_counter()
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            headers_s = time.perf_counter() - t0  # a stream's status line is sent once it is admitted
            if r.status_code == 429:
                message = json.loads(await r.aread())["error"]["message"]
                return {"end": "refused", "latency_s": time.perf_counter() - t0,
                        "reason": next((reason for text, reason in REASONS if text in message), "other"),
                        "retry_after": int(r.headers.get("retry-after", "0") or 0)}
            if r.status_code != 200:
                return {"end": f"http {r.status_code}"}
            ttft, tokens, finish = None, 0, None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"end": "error event"}
                for c in chunk.get("choices") or ():
                    if (c.get("text") or (c.get("logprobs") or {}).get("tokens")) and ttft is None:
                        ttft = time.perf_counter() - t0
                    finish = c.get("finish_reason") or finish
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
            ok = finish == "length" and tokens == output_len
            return {"end": "done" if ok else "short", "ttft_s": ttft, "admitted_s": headers_s}
    except httpx.HTTPError as exc:
        return {"end": type(exc).__name__}


async def calibrate(url: str, clients: int, seconds: float, output_len: int) -> float:
    """Requests finished per second by `clients` closed-loop clients (the batch kept full)."""
    done = 0
    deadline = time.perf_counter() + seconds

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            if (await one(http, output_len))["end"] == "done":
                done += 1

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=None)) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return done / (time.perf_counter() - t0)


async def load(url: str, rate: float, seconds: float, output_len: int) -> list[dict[str, Any]]:
    """Open loop: a request every 1/rate s for `seconds`, each on its own connection; every answer awaited."""
    tasks = []
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=None)) as http:
        t0 = time.perf_counter()
        n = int(rate * seconds)
        for i in range(n):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(one(http, output_len)))
        return list(await asyncio.gather(*tasks))


def row(multiple: int, rate: float, results: list[dict[str, Any]], pids: dict[str, int]) -> dict[str, Any]:
    done = [r for r in results if r["end"] == "done"]
    refused = [r for r in results if r["end"] == "refused"]
    ttft = summarize([r["ttft_s"] for r in done if r.get("ttft_s") is not None], 1e3)
    admitted = summarize([r["admitted_s"] for r in done], 1e3)
    by_reason = {reason: [r["latency_s"] for r in refused if r["reason"] == reason]
                 for reason in ("arrival", "queue_time", "connection_cap", "other")}
    arrival, expired = summarize(by_reason["arrival"], 1e3), summarize(by_reason["queue_time"], 1e3)
    retry = [r["retry_after"] for r in refused]
    mem = {k: proc_memory(pid)["rss"] for k, pid in pids.items()}
    return {"load": f"{multiple}x", "rate_rps": rate, "sent": len(results), "admitted": len(done),
            "refused": len(refused), "lost": len(results) - len(done) - len(refused),
            "lost_kinds": sorted({r["end"] for r in results} - {"done", "refused"}),
            "admitted_p99_ms": admitted.get("p99"), "ttft_p50_ms": ttft.get("p50"), "ttft_p99_ms": ttft.get("p99"),
            "arrival_refused": len(by_reason["arrival"]), "arrival_p50_ms": arrival.get("p50"),
            "arrival_p99_ms": arrival.get("p99"), "expired": len(by_reason["queue_time"]),
            "expired_p50_ms": expired.get("p50"), "expired_p99_ms": expired.get("p99"),
            "connection_cap": len(by_reason["connection_cap"]), "other_refused": len(by_reason["other"]),
            "retry_after_s": f"{min(retry)}-{max(retry)}" if retry else "-",
            "scheduler_rss_mb": (mem["scheduler"] or 0) / 2**20, "executor_rss_mb": (mem["executor"] or 0) / 2**20}


COLUMNS = [("load", "load"), ("rate_rps", "req/s"), ("sent", "sent"), ("admitted", "admitted"), ("refused", "refused"),
           ("lost", "lost"), ("admitted_p99_ms", "to 200 p99 ms"), ("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p99_ms", "TTFT p99 ms"),
           ("arrival_refused", "on arrival"), ("arrival_p50_ms", "arrival p50 ms"),
           ("arrival_p99_ms", "arrival p99 ms"),
           ("expired", "queue-time"), ("expired_p50_ms", "queue-time p50 ms"), ("expired_p99_ms", "queue-time p99 ms"),
           ("connection_cap", "conn cap"), ("other_refused", "other 429"),
           ("retry_after_s", "Retry-After s"), ("scheduler_rss_mb", "sched RSS MB"), ("executor_rss_mb", "exec RSS MB")]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads, directory, cfg = serving_setup(args)
    scheduler_flags = ["--max-running", str(args.max_running), "--max-queue-time-s", str(args.max_queue_time_s),
                       "--max-waiting", "100000", "--http-max-connections", str(MAX_CONNECTIONS),
                       "--http-max-connections-per-client", str(MAX_CONNECTIONS), *args.scheduler_args.split()]
    with stack(directory, ["--threads", str(threads), *args.executor_args.split()], scheduler_flags) as (ex, sch):
        url = sch.http_url
        pids = {"scheduler": sch.proc.pid, "executor": ex.proc.pid}
        log(f"measuring capacity: {args.max_running} clients for {args.calibrate_s} s")
        capacity = asyncio.run(calibrate(url, args.max_running, args.calibrate_s, args.output_len))
        log(f"capacity {capacity:.2f} requests/s")
        rows = []
        for multiple in args.load_list:
            rate = capacity * multiple
            log(f"{multiple}x: {rate:.1f} requests/s for {args.seconds} s")
            rows.append(row(multiple, rate, asyncio.run(load(url, rate, args.seconds, args.output_len)), pids))
    print(f"capacity {capacity:.2f} requests/s ({args.max_running} running, {args.output_len} tokens each); "
          f"--max-queue-time-s {args.max_queue_time_s:g}")
    print(format_table(rows, COLUMNS))
    write_json(args.out, {"benchmark": "overload", "machine": machine_info(), "model": model_json(directory, cfg),
                          "capacity_rps": capacity, "args": {k: v for k, v in vars(args).items() if k != "model"},
                          "rows": rows})
    return 0 if all(r["lost"] == 0 for r in rows) else 1
