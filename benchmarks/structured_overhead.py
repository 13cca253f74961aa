"""Step-time overhead of constrained decoding through real executor + scheduler processes.

One executor and one scheduler (with its HTTP front, for /metrics) serve every run. Per batch size B, B chat
requests are sent at once, greedy, each producing exactly --output-len tokens (min_new_tokens holds EOS off in
both modes), in two modes: `plain` (no constraint) and `constrained` (OVERHEAD_GRAMMAR: JSON objects one per
line, never complete, so the batch stays full and every step masks every row). The modes alternate
(plain, constrained, constrained, plain, ... for --repeats pairs) to spread the machine's drift over both.

Per run: the time per output token of each request (TPOT: from its first to its last token, / (tokens - 1)),
averaged; with the whole batch in lockstep that is the step time. The overhead is constrained TPOT / plain
TPOT - 1 (the issue's target: <= 10 % at batch 32). From the scheduler's /metrics (deltas over the run): masks
computed, the mask thread's time (per step and per request) and the time the scheduling loop waited for masks
before sending a step (what the overlap did not hide). And the executor's side, apart: the sampler on random
logits with and without a mask on every row, in this process (what applying the masks adds to a step).
"""
from __future__ import annotations

import concurrent.futures as cf
import re
import statistics
import time
import urllib.request
from typing import Any

import grpc

from benchmarks.structured_workloads import OVERHEAD_GRAMMAR, OVERHEAD_QUESTION
from tandem.generate.v1 import generate_pb2 as pb
from tandem.generate.v1 import generate_pb2_grpc as pb_grpc

_METRICS = ("tandem:scheduler_token_masks_total", "tandem:scheduler_token_mask_seconds_total",
            "tandem:scheduler_token_mask_wait_seconds_total", "tandem:scheduler_steps_total")


def scrape(http_url: str) -> dict[str, float]:
    """The scheduler's mask and step counters (summed over executors)."""
    text = urllib.request.urlopen(f"{http_url}/metrics", timeout=30).read().decode()
    out = dict.fromkeys(_METRICS, 0.0)
    for line in text.splitlines():
        m = re.match(r"^([a-z_:]+)(?:\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m and m.group(1) in out:
            out[m.group(1)] += float(m.group(2))
    return out


def _request(i: int, constrained: bool, output_len: int) -> pb.GenerateRequest:
    question = f"{OVERHEAD_QUESTION} (list {i})"
    return pb.GenerateRequest(
        messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=question)]),
        stopping=pb.StoppingCriteria(max_new_tokens=output_len, min_new_tokens=output_len),
        constraint=pb.Constraint(grammar=OVERHEAD_GRAMMAR) if constrained else None)


def _stream(stub, request: pb.GenerateRequest, timeout: float) -> tuple[int, float, float]:
    """(tokens, time of the first token, time of the last)."""
    n, first, last = 0, 0.0, 0.0
    for msg in stub.Generate(request, timeout=timeout):
        if msg.token_ids:
            now = time.perf_counter()
            first = first or now
            last = now
            n += len(msg.token_ids)
    return n, first, last


def run_batch(stub, http_url: str, batch: int, constrained: bool, output_len: int, timeout: float) -> dict[str, Any]:
    before = scrape(http_url)
    start = time.perf_counter()
    with cf.ThreadPoolExecutor(batch) as pool:
        streams = list(pool.map(lambda i: _stream(stub, _request(i, constrained, output_len), timeout), range(batch)))
    duration = time.perf_counter() - start
    after = scrape(http_url)
    d = {k: after[k] - before[k] for k in _METRICS}
    steps = max(1.0, d["tandem:scheduler_steps_total"])
    tpot = [(last - first) / (n - 1) * 1e3 for n, first, last in streams if n > 1]
    return {"mode": "constrained" if constrained else "plain", "batch": batch, "duration_s": duration,
            "exact_output_len": sum(n == output_len for n, _, _ in streams),
            "tpot_ms": statistics.fmean(tpot) if tpot else None, "steps": int(steps),
            "masks": int(d["tandem:scheduler_token_masks_total"]),
            "mask_ms_per_step": d["tandem:scheduler_token_mask_seconds_total"] * 1e3 / steps,
            "mask_wait_ms_per_step": d["tandem:scheduler_token_mask_wait_seconds_total"] * 1e3 / steps,
            "mask_ms_per_request": d["tandem:scheduler_token_mask_seconds_total"] * 1e3 / batch}


