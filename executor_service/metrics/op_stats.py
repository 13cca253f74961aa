"""Operation counters and latency summaries (mean, p95) for the executor, like the reference's
`executor_model_lock` wait metric."""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

from executor_service.memory_probe import resident_memory_bytes

_WINDOW = 4096  # recent samples kept for percentiles


@dataclass(frozen=True)
class LatencySummary:
    count: int
    mean_ms: float
    p95_ms: float
    max_ms: float


class LatencyStats:
    def __init__(self) -> None:
        self.count = 0
        self._total = 0.0
        self._recent: deque[float] = deque(maxlen=_WINDOW)

    def add(self, seconds: float) -> None:
        self.count += 1
        self._total += seconds
        self._recent.append(seconds)

    def summary(self) -> LatencySummary:
        if not self.count:
            return LatencySummary(0, 0.0, 0.0, 0.0)
        ordered = sorted(self._recent)
        p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
        return LatencySummary(self.count, 1e3 * self._total / self.count, 1e3 * p95, 1e3 * ordered[-1])


@dataclass(frozen=True)
class MetricsSnapshot:
    ops: dict[str, LatencySummary]  # per operation: calls and latency including the lock wait
    lock_wait: LatencySummary  # time spent waiting for the model lock
    forward_passes: int
    tokens_processed: int  # tokens run through the model (prefill + decode)
    tokens_sampled: int
    caches_created: int
    caches_released: int
    resident_memory_bytes: int = 0  # the process's RSS when the snapshot was taken (0: not known)


# Called once per packed forward, on the model thread: (kind, seconds, tokens); see ExecutorMetrics.record_step.
StepObserver = Callable[[str, float, int], None]


class ExecutorMetrics:
    def __init__(self) -> None:
        # The Prometheus exporter's (executor_service/metrics/prometheus.py) when --metrics-port is given.
        self.step_observer: StepObserver | None = None
        self._guard = threading.Lock()
        self._ops: dict[str, LatencyStats] = {}
        self._lock_wait = LatencyStats()
        self.forward_passes = 0
        self.tokens_processed = 0
        self.tokens_sampled = 0
        self.caches_created = 0
        self.caches_released = 0

    def record_op(self, name: str, seconds: float, lock_wait: float) -> None:
        with self._guard:
            self._ops.setdefault(name, LatencyStats()).add(seconds)
            self._lock_wait.add(lock_wait)

    def record_step(self, kind: str, seconds: float, tokens: int) -> None:
        """One packed forward ran: kind "prefill" (every item a prompt chunk), "decode" (every item past its
        prompt), "mixed" or "verify" (ForwardVerify); seconds from reserving KV to sampled tokens; tokens
        written. Once per call, never per token: the model thread must not notice."""
        if self.step_observer is not None:
            self.step_observer(kind, seconds, tokens)

    def snapshot(self) -> MetricsSnapshot:
        with self._guard:
            return MetricsSnapshot({k: v.summary() for k, v in self._ops.items()}, self._lock_wait.summary(),
                                   self.forward_passes, self.tokens_processed, self.tokens_sampled,
                                   self.caches_created, self.caches_released, resident_memory_bytes())


class RpcMetrics:
    """Latency of every RPC by method (the interceptor times each call; /metrics reads snapshots)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats: dict[str, LatencyStats] = {}

    def add(self, method: str, seconds: float) -> None:
        with self._lock:
            self._stats.setdefault(method, LatencyStats()).add(seconds)

    def snapshot(self) -> dict[str, LatencySummary]:
        with self._lock:
            return {k: v.summary() for k, v in self._stats.items()}
