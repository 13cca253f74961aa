"""The fleet benchmark's servers (N executors, one scheduler; disagg's too), its streams over gRPC Generate (its
usage counts preemptions, which tell a moved stream) and its failover run: every stream at once, the busiest
executor SIGKILLed once every stream has `kill_after` tokens; then what each stream saw around the kill (moved,
resume, pause, recompute: docs/benchmarks.md defines them)."""
from __future__ import annotations

import asyncio
import itertools
import os
import signal
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import grpc
from google.protobuf import json_format

from benchmarks.measure import summarize
from benchmarks.request_metrics import Record, exact
from tandem import server_process
from tandem.common.v1 import common_pb2 as cpb
from tandem.generate.v1 import generate_pb2 as gpb
from tandem.generate.v1 import generate_pb2_grpc as gpb_grpc

PAUSE_FACTOR = 5.0  # paused: the largest gap after the kill >= this x the median gap before it


class Fleet:
    """Executors (one per flag list, loading in parallel) and one scheduler over all of them (--executor repeated):
    the fleet and disagg benchmarks' servers."""

    def __init__(self, model_dir: Path, executor_flags: list[list[str]], scheduler_args: list[str] = ()) -> None:
        t = time.perf_counter()
        self.executors: list[server_process.ServerProcess] = []
        try:
            for flags in executor_flags:
                self.executors.append(server_process.start("executor", "executor_service", "--model", str(model_dir),
                                                           "--port", "0", *flags))
            for e in self.executors:
                e.wait_ready()
            targets = [f for e in self.executors for f in ("--executor", e.address)]
            self.scheduler = server_process.launch("scheduler", "scheduler", *targets, "--port", "0", *scheduler_args)
        except BaseException:
            for e in self.executors:
                e.stop(timeout=5)
            raise
        self.address, self.executor_addresses = self.scheduler.address, [e.address for e in self.executors]
        self.startup_s = time.perf_counter() - t

    def pids(self) -> dict[str, int]:
        return {**{f"executor-{i}": e.proc.pid for i, e in enumerate(self.executors)},
                "scheduler": self.scheduler.proc.pid, "client": os.getpid()}

    def sigkill(self, index: int) -> float:
        """SIGKILLs an executor (no drain); returns the perf_counter instant just before the signal."""
        t = time.perf_counter()
        os.kill(self.executors[index].proc.pid, signal.SIGKILL)
        return t

    def stop(self) -> dict[str, int]:
        """The scheduler first (it drains), then every executor at once (their drains overlap); exit codes by
        name: 0 after a clean drain, -9 when SIGKILLed (one that already exited: its code)."""
        codes = {"scheduler": self.scheduler.stop()}
        for e in self.executors:
            e.send_signal()
        for i, e in enumerate(self.executors):
            try:  # not stop() at once: a second SIGTERM kills a Python that is already exiting
                e.wait_exit()
            except RuntimeError:
                pass
            codes[f"executor-{i}"] = e.stop()
        return codes


async def stream(stub: Any, rec: Record, prompt: list[int], output_len: int, timeout: float,
                 on_tokens: Callable[[], None] | None = None) -> None:
    """One greedy request of exactly output_len tokens into rec; on_tokens after each token-carrying message."""
    req = gpb.GenerateRequest(request_id=f"bench-fleet-{rec.index}", token_ids=gpb.TokenIds(ids=prompt),
                              sampling=cpb.SamplingParams(),
                              stopping=gpb.StoppingCriteria(max_new_tokens=output_len, ignore_eos=True))
    rec.start = time.perf_counter()
    try:
        async for msg in stub.Generate(req, timeout=timeout):
            if msg.token_ids:
                rec.messages.append((time.perf_counter(), len(msg.token_ids)))
                rec.output_ids.extend(msg.token_ids)
                if on_tokens is not None:
                    on_tokens()
            if msg.finish_reason:
                rec.finish_reason = gpb.FinishReason.Name(msg.finish_reason).removeprefix("FINISH_REASON_").lower()
            if msg.HasField("usage"):
                u = msg.usage
                rec.usage = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                             "preemptions": u.preemptions}
    except grpc.aio.AioRpcError as exc:
        rec.error = f"{exc.code().name}: {exc.details()}"
    rec.end = time.perf_counter()


def model_info(stub: Any) -> Any:
    return stub.GetModelInfo(gpb.GetModelInfoRequest(), timeout=30)


