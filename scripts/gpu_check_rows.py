"""The table rows of one scripts/gpu_check stage, from that stage's JSON: `gpu_check_rows.py device FILE` (the
device figures of benchmarks/device_figures.py) or `gpu_check_rows.py serving FILE` (benchmarks/serving.py).
Rows are '  what  figure' lines under the stage's own row; the targets are docs/cuda.md's."""
from __future__ import annotations

import json
import sys
from typing import Any

BATCH64_TARGET = 20_000  # output tok/s of batch-64 decode steps on the 135M shape (docs/cuda.md)
BATCH1_SHARE = 0.5  # of the memory-bandwidth limit at batch 1 (docs/cuda.md)


def line(what: str, figure: str) -> str:
    return f"  {what:<32} {'':<10} {figure}"


def device_rows(r: dict[str, Any]) -> list[str]:
    """The figures a run wrote, also a partial one (a stage killed at its limit: what it had measured)."""
    limit, gib = r["batch1_limit_tok_s"], 2 ** 30
    backend = next((run["attention_backend"] for run in r["runs"] if "attention_backend" in run), "?")
    rows = [line("attention backend", f"{backend} ran (auto here: {r['attention_note']})"),
            line("bandwidth limit, batch 1", f"{limit:,.0f} tok/s ({r['bandwidth_Bps'] / 1e9:,.0f} GB/s / "
                                             f"{r['step_bytes'] / 1e9:.3f} GB of weights per step)")]
    for run in r["runs"]:
        graphs = "" if run.get("graphs", "n/a") == "n/a" else f", graphs {run['graphs']}"
        if "error" in run or "decode" not in run:
            rows.append(line(f"executor{graphs}", f"FAILED: {run.get('error', 'killed before its decode rows')}"))
            continue
        for batch, v in run["decode"].items():
            note = f"{v['tok_s'] / limit:.0%} of the limit" if batch == "1" else ""
            if batch == "64" and r["config"].get("shape_name") == "smollm2-135m" and run["graphs"] != "n/a":
                note = f"target >= {BATCH64_TARGET:,}: {'ok' if v['tok_s'] >= BATCH64_TARGET else 'BELOW'}"
            elif batch == "1" and run["graphs"] != "n/a":
                note += f", target >= {BATCH1_SHARE:.0%}: {'ok' if v['tok_s'] >= BATCH1_SHARE * limit else 'BELOW'}"
            rows.append(line(f"decode batch {batch}{graphs}",
                             f"{v['tok_s']:,.0f} tok/s ({v['step_ms']:.2f} ms/step){'; ' + note if note else ''}"))
        capture = f", capture {run['capture_s']:.1f} s" if run.get("capture_s") is not None else ""
        rows.append(line(f"ready / memory{graphs}", f"built in {run['build_s']:.1f} s{capture}; peak "
                     f"{'GPU memory' if r['device_name'] != 'CPU' else 'RSS'} {run['peak_memory_bytes'] / gib:.2f} GiB"))
    for n, v in next((run["prefill"] for run in r["runs"] if run.get("prefill")), {}).items():
        rows.append(line(f"prefill {n} tokens", f"{v['tok_s']:,.0f} tok/s ({v['s'] * 1e3:.1f} ms; first call "
                                                f"{v['first_s']:.1f} s)"))
    return rows


def serving_rows(r: dict[str, Any]) -> list[str]:
    t, c = r["sides"]["tandem"], r["config"]
    return [line(f"{c['num_requests']} x ({c['input_len']} in, {c['output_len']} out)",
                 f"{t['output_throughput']:,.0f} output tok/s, {t['request_throughput']:.1f} req/s, "
                 f"{c['concurrency']} in flight"),
            line("TTFT / ITL p50 (p99)", f"{t['ttft_ms']['p50']:.1f} ({t['ttft_ms']['p99']:.1f}) ms / "
                                         f"{t['itl_ms']['p50']:.2f} ({t['itl_ms']['p99']:.2f}) ms")]


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("device", "serving"):
        print("usage: gpu_check_rows.py device|serving FILE.json", file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as f:
        result = json.load(f)
    print("\n".join(device_rows(result) if argv[0] == "device" else serving_rows(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
