"""The two load shapes the benchmark clients share, whatever the transport (gRPC Generate, OpenAI HTTP):
closed loop (N requests in flight, each finished one starts the next) and open loop (request i sent at
arrivals[i] seconds from the start, optionally at most `cap` in flight)."""
from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

from benchmarks.request_metrics import Record

Send = Callable[[int], Awaitable[Any]]  # send(i): stream request i into its Record


async def closed_loop(n: int, concurrency: int, send: Send) -> None:
    """Requests 0..n-1, `concurrency` in flight."""
    todo = iter(range(n))

    async def client() -> None:
        for i in todo:  # one shared iterator: each finished request starts the next one
            await send(i)

    await asyncio.gather(*(client() for _ in range(min(concurrency, n))))


async def open_loop(records: list[Record], arrivals: list[float], cap: int | None, send: Send) -> None:
    """Request i due at arrivals[i] s from now (records[i].arrival = when it was due); with `cap`, a due
    request waits for a slot, and its clock (Record.start, set by send) starts when it is sent."""
    slots = asyncio.Semaphore(cap) if cap else None
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        records[i].arrival = time.perf_counter()
        if slots is None:
            await send(i)
            return
        async with slots:
            await send(i)

    tasks = []
    for i, offset in enumerate(arrivals):
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(i)))
    await asyncio.gather(*tasks)
