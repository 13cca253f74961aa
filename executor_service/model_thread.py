"""One long-lived thread for every torch call the server makes.

torch's CPU kernels run on OpenMP (libgomp), and every OS thread that enters a parallel region becomes
the master of its own worker team, which then spin-waits between regions. If gRPC's pool threads ran
the model in turn, each would grow a team, and the idle teams' spinning would steal the cores the busy
one needs (measured: ~18 % slower decode on 2 cores). Running load, warm-up and every RPC's model work
on this single thread keeps exactly one team. It also serializes model calls, which the executor
requires anyway.

The queue in front of it is bounded (--max-queued-calls): past the bound a call is refused at once
(QueueFull, RESOURCE_EXHAUSTED) with nothing done, rather than waiting without limit. Calls that do not run
the model (info, health, listings, release, sessions) never come here, so they never wait for the queue.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from tandem.errors import QueueFull

T = TypeVar("T")
DEFAULT_MAX_QUEUED = 64


class ModelThread:
    def __init__(self, max_queued: int = DEFAULT_MAX_QUEUED,
                 after_call: Callable[[int], None] | None = None) -> None:
        """after_call(calls waiting): run on the model thread after each call (executor_service/malloc_tuning.py's
        idle trim)."""
        if max_queued < 1:
            raise ValueError(f"--max-queued-calls must be >= 1, got {max_queued}")
        self.max_queued = max_queued
        self._after_call = after_call
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self._guard = threading.Lock()
        self._waiting = 0  # calls submitted and not yet started

    def call(self, fn: Callable[..., T], *args: object) -> T:
        """Runs fn(*args) on the model thread and returns its result (or raises its exception) here;
        QueueFull at once when max_queued calls already wait behind the one running."""
        with self._guard:
            if self._waiting >= self.max_queued:
                raise QueueFull(f"the executor has {self._waiting} model calls queued (--max-queued-calls "
                                f"{self.max_queued}); retry later. Nothing was done")
            self._waiting += 1

        def started() -> T:
            with self._guard:
                self._waiting -= 1
            try:
                return fn(*args)
            finally:
                if self._after_call is not None:
                    self._after_call(self.queued())

        try:
            future = self._pool.submit(started)
        except BaseException:
            with self._guard:
                self._waiting -= 1
            raise
        return future.result()

    def queued(self) -> int:
        """Calls waiting behind the one running."""
        with self._guard:
            return self._waiting

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
