"""A request stream's queue of messages for its client, which knows how long its oldest unread message has waited:
what tells a client that stopped reading (or reads slower than the model writes) from one that merely has a slow
network. The generation never waits on it (puts never block); the engine stops a request whose reader falls
behind by more than --stream-stall-timeout-s, or whose queue holds more than --stream-max-buffered messages
(scheduler/engine/engine.py), so a stalled client cannot hold KV blocks until its max_tokens."""
from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any, Callable


class EventQueue(asyncio.Queue):
    """asyncio.Queue whose items carry the time they were put (asyncio.Queue's _init/_put/_get hooks, as
    PriorityQueue uses them)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        super().__init__()

    def _init(self, maxsize: int) -> None:
        super()._init(maxsize)
        self._times: deque[float] = deque()

    def _put(self, item: Any) -> None:
        super()._put(item)
        self._times.append(self._clock())

    def _get(self) -> Any:
        self._times.popleft()
        return super()._get()

    def oldest_wait(self, now: float) -> float:
        """Seconds the oldest unread item has waited (0 when none waits)."""
        return now - self._times[0] if self._times else 0.0
