"""CPU accounting from /proc (Linux; None or {} elsewhere): how much CPU a process, its threads and the whole
machine used around a timed phase, to tell how many cores a side used and how busy other jobs kept the
machine meanwhile."""
from __future__ import annotations

import os
import time
from typing import Any


def _clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_cpu_s(path: str) -> float:
    """user + system CPU seconds from a /proc .../stat file (raises OSError / IndexError when unreadable)."""
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / _clock_ticks()


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) a live process has used (None once it has exited)."""
    try:
        return _stat_cpu_s(f"/proc/{pid}/stat")
    except (OSError, IndexError):
        return None


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of a process, by thread id."""
    out: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            out[tid] = _stat_cpu_s(f"/proc/{pid}/task/{tid}/stat")
        except OSError:
            continue  # the thread ended
    return out


def busy_threads(before: dict[str, float], after: dict[str, float], wall_s: float) -> tuple[float, int]:
    """(CPU seconds, threads that used >= 10% of wall_s) between two thread_cpu_s() snapshots."""
    deltas = [v - before.get(tid, 0.0) for tid, v in after.items()]
    return sum(deltas), sum(d >= 0.1 * wall_s for d in deltas)


def machine_busy_s() -> float | None:
    """CPU seconds all CPUs spent busy since boot (/proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / _clock_ticks()


def loadavg() -> float | None:
    """The 1-minute load average."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def other_cores(busy_before: float | None, busy_after: float | None, ours_s: float, wall_s: float
                ) -> float | None:
    """Cores other processes kept busy during a timed window: the machine's busy time minus our own CPU
    seconds, per wall second. None for windows under 2 s: /proc counts 10 ms ticks, too coarse there."""
    if busy_before is None or busy_after is None or wall_s < 2.0:
        return None
    return max(0.0, (busy_after - busy_before - ours_s) / wall_s)


class CpuMeter:
    """CPU seconds of named processes and of the whole machine between start() and stop()."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self._before: dict[str, float | None] = {}
        self._busy = self._t = 0.0

    def start(self) -> None:
        self._before = {k: process_cpu_s(pid) for k, pid in self.pids.items()}
        self._busy, self._t = machine_busy_s() or 0.0, time.perf_counter()

    def stop(self) -> dict[str, Any]:
        wall = time.perf_counter() - self._t
        busy = (machine_busy_s() or 0.0) - self._busy
        cpu = {}
        for k, pid in self.pids.items():
            now, before = process_cpu_s(pid), self._before.get(k)
            cpu[k] = None if now is None or before is None else now - before
        ours = sum(v for v in cpu.values() if v is not None)
        return {"wall_s": wall, "cpu_s": cpu,
                "cores": {k: (v / wall if v is not None and wall > 0 else None) for k, v in cpu.items()},
                "other_cores": max(0.0, busy - ours) / wall if wall > 0 and busy else None}
