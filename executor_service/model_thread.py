"""One long-lived thread for every torch call the server makes.

torch's CPU kernels run on OpenMP (libgomp), and every OS thread that enters a parallel region becomes
the master of its own worker team, which then spin-waits between regions. If gRPC's pool threads ran
the model in turn, each would grow a team, and the idle teams' spinning would steal the cores the busy
one needs (measured: ~18 % slower decode on 2 cores). Running load, warm-up and every RPC's model work
on this single thread keeps exactly one team. It also serializes model calls, which the executor
requires anyway.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")


class ModelThread:
    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    def call(self, fn: Callable[..., T], *args: object) -> T:
        """Runs fn(*args) on the model thread and returns its result (or raises its exception) here."""
        return self._pool.submit(fn, *args).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
