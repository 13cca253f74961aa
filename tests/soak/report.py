"""The soak's report: one JSON document (--json) and the same figures as a table on stdout."""
from __future__ import annotations

import collections
import json
from pathlib import Path

from tests.soak.cluster import Cluster, Instance, KvState
from tests.soak.verdict import Verdict


def _mid_mb(inst: Instance) -> float:
    """The RSS sample nearest the middle of the instance's life (timeline: a sample every ~30 s)."""
    if not inst.timeline:
        return round(inst.rss_last_kb / 1024, 1)
    half = inst.timeline[-1][0] / 2
    return round(min(inst.timeline, key=lambda t: abs(t[0] - half))[1] / 1024, 1)


def _rss(inst: Instance, now: float) -> dict:
    end = inst.ended_at or now
    return {"instance": f"{inst.name}.{inst.number}", "pid": inst.server.proc.pid,
            "lived_s": round(end - inst.ready_at, 1), "ended": inst.ended_how or "running",
            "start_mb": round(inst.rss_first_kb / 1024, 1), "mid_mb": _mid_mb(inst),
            "end_mb": round(inst.rss_last_kb / 1024, 1),
            "peak_mb": round(inst.rss_peak_kb / 1024, 1),
            "growth_mb": round((inst.rss_last_kb - inst.rss_first_kb) / 1024, 1),
            "timeline_s_mb": [[s, round(kb / 1024, 1)] for s, kb in inst.timeline]}


def build(v: Verdict, cluster: Cluster, kv: list[KvState], chaos: collections.Counter, chaos_log: list[str],
          exit_codes: dict[str, int], config: dict, load_s: float, references: int, now: float) -> dict:
    by_kind: dict[str, dict[str, int]] = collections.defaultdict(dict)
    for (label, result), n in sorted(v.by_label.items()):
        by_kind[label][result] = n
    rss = [_rss(i, now) for i in cluster.instances]
    cancelled = sum(v.outcomes[o] for o in ("cancelled", "disconnected"))
    slow = sum(v.outcomes[o] for o in ("slow-stopped", "slow-completed"))
    total = sum(v.outcomes.values())
    return {
        "passed": v.passed,
        "config": config,
        "load_seconds": round(load_s, 1),
        "references": references,
        "requests": {"total": total, "by_outcome": dict(v.outcomes), "by_kind": dict(by_kind),
                     "retries": v.retries, "retried_requests": v.retried_requests},
        # Every request but the planned cancels/hang-ups and the slow readers must complete with exactly the clean
        # run's answer, or be refused in a way a client retries later (adapter unloaded, a full queue):
        "completion": {"expected": total - cancelled - slow, "completed": v.outcomes["completed"],
                       "refused": v.outcomes["refused"], "adapter_not_found": v.outcomes["adapter-not-found"],
                       "equal": v.outcomes["completed"] + v.outcomes["refused"] + v.outcomes["adapter-not-found"]
                       == total - cancelled - slow},
        "slow_readers": {"stopped": v.outcomes["slow-stopped"], "completed": v.outcomes["slow-completed"]},
        "routed_errors_in_outages": dict(v.routed_errors_in_outages),
        "lost": len(v.lost), "lost_requests": v.lost[:50],
        "leaked": {"blocks": v.leaked_blocks, "caches": v.leaked_caches,
                   "per_executor": [vars(k) for k in kv]},
        "errors_by_status": dict(v.errors),
        "failures": len(v.failures), "failure_examples": v.failures[:50],
        "unavailable_outside_scheduler_outages": len(v.unavailable_outside_outages),
        "unavailable_outside_examples": v.unavailable_outside_outages[:20],
        "longest_stall_s": {"measured": round(v.stall.seconds, 3), "measured_request": v.stall.request,
                            "measured_at_s": round(v.stall.at_s, 1),
                            "outside_outages": round(v.stall_outside.seconds, 3),
                            "outside_request": v.stall_outside.request,
                            "outside_at_s": round(v.stall_outside.at_s, 1)},
        "rss": {"scheduler": [r for r in rss if r["instance"].startswith("scheduler")],
                "executors": [r for r in rss if not r["instance"].startswith(("scheduler", "smg", "vllm-router"))],
                "routers": [r for r in rss if r["instance"].startswith(("smg", "vllm-router"))]},
        "chaos": dict(chaos), "chaos_log": chaos_log,
        "outages": [{"what": o.what, "seconds": round(o.end - o.start, 2)} for o in cluster.outages],
        "crashed": v.crashed,
        "chaos_sigterm_exit_codes": getattr(cluster, "term_exits", {}),
        "tp_rank0_exit_codes_after_rank1_kill": getattr(cluster, "tp_exits", []),
        "fleet_counters": dict(getattr(cluster, "counters", {})),
        "exit_codes_after_sigterm": exit_codes,
        "tracebacks_in_logs": cluster.tracebacks(),
        "log_dir": str(cluster.cfg.log_dir),
    }


