"""The prefix-caching benchmark's numbers: per run (workload x mode) the serving metrics, the prefix-cache
counts (tokens sent, cached, computed; hit rate), the on/off comparisons against the issue's targets, the
tables and the JSON payload."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from benchmarks.measure import summarize
from benchmarks.prefix_client import TimedRun, TurnRecord
from benchmarks.report import format_table
from benchmarks.request_metrics import Record, aggregate
from benchmarks.serving_tandem import executor_delta

LATE_TURN = 3  # multi-turn: TTFT is compared over the turns from this one on (the "turns >= 3")


def counter_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """after - before of every counter (gauges such as cached blocks give their change; flags: their value
    after)."""
    if before is None or after is None:
        return None
    return {k: v if isinstance(v, bool) else v - before.get(k, 0) for k, v in after.items()}


def hit_query_names(counters: dict[str, Any]) -> tuple[str | None, str | None]:
    """The executor's prefix-cache hit-token and query-token counters, found by name (`*hit*token*`,
    `*quer*token*`) so that the benchmark reads them whatever their final names."""
    hit = next((k for k in counters if "hit" in k and "token" in k), None)
    query = next((k for k in counters if "quer" in k and "token" in k), None)
    return hit, query


def prefix_stats(records: list[Record], before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Prompt tokens sent / cached / computed over the requests that completed, from each response's usage
    (computed = sent - usage.cached_tokens), the executor's own prefix-cache counters when it has them, and the
    executor's tokens processed minus the decode tokens (output - 1 per request): the prompt tokens it ran,
    recomputation after a preemption included."""
    ok = [r for r in records if r.error is None]
    sent = sum(r.prompt_len for r in ok)
    cached = sum((r.usage or {}).get("cached_tokens", 0) for r in ok)
    ex = counter_delta(before["prefix_cache"], after["prefix_cache"])
    hit_key, query_key = hit_query_names(ex or {})
    ex_rate = ex[hit_key] / ex[query_key] if hit_key and query_key and ex[query_key] else None
    processed = after["tokens_processed"] - before["tokens_processed"]
    decode = sum(max(r.output_len - 1, 0) for r in ok)
    return {
        "prompt_tokens_sent": sent,
        "usage_prompt_tokens": sum((r.usage or {}).get("prompt_tokens", 0) for r in ok),
        "cached_tokens": cached,
        "prompt_tokens_computed": sent - cached,
        "computed_fraction": (sent - cached) / sent if sent else None,
        "usage_hit_rate": cached / sent if sent else None,
        "executor_prefix_cache": ex, "executor_hit_rate": ex_rate,
        "executor_prefix_caching": (ex or {}).get("enabled"),  # None: the executor does not say
        "hit_rate": ex_rate if ex_rate is not None else (cached / sent if sent else None),
        "hit_rate_source": "executor" if ex_rate is not None else "usage",
        "executor_tokens_processed": processed,
        "executor_prompt_tokens_processed": processed - decode,
        "preemptions": sum((r.usage or {}).get("preemptions", 0) for r in ok),
    }


def summarize_run(workload: str, mode: str, run: TimedRun, output_len: int) -> dict[str, Any]:
    """aggregate()'s serving metrics + prefix_stats + (multi-turn) the TTFT of turns >= LATE_TURN."""
    side = aggregate(f"{workload}/{mode}", run.records, run.t0, run.duration, None, None, output_len)
    side.update(workload=workload, mode=mode, cpu=run.cpu, model_info=run.model_info,
                prefix=prefix_stats(run.records, run.executor_before, run.executor_after),
                executor={"before": run.executor_before, "after": run.executor_after},
                executor_work=executor_delta(run.executor_before, run.executor_after, run.duration))
    late = [r.metrics()["ttft"] for r in run.records
            if isinstance(r, TurnRecord) and r.turn >= LATE_TURN and r.error is None and r.messages]
    side["ttft_late_turns_ms"] = summarize(late, 1e3) if workload == "multi-turn" else None
    return side


def bad_records(records: list[Record], output_len: int) -> list[Record]:
    """Requests that failed or did not produce exactly output_len tokens (finish LENGTH, usage agreeing)."""
    return [r for r in records if r.error or r.output_len != output_len or len(r.output_ids) != output_len
            or (r.usage or {}).get("completion_tokens") != output_len or r.finish_reason != "FINISH_REASON_LENGTH"]


@dataclass(frozen=True)
class Target:
    """One of the issue's targets: `how` is "off/on" (the cache lowers the value), "on/off" (it raises it) or
    "on" (the cache-on value alone, at most `target`)."""
    workload: str
    metric: str
    value: Callable[[dict[str, Any]], float | None]
    how: str
    target: float


TARGETS = [
    Target("system-prompt", "mean TTFT ms", lambda s: s["ttft_ms"]["mean"], "off/on", 4.0),
    Target("system-prompt", "request throughput req/s", lambda s: s["request_throughput"], "on/off", 2.0),
    Target("multi-turn", "prompt tokens computed / sent", lambda s: s["prefix"]["computed_fraction"], "on", 0.25),
    Target("multi-turn", f"mean TTFT ms, turns >= {LATE_TURN}",
           lambda s: (s["ttft_late_turns_ms"] or {}).get("mean"), "off/on", 3.0),
]


