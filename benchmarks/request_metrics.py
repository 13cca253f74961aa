"""Streamed generation requests as a client sees them: one Record of raw timings per request, and the vLLM-style
serving metrics of a side's records (throughputs, TTFT, TPOT, ITL, end-to-end latency)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks.measure import summarize


@dataclass
class Record:
    """One request's raw timings, seconds on one perf_counter clock."""
    index: int
    prompt_len: int
    start: float = 0.0  # sent (Tandem) / its generate call began (baselines)
    end: float = 0.0
    messages: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens) of token-carrying messages
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    usage: dict[str, int] | None = None
    error: str | None = None
    tags: dict[str, Any] = field(default_factory=dict)  # e.g. a multi-turn request's conversation and turn

    @property
    def output_len(self) -> int:
        return sum(n for _, n in self.messages)

    def metrics(self) -> dict[str, Any]:
        """ttft / latency / tpot (s) and itl: one gap per token after the first (a message of k tokens counts
        k gaps of 1/k; the first message's extra tokens count as 0 gaps)."""
        out: dict[str, Any] = {"ttft": None, "latency": self.end - self.start, "tpot": None, "itl": []}
        if not self.messages:
            return out
        t_first, n_first = self.messages[0]
        out["ttft"] = t_first - self.start
        itl, prev = [0.0] * (n_first - 1), t_first
        for t, n in self.messages[1:]:
            itl += [(t - prev) / n] * n
            prev = t
        out["itl"] = itl
        if self.output_len > 1:
            out["tpot"] = (out["latency"] - out["ttft"]) / (self.output_len - 1)
        return out

    def as_json(self, t0: float) -> dict[str, Any]:
        m = self.metrics()
        ms = {k: None if m[k] is None else m[k] * 1e3 for k in ("ttft", "latency", "tpot")}
        return {"index": self.index, **self.tags, "prompt_len": self.prompt_len, "output_len": self.output_len,
                "start_s": self.start - t0, "end_s": self.end - t0, "ttft_ms": ms["ttft"],
                "latency_ms": ms["latency"], "tpot_ms": ms["tpot"],
                "message_times_s": [t - t0 for t, _ in self.messages],
                "message_tokens": [n for _, n in self.messages], "finish_reason": self.finish_reason,
                "usage": self.usage, "error": self.error, "output_ids": self.output_ids}


def exact(rec: Record, output_len: int, finish: str = "length") -> bool:
    """No error, exactly output_len tokens streamed and counted by usage, finish reason `finish`."""
    return (rec.error is None and rec.output_len == len(rec.output_ids) == output_len
            and (rec.usage or {}).get("completion_tokens") == output_len and rec.finish_reason == finish)


def aggregate(name: str, records: list[Record], duration: float | None = None, flops_per_request: float | None = None,
              output_len: int | None = None) -> dict[str, Any]:
    """vLLM-style serving metrics of one side; duration: first start to last end unless given."""
    ok = [r for r in records if r.error is None]
    sent = [r for r in records if r.start]
    t0 = min((r.start for r in sent), default=0.0)
    if duration is None:
        duration = max((r.end for r in sent), default=t0) - t0
    ms = [r.metrics() for r in ok]
    out_tokens, in_tokens = sum(r.output_len for r in ok), sum(r.prompt_len for r in ok)
    rate = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    return {
        "name": name, "requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "exact_output_len": sum(r.output_len == len(r.output_ids) == output_len for r in ok) if output_len else None,
        "duration_s": duration, "request_throughput": rate(len(ok)), "output_throughput": rate(out_tokens),
        "total_token_throughput": rate(in_tokens + out_tokens), "input_tokens": in_tokens, "output_tokens": out_tokens,
        "ttft_ms": summarize([m["ttft"] for m in ms if m["ttft"] is not None], 1e3),
        "tpot_ms": summarize([m["tpot"] for m in ms if m["tpot"] is not None], 1e3),
        "itl_ms": summarize([g for m in ms for g in m["itl"]], 1e3),
        "e2el_ms": summarize([m["latency"] for m in ms], 1e3),
        "gflops": rate(flops_per_request * len(ok) / 1e9) if flops_per_request else None,
        "per_request": [r.as_json(t0) for r in records],
    }


def agreement(a: list[Record], b: list[Record]) -> dict[str, Any] | None:
    """How many requests two sides generated identically (greedy on both: differently batched fp32 kernels
    can flip a near-tie, after which the continuations differ), and the mean common prefix."""
    by = {r.index: r for r in b}
    pairs = [(r.output_ids, by[r.index].output_ids) for r in a if r.index in by and r.error is None]
    if not pairs:
        return None
    prefixes = []
    for x, y in pairs:
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefixes.append(n)
    return {"compared": len(pairs), "identical": sum(x == y for x, y in pairs),
            "mean_common_prefix": float(np.mean(prefixes))}