def table(r: dict) -> str:
    lines = []
    add = lines.append
    req = r["requests"]
    add(f"soak: {req['total']} requests in {r['load_seconds']:.0f} s of load "
        f"({r['references']} reference requests first); {req['retries']} retries over "
        f"{req['retried_requests']} requests")
    add("")
    c = r["completion"]
    add(f"  completed {c['completed']} of {c['expected']} expected to complete (all but planned cancels/hang-ups "
        f"and slow readers); refused {c['refused']}, adapter unloaded {c['adapter_not_found']}: "
        + ("every one accounted for" if c["equal"] else "SOME NOT ACCOUNTED FOR (lost)"))
    if sum(r["slow_readers"].values()):
        add(f"  slow readers: {r['slow_readers']['stopped']} stopped by the stall timeout, "
            f"{r['slow_readers']['completed']} whole (their answer fitted in the transport's buffers)")
    add("")
    add(f"  {'outcome':<24}{'requests':>10}")
    for name, n in sorted(req["by_outcome"].items(), key=lambda kv: -kv[1]):
        add(f"  {name:<24}{n:>10}")
    add("")
    kinds = sorted(req["by_kind"])
    outcomes = sorted({o for k in kinds for o in req["by_kind"][k]})
    add("  " + f"{'by kind':<24}" + "".join(f"{o:>19}" for o in outcomes))
    for k in kinds:
        add("  " + f"{k:<24}" + "".join(f"{req['by_kind'][k].get(o, 0):>19}" for o in outcomes))
    add("")
    add(f"  {'errors by status':<40}{'attempts':>10}")
    for label, n in sorted(r["errors_by_status"].items(), key=lambda kv: -kv[1]) or [("(none)", 0)]:
        add(f"  {label:<40}{n:>10}")
    add("")
    stall = r["longest_stall_s"]
    add(f"  longest stall: {stall['measured']:.2f} s measured ({stall['measured_request']} at "
        f"+{stall['measured_at_s']:.0f} s); {stall['outside_outages']:.2f} s outside outages "
        f"({stall['outside_request']} at +{stall['outside_at_s']:.0f} s)")
    add(f"  UNAVAILABLE outside scheduler outages: {r['unavailable_outside_scheduler_outages']} attempts")
    add("")
    if r["routed_errors_in_outages"]:
        add(f"  router 5xx / stream errors within an outage (re-sent, not failures): {r['routed_errors_in_outages']}")
    add("")
    add(f"  {'RSS (MB)':<18}{'lived s':>9}{'start':>9}{'mid':>9}{'end':>9}{'peak':>9}{'growth':>9}  ended")
    for row in [*r["rss"]["scheduler"], *r["rss"]["executors"], *r["rss"]["routers"]]:
        add(f"  {row['instance']:<18}{row['lived_s']:>9.0f}{row['start_mb']:>9.1f}{row['mid_mb']:>9.1f}"
            f"{row['end_mb']:>9.1f}{row['peak_mb']:>9.1f}{row['growth_mb']:>9.1f}  {row['ended']}")
    add("")
    add("  chaos: " + (", ".join(f"{k} {n}" for k, n in sorted(r["chaos"].items())) or "none"))
    if r["outages"]:
        secs = [o["seconds"] for o in r["outages"]]
        add(f"  outages: {len(secs)}, {min(secs):.1f}-{max(secs):.1f} s each")
    add(f"  exit codes after SIGTERM: {r['exit_codes_after_sigterm']}")
    if r["chaos_sigterm_exit_codes"]:
        add(f"  exit codes after chaos SIGTERMs: {r['chaos_sigterm_exit_codes']}")
    if r["fleet_counters"]:
        add("  the fleet's counters (summed over instances): "
            + ", ".join(f"{k} {v:g}" for k, v in sorted(r["fleet_counters"].items())))
    if r["tp_rank0_exit_codes_after_rank1_kill"]:
        add(f"  TP rank 0 exit codes after its rank 1 was SIGKILLed: {r['tp_rank0_exit_codes_after_rank1_kill']}")
    if r["tracebacks_in_logs"]:
        add(f"  tracebacks in logs: {r['tracebacks_in_logs']} (logs in {r['log_dir']})")
    add("")
    leaked = r["leaked"]
    add(f"  LOST requests: {r['lost']}    LEAKED KV: {leaked['blocks']} blocks, {leaked['caches']} caches    "
        f"500/UNKNOWN/INTERNAL: {r['failures']}" + (f"    CRASHED: {r['crashed']}" if r["crashed"] else ""))
    for item in r["lost_requests"][:10]:
        add(f"    lost: {item}")
    for item in r["failure_examples"][:10]:
        add(f"    failure: {item}")
    add(f"  {'PASSED' if r['passed'] else 'FAILED'}")
    return "\n".join(lines)


def write_json(r: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(r, indent=2, default=str) + "\n", encoding="utf-8")
