"""The soak's report: one JSON document (--json) and the same figures as a table on stdout."""
from __future__ import annotations

import collections
import json
from pathlib import Path

from tests.soak.cluster import Cluster, Instance, KvState
from tests.soak.verdict import Verdict


def _rss(inst: Instance, now: float) -> dict:
    end = inst.ended_at or now
    return {"instance": f"{inst.name}.{inst.number}", "pid": inst.server.proc.pid,
            "lived_s": round(end - inst.ready_at, 1), "ended": inst.ended_how or "running",
            "start_mb": round(inst.rss_first_kb / 1024, 1), "end_mb": round(inst.rss_last_kb / 1024, 1),
            "peak_mb": round(inst.rss_peak_kb / 1024, 1),
            "growth_mb": round((inst.rss_last_kb - inst.rss_first_kb) / 1024, 1),
            "timeline_s_mb": [[s, round(kb / 1024, 1)] for s, kb in inst.timeline]}


def build(v: Verdict, cluster: Cluster, kv: list[KvState], chaos: collections.Counter, chaos_log: list[str],
          exit_codes: dict[str, int], config: dict, load_s: float, references: int, now: float) -> dict:
    by_kind: dict[str, dict[str, int]] = collections.defaultdict(dict)
    for (label, result), n in sorted(v.by_label.items()):
        by_kind[label][result] = n
    rss = [_rss(i, now) for i in cluster.instances]
    return {
        "passed": v.passed,
        "config": config,
        "load_seconds": round(load_s, 1),
        "references": references,
        "requests": {"total": sum(v.outcomes.values()), "by_outcome": dict(v.outcomes), "by_kind": dict(by_kind),
                     "retries": v.retries, "retried_requests": v.retried_requests},
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
                "executors": [r for r in rss if not r["instance"].startswith("scheduler")]},
        "chaos": dict(chaos), "chaos_log": chaos_log,
        "outages": [{"what": o.what, "seconds": round(o.end - o.start, 2)} for o in cluster.outages],
        "crashed": v.crashed,
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
    add(f"  {'outcome':<24}{'requests':>10}")
    for name, n in sorted(req["by_outcome"].items(), key=lambda kv: -kv[1]):
        add(f"  {name:<24}{n:>10}")
    add("")
    kinds = sorted(req["by_kind"])
    outcomes = sorted({o for k in kinds for o in req["by_kind"][k]})
    add("  " + f"{'by kind':<18}" + "".join(f"{o:>19}" for o in outcomes))
    for k in kinds:
        add("  " + f"{k:<18}" + "".join(f"{req['by_kind'][k].get(o, 0):>19}" for o in outcomes))
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
    add(f"  {'RSS (MB)':<16}{'lived s':>9}{'start':>9}{'end':>9}{'peak':>9}{'growth':>9}  ended")
    for row in [*r["rss"]["scheduler"], *r["rss"]["executors"]]:
        add(f"  {row['instance']:<16}{row['lived_s']:>9.0f}{row['start_mb']:>9.1f}{row['end_mb']:>9.1f}"
            f"{row['peak_mb']:>9.1f}{row['growth_mb']:>9.1f}  {row['ended']}")
    add("")
    add("  chaos: " + (", ".join(f"{k} {n}" for k, n in sorted(r["chaos"].items())) or "none"))
    if r["outages"]:
        secs = [o["seconds"] for o in r["outages"]]
        add(f"  outages: {len(secs)}, {min(secs):.1f}-{max(secs):.1f} s each")
    add(f"  exit codes after SIGTERM: {r['exit_codes_after_sigterm']}")
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
