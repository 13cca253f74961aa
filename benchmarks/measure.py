"""Measurement: device-synchronized clocks, the machine's matmul peak, summaries of timed samples, and CPU
accounting from /proc (Linux; None elsewhere): how many cores a process used and how busy other jobs kept the
machine meanwhile."""
from __future__ import annotations

import os
import statistics
import time
from typing import Any, Sequence

import numpy as np
import torch


class Clock:
    """`with clock: ...` records the block's wall time in `times` (synchronizing the device on both sides) and
    the process CPU time (all threads) in `cpu_times`: on a shared machine CPU time is the steadier measure."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self._start = self._cpu_start = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":  # CUDA kernels run asynchronously
            torch.cuda.synchronize(self.device)

    def __enter__(self) -> "Clock":
        self._sync()
        self._cpu_start, self._start = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._sync()
        self.times.append(time.perf_counter() - self._start)
        self.cpu_times.append(time.process_time() - self._cpu_start)


@torch.inference_mode()
def matmul_peak(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, n: int = 2048,
                repeats: int = 7) -> dict[str, Any]:
    """Dense [n, n] @ [n, n] GFLOP/s, best of `repeats` after 2 untimed (the best run is the closest to what
    the hardware can do on a noisy machine): the denominator of every "% peak"."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
    out = torch.empty(n, n, device=device, dtype=dtype)
    clock = Clock(device)
    for i in range(repeats + 2):
        with clock:
            torch.matmul(a, b, out=out)
    times = clock.times[2:]
    return {"gflops": 2.0 * n ** 3 / min(times) / 1e9, "median_gflops": 2.0 * n ** 3 / statistics.median(times) / 1e9,
            "n": n, "dtype": str(dtype).removeprefix("torch."), "seconds": times}


def time_stats(times: list[float]) -> dict[str, Any]:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "mean_s": statistics.fmean(times), "times_s": times}


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, Any]:
    """n, mean, std, min, max, p50, p90, p99 of values x scale (numpy's linear interpolation, as vLLM's serving
    benchmark); an empty sample gives n 0 and None elsewhere."""
    keys = ("mean", "std", "min", "max", "p50", "p90", "p99")
    if len(values) == 0:
        return {"n": 0, **{k: None for k in keys}}
    a = np.asarray(values, dtype=np.float64) * scale
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"n": int(a.size), "mean": float(a.mean()), "std": float(a.std()), "min": float(a.min()),
            "max": float(a.max()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def _stat_cpu_s(path: str) -> float:
    """user + system CPU seconds from a /proc .../stat file."""
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (all threads) a live process has used; None once it has exited."""
    try:
        return _stat_cpu_s(f"/proc/{pid}/stat")
    except (OSError, IndexError, ValueError):
        return None


def proc_memory(pid: int) -> dict[str, int | None]:
    """VmRSS and VmHWM (the most it held) of a live process, in bytes (None: not found)."""
    out: dict[str, int | None] = {"rss": None, "peak": None}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out["rss" if key == "VmRSS" else "peak"] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def machine_busy_s() -> float | None:
    """CPU seconds all CPUs spent busy since boot (/proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(fields[:8]) - fields[3] - (fields[4] if len(fields) > 4 else 0)) / os.sysconf("SC_CLK_TCK")


def other_cores(busy_before: float | None, busy_after: float | None, ours_s: float, wall_s: float) -> float | None:
    """Cores other processes kept busy during a window: the machine's busy time minus ours, per wall second
    (None under 2 s: /proc counts 10 ms ticks)."""
    if busy_before is None or busy_after is None or wall_s < 2.0:
        return None
    return max(0.0, (busy_after - busy_before - ours_s) / wall_s)


class CpuMeter:
    """CPU seconds of named processes and of the whole machine between start() and stop()."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self._before: dict[str, float | None] = {}
        self._busy: float | None = None
        self._t = 0.0

    def start(self) -> None:
        self._before = {k: process_cpu_s(pid) for k, pid in self.pids.items()}
        self._busy, self._t = machine_busy_s(), time.perf_counter()

    def stop(self) -> dict[str, Any]:
        wall = time.perf_counter() - self._t
        cpu = {}
        for k, pid in self.pids.items():
            now, before = process_cpu_s(pid), self._before.get(k)
            cpu[k] = None if now is None or before is None else now - before
        ours = sum(v for v in cpu.values() if v is not None)
        return {"wall_s": wall, "cpu_s": cpu, "other_cores": other_cores(self._busy, machine_busy_s(), ours, wall),
                "cores": {k: (v / wall if v is not None and wall > 0 else None) for k, v in cpu.items()}}


def cores_text(cpu: dict[str, Any], names: Sequence[str]) -> str:
    """`1.95/0.31/0.12`: the cores of the named processes a CpuMeter followed, for a table cell."""
    return "/".join(f"{cpu['cores'][k]:.2f}" for k in names if cpu["cores"].get(k) is not None)