async def failover_run(fleet: Fleet, prompts: list[list[int]], output_len: int, kill_after: int, timeout: float,
                       kill: bool) -> dict[str, Any]:
    """Every prompt streamed at once (after the fleet's warm-up); with `kill`, the busiest executor (GetModelInfo;
    ties: the first) is SIGKILLed once every stream has kill_after tokens. Returns records and the kill."""
    records = [Record(i, len(p)) for i, p in enumerate(prompts)]
    started = asyncio.Event()
    addresses = fleet.executor_addresses
    async with grpc.aio.insecure_channel(fleet.address) as channel:
        stub = gpb_grpc.GenerateServiceStub(channel)
        progress = lambda: all(r.output_len >= kill_after for r in records) and started.set()  # noqa: E731
        streams = asyncio.ensure_future(asyncio.gather(
            *(stream(stub, r, prompts[r.index], output_len, timeout, progress) for r in records)))
        info = None
        if kill:
            waiter = asyncio.ensure_future(started.wait())
            await asyncio.wait({waiter, streams}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if started.is_set():
                status = (await model_info(stub)).executors
                running = {e.address: e.running for e in status}
                victim = max(range(len(addresses)), key=lambda i: (running.get(addresses[i], 0), -i))
                info = {"index": victim, "address": addresses[victim], "t": fleet.sigkill(victim), "running": running,
                        "streams_finished_before": sum(1 for r in records if r.end),
                        "tokens_streamed_before": sum(r.output_len for r in records)}
        await streams
        states = json_format.MessageToDict(await model_info(stub), preserving_proto_field_name=True)
    states = states.get("executors", [])
    return {"records": records, "kill": info, "states_after": states}


def stream_view(rec: Record, t_kill: float, output_len: int) -> dict[str, Any]:
    """One stream around the kill at t_kill (perf_counter); times in ms."""
    times = [t for t, _ in rec.messages]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    before_gaps = [g for g, t in zip(gaps, times[1:]) if t < t_kill]
    after = [i for i, t in enumerate(times) if t >= t_kill]
    preemptions = (rec.usage or {}).get("preemptions")
    v: dict[str, Any] = {
        "index": rec.index, "prompt_len": rec.prompt_len, "preemptions": preemptions,
        "moved": None if preemptions is None else preemptions > 0,
        "tokens_before_kill": sum(n for t, n in rec.messages if t < t_kill),
        "max_gap_ms": max(gaps) * 1e3 if gaps else None,
        "median_gap_before_kill_ms": statistics.median(before_gaps) * 1e3 if before_gaps else None,
        "next_token_after_kill_ms": (times[after[0]] - t_kill) * 1e3 if after else None,
        "resume_after_kill_ms": None, "pause_ms": None, "tokens_before_resume": None,
        "completed": exact(rec, output_len), "error": rec.error}
    if after:
        resume = max(after, key=lambda i: times[i] - (times[i - 1] if i > 0 else rec.start))
        v["pause_ms"] = (times[resume] - (times[resume - 1] if resume > 0 else rec.start)) * 1e3
        if v["moved"]:  # a stream that stayed has no resume: its largest gap is a slow step, not a move
            v["resume_after_kill_ms"] = (times[resume] - t_kill) * 1e3
            v["tokens_before_resume"] = sum(n for _, n in rec.messages[:resume])
    v["paused"] = bool(v["pause_ms"] and v["median_gap_before_kill_ms"]
                       and v["pause_ms"] >= PAUSE_FACTOR * v["median_gap_before_kill_ms"])
    v["recomputed_tokens"] = rec.prompt_len + v["tokens_before_resume"] if v["tokens_before_resume"] is not None else 0
    return v


def group_summary(views: list[dict[str, Any]]) -> dict[str, Any]:
    dist = lambda key: summarize([v[key] for v in views if v[key] is not None])  # noqa: E731
    return {"streams": len(views), "paused": sum(v["paused"] for v in views),
            "completed": sum(v["completed"] for v in views), "errors": sum(v["error"] is not None for v in views),
            "tokens_before_kill": sum(v["tokens_before_kill"] for v in views),
            "recomputed_tokens": sum(v["recomputed_tokens"] for v in views), "pause_ms": dist("pause_ms"),
            "next_token_after_kill_ms": dist("next_token_after_kill_ms"),
            "resume_after_kill_ms": dist("resume_after_kill_ms")}


def analyse(run: dict[str, Any], output_len: int) -> dict[str, Any]:
    """Per-stream views and the moved / stayed groups."""
    kill, records = run["kill"], run["records"]
    views = [stream_view(r, kill["t"], output_len) for r in records]
    moved, stayed = [v for v in views if v["moved"]], [v for v in views if v["moved"] is False]
    recomputed = sum(v["recomputed_tokens"] for v in moved)
    return {"streams": views, "moved": group_summary(moved), "stayed": group_summary(stayed),
            "unknown": sum(v["moved"] is None for v in views), "recomputed_tokens": recomputed,
            "recomputed_prompt_tokens": sum(v["prompt_len"] for v in moved),
            "moved_matches_victim_running": kill["running"].get(kill["address"]) == len(moved),
            "all_completed": all(v["completed"] for v in views)}
