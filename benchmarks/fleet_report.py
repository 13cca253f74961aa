"""The fleet benchmark's output: the scaling table (each configuration, then its ratios to the first), the
failover tables (the groups of streams, each stream, the clean and failover runs side by side) and the JSON."""
from __future__ import annotations

from typing import Any

from benchmarks.fleet_failover import completed
from benchmarks.report import format_table
from benchmarks.request_metrics import aggregate

# (key, header, decimals); the ratio row divides each of these by the first configuration's
METRICS = [("request_throughput", "req/s", 3), ("output_throughput", "out tok/s", 1),
           ("ttft_p50", "TTFT p50 ms", 0), ("ttft_p99", "TTFT p99 ms", 0),
           ("tpot_p50", "TPOT p50 ms", 1), ("tpot_p99", "TPOT p99 ms", 1)]
SCALING_COLUMNS = ([("name", "config"), ("shape", "executors x threads"), ("completed", "done"),
                    ("duration_s", "duration s")] + METRICS
                   + [("requests_each", "requests each"), ("busy", "busy %"), ("cores", "cores"),
                      ("other_cores", "other cores")])
GROUP_COLUMNS = [("group", "streams"), ("streams", "n"), ("paused", "paused"), ("completed", "completed"),
                 ("gap", "largest gap after kill p50 / max ms"), ("next", "kill->next token p50 / max ms"),
                 ("resume", "kill->resume p50 / max ms"), ("before", "tokens before kill"),
                 ("recomputed", "tokens recomputed")]
STREAM_COLUMNS = [("index", "stream"), ("moved", "moved"), ("tokens_before_kill", "tokens before kill"),
                  ("median_gap_before_kill_ms", "gap before ms", 0), ("next_token_after_kill_ms", "kill->next ms", 0),
                  ("pause_ms", "largest gap after kill ms", 0), ("max_gap_ms", "largest gap ms", 0),
                  ("resume_after_kill_ms", "kill->resume ms", 0),
                  ("recomputed_tokens", "recomputed"), ("completed", "completed"), ("identical_to_clean", "= clean")]
RUN_COLUMNS = [("name", "run"), ("completed", "done"), ("duration_s", "duration s"),
               ("output_throughput", "out tok/s", 2), ("ttft_p50", "TTFT p50 ms", 0), ("tpot_p50", "TPOT p50 ms", 1),
               ("tpot_p99", "TPOT p99 ms", 1), ("e2el_p99", "E2EL p99 ms", 0), ("other_cores", "other cores")]


def flat(side: dict[str, Any]) -> dict[str, Any]:
    """A side's headline numbers, flat (ttft_p50, tpot_p99, ...)."""
    out = {k: side[k] for k in ("name", "completed", "duration_s", "request_throughput", "output_throughput")}
    for metric in ("ttft", "tpot", "e2el"):
        for stat in ("p50", "p99"):
            out[f"{metric}_{stat}"] = side[f"{metric}_ms"][stat]
    return out


def scaling_payload(sides: dict[str, dict[str, Any]], output_len: int) -> dict[str, Any]:
    """The JSON `scaling` entry: every configuration and its ratios to the first (value / first's value)."""
    names = list(sides)
    base = flat(sides[names[0]])
    ratios = {}
    for name in names[1:]:
        row = flat(sides[name])
        ratios[name] = {k: (row[k] / base[k] if row[k] is not None and base[k] else None) for k, *_ in METRICS}
        ratios[name]["duration_s"] = row["duration_s"] / base["duration_s"]
        ratios[name]["baseline"] = names[0]
    exact = all(s["failed"] == 0 and s["exact_output_len"] == s["requests"] for s in sides.values())
    return {"runs": sides, "ratios": ratios, "all_exact_output_len": exact, "output_len": output_len}


def _scaling_row(side: dict[str, Any]) -> dict[str, Any]:
    row = flat(side)
    work = side["executor_work"]
    cores = side["cpu"]["cores"]
    ex = [cores.get(f"executor-{i}") for i in range(side["executors"])]
    row.update(shape=f"{side['executors']} x {side['threads']}",
               requests_each="/".join(str(w["requests"]) for w in work),
               busy="/".join(f"{100 * w['busy_share']:.0f}" for w in work if w["busy_share"] is not None),
               cores="+".join(f"{c:.2f}" for c in ex if c is not None)
               + "".join(f" / {cores[k]:.2f}" for k in ("scheduler", "client") if cores.get(k) is not None),
               other_cores=side["cpu"]["other_cores"])
    return row


def print_scaling(header: str, args, scaling: dict[str, Any]) -> None:
    print(header)
    print(f"scaling: {args.num_requests} requests x ({args.input_len} prompt, {args.output_len} output tokens), "
          f"closed loop, {args.concurrency} in flight, seed {args.seed}; one scheduler per configuration\n")
    rows = [_scaling_row(s) for s in scaling["runs"].values()]
    print(format_table(rows, SCALING_COLUMNS))
    ratios = [{"name": f"{name} / {r['baseline']}", **r} for name, r in scaling["ratios"].items()]
    if ratios:
        print()
        columns = [("name", "ratio"), ("duration_s", "duration")] + [(k, h, 2) for k, h, _ in METRICS]
        print(format_table(ratios, columns))
    print("\nratio: the configuration's value / the first's (throughput: > 1 is better; TTFT, TPOT: < 1 is "
          "better). requests each: requests routed to each executor (caches created); busy %: share of the run "
          "each executor's model was busy; cores: executors / scheduler / client, CPU s per wall s; other cores: "
          "the rest of the machine meanwhile.")
    if any((r.get("other_cores") or 0) > 0.2 for r in rows):
        print("note: other processes used > 0.2 cores during a run (other cores column): timings are disturbed")
    if not scaling["all_exact_output_len"]:
        print("ERROR: a scaling request failed or did not produce exactly its length (see stderr)")
    print()


