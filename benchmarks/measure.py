"""Timing: device-synchronized clocks, the machine's matmul peak, and summaries of timed samples."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch


def synchronize(device: torch.device | str) -> None:
    """Waits for the device's queued work (CUDA kernels run asynchronously); no-op elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Clock:
    """`with clock: ...` records the block's wall time in `clock.times` (synchronizing the device on both
    sides, so queued work from before is not billed to the block and the block's own work is), and the
    process CPU time (all threads, spin-waits included) in `clock.cpu_times`. On a shared machine the CPU
    time is the steadier measure of work: time spent descheduled counts in wall time only."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self._start = self._cpu_start = 0.0

    def __enter__(self) -> "Clock":
        synchronize(self.device)
        self._cpu_start = time.process_time()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        synchronize(self.device)
        self.times.append(time.perf_counter() - self._start)
        self.cpu_times.append(time.process_time() - self._cpu_start)


def time_call(fn: Callable[[], Any], device: torch.device | str = "cpu", repeats: int = 5,
              warmup: int = 1) -> list[float]:
    """Seconds per call of fn, `repeats` timed calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    clock = Clock(device)
    for _ in range(repeats):
        with clock:
            fn()
    return clock.times


def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of fn over `repeats` calls after one untimed; a bare perf_counter loop, for pieces of
    microseconds where the Clock's own calls would count."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass(frozen=True)
class PeakResult:
    gflops: float  # best observed
    median_gflops: float
    n: int
    dtype: str
    repeats: int
    seconds: list[float]

    def as_dict(self) -> dict[str, Any]:
        return {"gflops": self.gflops, "median_gflops": self.median_gflops, "n": self.n, "dtype": self.dtype,
                "repeats": self.repeats, "seconds": self.seconds}


@torch.inference_mode()
def measure_matmul_peak(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, n: int = 2048,
                        repeats: int = 7, warmup: int = 2) -> PeakResult:
    """Dense matmul throughput: 2 n^3 FLOPs per [n, n] @ [n, n] product, best of `repeats` (on a noisy,
    shared machine the best run is the closest to what the hardware can do)."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    times = time_call(lambda: torch.matmul(a, b, out=out), device, repeats=repeats, warmup=warmup)
    flops = 2.0 * n ** 3
    return PeakResult(flops / min(times) / 1e9, flops / statistics.median(times) / 1e9, n,
                      str(dtype).removeprefix("torch."), repeats, times)


def time_stats(times: list[float]) -> dict[str, Any]:
    """median / min / max / mean seconds of timed calls, and the calls' own times."""
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "mean_s": statistics.fmean(times), "times_s": times}


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, Any]:
    """Distribution of `values` x scale (e.g. scale 1e3: seconds -> ms): n, mean, std, min, max, p50, p90,
    p99 (numpy's linear interpolation, as vLLM's serving benchmark reports them). An empty sample gives n 0
    and None everywhere else."""
    import numpy as np
    keys = ("mean", "std", "min", "max", "p50", "p90", "p99")
    if len(values) == 0:
        return {"n": 0, **{k: None for k in keys}}
    a = np.asarray(values, dtype=np.float64) * scale
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"n": int(a.size), "mean": float(a.mean()), "std": float(a.std()), "min": float(a.min()),
            "max": float(a.max()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}
