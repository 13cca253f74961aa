"""The engine's periodic log line: what runs and waits, KV in use, tokens through the model, preemptions."""
from __future__ import annotations

import logging
import time

from scheduler.engine.policy import SchedulingPolicy

log = logging.getLogger("tandem.scheduler")
EVERY_S = 10.0


class ThroughputLog:
    def __init__(self, policy: SchedulingPolicy, every_s: float = EVERY_S) -> None:
        self.policy, self.every_s = policy, every_s
        self._since, self._tokens = time.monotonic(), 0

    def add(self, tokens: int) -> None:
        """A step call ran `tokens` tokens through the model; logs a line every every_s seconds."""
        self._tokens += tokens
        now = time.monotonic()
        if now - self._since < self.every_s:
            return
        p, kv = self.policy, self.policy.kv
        used = 1 - kv.free_blocks / max(1, kv.total_blocks)
        log.info("%d running, %d waiting, KV %.0f%% used, %.1f tokens/s through the model, %d preemptions",
                 len(p.running), len(p.waiting), 100 * used, self._tokens / (now - self._since), p.preemptions)
        self._since, self._tokens = now, 0
