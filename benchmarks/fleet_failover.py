"""What a client saw of a failover: per stream, the pause around the SIGKILL and the tokens the scheduler had to
recompute; per group (streams moved off the killed executor, streams that stayed), their summaries; and the
executors' own count of the extra work, as a cross-check.

A stream was *moved* when its final usage counts a preemption (`usage.preemptions`: times its cache was lost
and recomputed — an executor's loss counts one; the benchmark sizes every KV pool for the whole batch, so no
capacity preemption muddles it). Its *resume* is the message that ends its largest gap after the kill: the
first token computed on the executor it moved to (the first message after the kill may be a token sampled just
before it, still on its way). Every token streamed before the resume is one the scheduler held when it requeued
the request, so the moved request recomputes prompt + those tokens. A stream *paused* when its largest gap
(`pause_ms`) after the kill is at least PAUSE_FACTOR times its median gap before it (streams that stayed can
pause too: the survivor's step that recomputes the moved prompts is long).
"""
from __future__ import annotations

import itertools
import statistics
from typing import Any

from benchmarks.measure import summarize
from benchmarks.request_metrics import Record

PAUSE_FACTOR = 5.0


def completed(rec: Record, output_len: int) -> bool:
    """No error, exactly output_len tokens streamed and counted, finish LENGTH (greedy, ignore_eos)."""
    return (rec.error is None and rec.output_len == len(rec.output_ids) == output_len
            and (rec.usage or {}).get("completion_tokens") == output_len
            and rec.finish_reason == "FINISH_REASON_LENGTH")


def stream_view(rec: Record, t_kill: float, output_len: int) -> dict[str, Any]:
    """One stream around the kill at t_kill (perf_counter); times in ms."""
    times = [t for t, _ in rec.messages]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    before_gaps = [g for g, t in zip(gaps, times[1:]) if t < t_kill]
    after = [i for i, t in enumerate(times) if t >= t_kill]
    out: dict[str, Any] = {
        "index": rec.index, "prompt_len": rec.prompt_len,
        "preemptions": (rec.usage or {}).get("preemptions"),
        "tokens_before_kill": sum(n for t, n in rec.messages if t < t_kill),
        "max_gap_ms": max(gaps) * 1e3 if gaps else None,
        "median_gap_before_kill_ms": statistics.median(before_gaps) * 1e3 if before_gaps else None,
        "next_token_after_kill_ms": (times[after[0]] - t_kill) * 1e3 if after else None,
        "resume_after_kill_ms": None, "pause_ms": None, "tokens_before_resume": None,
        "completed": completed(rec, output_len), "error": rec.error,
    }
    out["moved"] = None if out["preemptions"] is None else out["preemptions"] > 0
    if after:
        resume = max(after, key=lambda i: times[i] - (times[i - 1] if i > 0 else rec.start))
        out["pause_ms"] = (times[resume] - (times[resume - 1] if resume > 0 else rec.start)) * 1e3
        if out["moved"]:  # a stream that stayed has no resume: its largest gap is a slow step, not a move
            out["resume_after_kill_ms"] = (times[resume] - t_kill) * 1e3
            out["tokens_before_resume"] = sum(n for _, n in rec.messages[:resume])
    out["paused"] = (out["pause_ms"] is not None and out["median_gap_before_kill_ms"] is not None
                     and out["pause_ms"] >= PAUSE_FACTOR * out["median_gap_before_kill_ms"])
    out["recomputed_tokens"] = (rec.prompt_len + out["tokens_before_resume"]
                                if out["moved"] and out["tokens_before_resume"] is not None else 0)
    return out


def group_summary(views: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts and ms distributions of a group of stream_view()s."""
    def dist(key: str) -> dict[str, Any]:
        return summarize([v[key] for v in views if v[key] is not None])

    return {"streams": len(views), "paused": sum(v["paused"] for v in views),
            "completed": sum(v["completed"] for v in views), "errors": sum(v["error"] is not None for v in views),
            "tokens_before_kill": sum(v["tokens_before_kill"] for v in views),
            "recomputed_tokens": sum(v["recomputed_tokens"] for v in views),
            "max_gap_ms": dist("max_gap_ms"), "pause_ms": dist("pause_ms"),
            "next_token_after_kill_ms": dist("next_token_after_kill_ms"),
            "resume_after_kill_ms": dist("resume_after_kill_ms"),
            "median_gap_before_kill_ms": dist("median_gap_before_kill_ms")}


def executor_extra_tokens(run: Any, output_len: int) -> int | None:
    """Tokens the executors processed beyond a clean run's (prompt + output - 1 per stream): the killed one's
    counters just before the kill plus the survivors' whole run. It is the moved streams' work lost with the
    killed executor, i.e. sum(prompt + tokens before resume - 1) over them, give or take a step finished between
    the victim's snapshot and the kill. None without a kill or without every counter."""
    if run.kill is None or any(a is None for i, a in enumerate(run.after) if i != run.kill["index"]):
        return None
    victim = run.kill["index"]
    done = run.kill["victim_counters"]["tokens_processed"] - run.before[victim]["tokens_processed"]
    done += sum(a["tokens_processed"] - b["tokens_processed"]
                for i, (b, a) in enumerate(zip(run.before, run.after)) if i != victim)
    return done - sum(r.prompt_len + output_len - 1 for r in run.records)


def analyse(run: Any, output_len: int) -> dict[str, Any]:
    """The failover run (fleet_client.FailoverRun with a kill): per-stream views, the moved / stayed groups and
    the totals the report prints."""
    t_kill = run.kill["t"]
    views = [stream_view(r, t_kill, output_len) for r in run.records]
    moved = [v for v in views if v["moved"]]
    stayed = [v for v in views if v["moved"] is False]
    recomputed = sum(v["recomputed_tokens"] for v in moved)
    victim_running = run.kill["running"].get(run.kill["address"])
    return {
        "streams": views,
        "moved": group_summary(moved), "stayed": group_summary(stayed),
        "unknown": sum(v["moved"] is None for v in views),  # no usage (an error): cannot tell
        "paused": sum(v["paused"] for v in views),
        "recomputed_tokens": recomputed,
        "recomputed_prompt_tokens": sum(v["prompt_len"] for v in moved),
        "executor_extra_tokens": executor_extra_tokens(run, output_len),
        "expected_executor_extra_tokens": recomputed - len(moved),
        "victim_running_at_kill": victim_running,
        "moved_matches_victim_running": victim_running == len(moved),
        "all_completed": all(v["completed"] for v in views),
    }