def sampler_cost(vocab_size: int, batch: int, reps: int = 30) -> dict[str, float]:
    """The executor's sampler alone (in this process, CPU) on random [batch, vocab] logits, greedy, without and
    with a mask on every row (500 allowed tokens, or all of a smaller vocabulary): the best of `reps` interleaved calls each, in ms."""
    import numpy as np
    import torch

    from models.sampler import Sampler, SamplingRow
    from tandem.sampling_params import SamplingParams
    from tandem.token_mask import pack
    rng = np.random.default_rng(0)
    sampler, logits = Sampler(vocab_size), torch.randn(batch, vocab_size)
    plain = [SamplingRow(SamplingParams(), [1], 0, 1) for _ in range(batch)]
    masked = [SamplingRow(SamplingParams(), [1], 0, 1, 0, pack(rng.choice(vocab_size, min(500, vocab_size), replace=False),
                                                                vocab_size)) for _ in range(batch)]
    best = {"plain": float("inf"), "masked": float("inf")}
    for _ in range(reps):
        for name, rows in (("plain", plain), ("masked", masked)):
            start = time.perf_counter()
            sampler.sample(logits, rows)
            best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return {"sampler_plain_ms": best["plain"], "sampler_masked_ms": best["masked"],
            "sampler_extra_ms": best["masked"] - best["plain"]}


def measure(address: str, http_url: str, batches: list[int], output_len: int, repeats: int, timeout: float,
            log, vocab_size: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(every run, one summary row per batch size, with the sampler's own cost of the masks)."""
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.GenerateServiceStub(channel)
    runs: list[dict[str, Any]] = []
    for constrained in (False, True):  # warm-up: the grammar compiled, llguidance's tokenizer built
        run_batch(stub, http_url, 1, constrained, min(output_len, 8), timeout)
    for batch in batches:
        for r in range(repeats):
            for constrained in ((False, True) if r % 2 == 0 else (True, False)):
                run = run_batch(stub, http_url, batch, constrained, output_len, timeout)
                log(f"batch {batch} {run['mode']}: TPOT {run['tpot_ms']:.1f} ms, {run['duration_s']:.1f} s")
                runs.append(run)
    channel.close()
    rows = []
    for batch in batches:
        mine = [r for r in runs if r["batch"] == batch]
        plain = statistics.fmean(r["tpot_ms"] for r in mine if r["mode"] == "plain")
        con = [r for r in mine if r["mode"] == "constrained"]
        tpot = statistics.fmean(r["tpot_ms"] for r in con)
        overhead = 100.0 * (tpot / plain - 1.0)
        rows.append({"batch": batch, "plain_tpot_ms": plain, "constrained_tpot_ms": tpot, "overhead_pct": overhead,
                     "target_met": overhead <= 10.0 if batch >= 32 else None,
                     "mask_ms_per_step": statistics.fmean(r["mask_ms_per_step"] for r in con),
                     "mask_wait_ms_per_step": statistics.fmean(r["mask_wait_ms_per_step"] for r in con),
                     "mask_ms_per_request": statistics.fmean(r["mask_ms_per_request"] for r in con),
                     "masks_per_request": statistics.fmean(r["masks"] / batch for r in con),
                     "all_exact_output_len": all(r["exact_output_len"] == batch for r in mine),
                     **sampler_cost(vocab_size, batch)})
    return runs, rows
