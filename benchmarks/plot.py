"""The serving benchmarks' PNG: (a) Tandem's request timeline, (b) output tokens delivered over time per side,
(c) inter-token latency histograms, (d) output-token throughput per side."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from benchmarks.request_metrics import Record


def write_plot(path: Path, sides: list[dict[str, Any]], records: dict[str, list[Record]],
               t0s: dict[str, float], title: str, log: Callable[[str], None]) -> Path | None:
    """The 4-panel PNG; None (with a warning to log) without matplotlib."""
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