def compare(runs: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per target whose workload ran: both modes' values, the ratio (or the on value) and met / not
    met (None when a mode it needs did not run)."""
    rows = []
    for t in TARGETS:
        if t.workload not in runs:
            continue
        on, off = (t.value(runs[t.workload][m]) if m in runs[t.workload] else None for m in ("on", "off"))
        if t.how == "on":
            result = on
            met = None if on is None else on <= t.target
        else:
            num, den = (off, on) if t.how == "off/on" else (on, off)
            result = num / den if num is not None and den else None
            met = None if result is None else result >= t.target
        rows.append({"workload": t.workload, "metric": t.metric, "off": off, "on": on, "how": t.how,
                     "result": result, "target": t.target, "met": met,
                     "target_text": f"<= {t.target:g}" if t.how == "on" else f">= {t.target:g}x ({t.how})"})
    return rows


RUN_COLUMNS = [("workload", "workload"), ("mode", "cache"), ("completed", "done"), ("exact_output_len", "exact len"),
               ("duration_s", "duration s"), ("request_throughput", "req/s", 3), ("output_throughput", "out tok/s", 1),
               ("total_token_throughput", "total tok/s", 1), ("hit_rate", "hit rate", 3), ("sent", "prompt sent"),
               ("computed", "computed"), ("computed_pct", "computed %", 1), ("processed", "executor prompt"),
               ("cores", "cores"), ("other_cores", "other cores")]
LATENCY_COLUMNS = [("workload", "workload"), ("mode", "cache")] + [
    (f"{m}_{s}", f"{label} {s}", 1) for m, label, stats in (
        ("ttft", "TTFT", ("mean", "p50", "p99")), ("tpot", "TPOT", ("mean", "p50", "p99")),
        ("late", f"TTFT t>={LATE_TURN}", ("mean", "p50", "p99")), ("e2el", "E2EL", ("mean", "p99")))
    for s in stats]
COMPARE_COLUMNS = [("workload", "workload"), ("metric", "metric"), ("off", "cache off", 3), ("on", "cache on", 3),
                   ("result", "ratio / value", 3), ("target_text", "target"), ("met_text", "met")]


def run_row(s: dict[str, Any]) -> dict[str, Any]:
    p, cores = s["prefix"], s["cpu"]["cores"]
    row = {k: s.get(k) for k, *_ in RUN_COLUMNS}
    row.update(hit_rate=p["hit_rate"], sent=p["prompt_tokens_sent"], computed=p["prompt_tokens_computed"],
               computed_pct=None if p["computed_fraction"] is None else 100 * p["computed_fraction"],
               processed=p["executor_prompt_tokens_processed"], other_cores=s["cpu"]["other_cores"],
               cores="/".join(f"{cores[k]:.2f}" for k in ("executor", "scheduler", "client")
                              if cores.get(k) is not None))
    for m, key in (("ttft", "ttft_ms"), ("tpot", "tpot_ms"), ("late", "ttft_late_turns_ms"), ("e2el", "e2el_ms")):
        for stat in ("mean", "p50", "p99"):
            row[f"{m}_{stat}"] = (s[key] or {}).get(stat)
    return row


def print_report(header: str, workload_lines: list[str], runs: dict[str, dict[str, dict[str, Any]]],
                 comparisons: list[dict[str, Any]], agreement: dict[str, Any], bad: int) -> None:
    print(header)
    for line in workload_lines:
        print(line)
    print()
    rows = [run_row(s) for modes in runs.values() for s in modes.values()]
    print(format_table(rows, RUN_COLUMNS))
    print("\nhit rate: prefix-cache hit tokens / query tokens (the executor's GetMetrics; without them, "
          "usage.cached_tokens / prompt tokens); computed = prompt sent - usage.cached_tokens;\nexecutor prompt: "
          "tokens the executor processed minus the decode tokens (recomputation after a preemption included); "
          "cores: executor/scheduler/client CPU s per wall s; other cores: the rest of the machine.\n")
    print(format_table(rows, LATENCY_COLUMNS))
    print(f"\nms; TTFT = first token, TPOT = (E2E - TTFT) / (tokens - 1) per request, TTFT t>={LATE_TURN}: "
          f"multi-turn turns {LATE_TURN}.., E2EL = end-to-end latency.\n")
    if comparisons:
        print(format_table([{**c, "met_text": {True: "met", False: "NOT met", None: "-"}[c["met"]]}
                            for c in comparisons], COMPARE_COLUMNS))
        print()
    for modes in runs.values():
        for s in modes.values():
            work = s["executor_work"]
            op = work["ops"].get("unified_decode")
            if op:
                print(f"{s['name']}: executor {op['calls']} steps, {op['mean_ms']:.1f} ms of model work per step, busy "
                      f"{100 * op['busy_share']:.0f}% of the run; {work['tokens_processed']} tokens processed")
    for workload, agree in agreement.items():
        if agree:
            print(f"{workload}: {agree['identical']}/{agree['compared']} requests generated the same tokens with the "
                  f"cache on and off (mean common prefix {agree['mean_common_prefix']:.1f})")
    if any((s["cpu"].get("other_cores") or 0) > 0.2 for modes in runs.values() for s in modes.values()):
        print("note: other processes used > 0.2 cores during a run (other cores column): timings are noisy")
    if bad:
        print(f"ERROR: {bad} requests failed or did not produce exactly the output length (see stderr)")