def failover_payload(args, clean: Any, run: Any, view: dict[str, Any] | None, agree: dict[str, Any] | None,
                     clean_servers: dict[str, Any], servers: dict[str, Any]) -> dict[str, Any]:
    """The JSON `failover` entry."""
    n, out_len = args.failover_streams, args.failover_output_len
    sides = {}
    for name, r, srv in (("clean", clean, clean_servers), ("failover", run, servers)):
        sides[name] = aggregate(name, r.records, r.t0, r.duration, None, None, out_len)
        sides[name].update(servers=srv, cpu=r.cpu, other_cores=r.cpu.get("other_cores"))
    kill = None
    if run.kill:
        kill = {k: v for k, v in run.kill.items() if k not in ("t", "victim_counters")}
        kill["at_s"] = run.kill["t"] - run.t0  # from the first stream's start
    by_index = {r.index: r.output_ids for r in clean.records}
    streams = []
    for v in (view or {}).get("streams", []):
        rec = run.records[v["index"]]
        streams.append({**v, "identical_to_clean": rec.output_ids == by_index.get(v["index"])})
    summary = {k: v for k, v in (view or {}).items() if k != "streams"}
    return {
        "executors": args.failover_executors, "threads": args.failover_threads, "streams": n,
        "input_len": args.failover_input_len, "output_len": out_len, "kill_after_tokens": args.kill_after_tokens,
        "killed": kill is not None, "kill": kill, "summary": summary, "per_stream": streams,
        "all_completed": all(completed(r, out_len) for r in run.records),
        "clean_all_completed": all(completed(r, out_len) for r in clean.records),
        "agreement_with_clean": agree,
        "identical_to_clean": bool(agree) and agree["identical"] == agree["compared"] == n,
        "executor_states_after": run.states_after,
        "ratios": {"duration_s": run.duration / clean.duration,
                   "output_throughput": sides["failover"]["output_throughput"] / sides["clean"]["output_throughput"]},
        "runs": sides,
    }


def _dist(d: dict[str, Any]) -> str:
    return "-" if not d or d["n"] == 0 else f"{d['p50']:.0f} / {d['max']:.0f}"


def print_failover(header: str, args, f: dict[str, Any]) -> None:
    print(header)
    print(f"failover: {f['streams']} streams x ({f['input_len']} prompt, {f['output_len']} output tokens), all at "
          f"once, {f['executors']} executors x {f['threads']} thread(s); SIGKILL once every stream had "
          f"{f['kill_after_tokens']} tokens; seed {args.seed}\n")
    if not f["killed"]:
        print("ERROR: no kill happened (every stream ended first): nothing was measured\n")
        return
    k, s = f["kill"], f["summary"]
    print(f"killed executor-{k['index']} ({k['address']}) {k['at_s']:.2f}s after the first stream started; "
          f"running per executor then (GetModelInfo): {k['running']}; streams already finished: "
          f"{k['streams_finished_before']}; tokens streamed by then: {k['tokens_streamed_before']}\n")
    rows = []
    for name in ("moved", "stayed"):
        g = s[name]
        rows.append({"group": name, "streams": g["streams"], "paused": g["paused"], "completed": g["completed"],
                     "gap": _dist(g["pause_ms"]), "next": _dist(g["next_token_after_kill_ms"]),
                     "resume": _dist(g["resume_after_kill_ms"]), "before": g["tokens_before_kill"],
                     "recomputed": g["recomputed_tokens"]})
    print(format_table(rows, GROUP_COLUMNS))
    print(f"\nmoved: the stream's usage counts a preemption (its executor was lost); kill->resume: to the first "
          f"token computed after the move; paused: largest gap after the kill >= 5x the stream's median gap "
          f"before it (largest gap, per stream below: over the whole stream, the wait after the first token "
          f"included).\ntokens recomputed: {s['recomputed_tokens']} (prompts {s['recomputed_prompt_tokens']} + "
          f"generated {s['recomputed_tokens'] - s['recomputed_prompt_tokens']}); the executors processed "
          f"{s['executor_extra_tokens']} tokens beyond a clean run (expected {s['expected_executor_extra_tokens']} "
          f"= recomputed - moved streams, the step lost with the executor aside).\n"
          f"moved streams = requests the victim ran at the kill: {s['moved_matches_victim_running']} "
          f"({s['moved']['streams']} vs {s['victim_running_at_kill']})\n")
    print(format_table(f["per_stream"], STREAM_COLUMNS))
    runs = [{**flat(f["runs"][k]), "other_cores": f["runs"][k]["other_cores"]} for k in ("clean", "failover")]
    runs.append({"name": "failover / clean", "duration_s": f["ratios"]["duration_s"],
                 "output_throughput": f["ratios"]["output_throughput"]})
    print()
    print(format_table(runs, RUN_COLUMNS))
    if any((r.get("other_cores") or 0) > 0.2 for r in runs):
        print("note: other processes used > 0.2 cores during a run (other cores column): timings are disturbed")
    agree = f["agreement_with_clean"] or {"identical": 0, "compared": 0, "mean_common_prefix": 0.0}
    states = ", ".join(f"{e.get('address')} {e.get('state', '?').removeprefix('STATE_')}"
                       for e in f["executor_states_after"])
    print(f"\nevery stream completed with no error and exactly {f['output_len']} tokens: "
          f"{'yes' if f['all_completed'] else 'NO'}; tokens identical to the clean run (greedy): "
          f"{agree['identical']}/{agree['compared']} (mean common prefix {agree['mean_common_prefix']:.1f}); "
          f"executors after: {states}\n")
