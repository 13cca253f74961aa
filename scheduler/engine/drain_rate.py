"""How fast one engine's queue drains, measured: the wait a new request would have before its first step, and
when a refused client should come back (Retry-After).

Two measures, the larger taken, because each alone is wrong in one regime:
- finished per second over the last WINDOW_S: exact while the batch is full, but right after a quiet spell it
  counts the quiet spell's few finishes and would refuse a burst the batch could absorb;
- the running requests over their mean time in the batch (Little's law, a moving average of the last requests'
  admission-to-finish times): right from the first finishes of a burst, blind to a batch held short of slots
  by KV.
Until anything has finished there is no measure: the estimate is "unknown" and nothing is refused on it (the
queue-time bound still ends what waits too long).
"""
from __future__ import annotations

import math
from collections import deque
from typing import Callable

WINDOW_S = 10.0  # finishes counted for the rate
SERVICE_WEIGHT = 0.1  # of the newest finish in the moving average of time in the batch
MAX_RETRY_AFTER_S = 600  # a Retry-After past this says nothing useful


class DrainRate:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._finished: deque[float] = deque()  # finish times within WINDOW_S, oldest first
        self._since = clock()  # the start of the measuring (the window is shorter before WINDOW_S has passed)
        self.service_s: float | None = None  # moving average of admission-to-finish time

    def finished(self, in_batch_s: float) -> None:
        """A request left the batch done (finished, failed or cancelled: its slot is free) after in_batch_s."""
        now = self._clock()
        self._finished.append(now)
        in_batch_s = max(in_batch_s, 1e-3)
        self.service_s = in_batch_s if self.service_s is None else \
            self.service_s + SERVICE_WEIGHT * (in_batch_s - self.service_s)
        self._trim(now)

    def per_second(self, running: int) -> float | None:
        """Requests leaving the batch per second (None: nothing measured yet)."""
        now = self._clock()
        self._trim(now)
        rates = []
        if self._finished:
            rates.append(len(self._finished) / max(min(WINDOW_S, now - self._since), 1.0))
        if self.service_s is not None and running:
            rates.append(running / self.service_s)
        return max(rates) if rates else None

    def wait_s(self, ahead: int, free_slots: int, running: int) -> float | None:
        """Seconds until a request with `ahead` requests queued before it starts, with `free_slots` places in the
        batch open now: 0 when it fits at once, None when nothing was measured yet."""
        if ahead < free_slots:
            return 0.0
        rate = self.per_second(running)
        return None if rate is None else (ahead + 1 - free_slots) / rate

    def retry_after_s(self, queued: int, running: int) -> int:
        """Whole seconds (1 .. MAX_RETRY_AFTER_S) until the requests queued now have left the queue: when a
        retry is likely to be taken (1 when nothing was measured yet)."""
        rate = self.per_second(running)
        if rate is None or queued <= 0:
            return 1
        return int(min(MAX_RETRY_AFTER_S, max(1, math.ceil(queued / rate))))

    def _trim(self, now: float) -> None:
        while self._finished and now - self._finished[0] > WINDOW_S:
            self._finished.popleft()
