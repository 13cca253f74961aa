"""Runs a request's pooled inputs on the fleet: at most `window` of them queued or running at once (so a
request of thousands of inputs neither fills the queue nor starves others), each a sequence of its own in the
scheduler's batches (beside generations), results in input order. Every input still queued or running is
aborted — its KV freed — when one fails, when the client goes away (`receive` answers http.disconnect), or when
the caller is cancelled.

Inputs that share a long prefix (a score request's prompt up to the document) go `first_alone`: the first runs
by itself, so that its full blocks are in the executor's prefix cache when the others are looked up (submitted
together, every one would be looked up before any had written them, and each would compute them again)."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Iterator, Sequence

from scheduler.output.request_stream import RequestStream
from scheduler.request import GenerateRequest
from tandem.errors import TandemError, Unavailable


class ClientGone(Exception):
    """The HTTP client disconnected; every input was aborted."""


@dataclass(frozen=True)
class PooledResult:
    values: tuple[float, ...]
    prompt_tokens: int


async def run_pooled(fleet, requests: Sequence[GenerateRequest], window: int,
                     receive: Callable[[], Awaitable[dict]] | None = None,
                     first_alone: bool = False) -> list[PooledResult]:
    results: list[PooledResult | None] = [None] * len(requests)
    todo: Iterator[tuple[int, GenerateRequest]] = iter(enumerate(requests))
    running: dict[asyncio.Task, tuple[int, object]] = {}
    watch = asyncio.ensure_future(_disconnect(receive)) if receive is not None else None
    limit = [1 if first_alone else window]  # inputs at once (the first alone: then the window)

    def launch() -> None:
        while len(running) < limit[0]:
            nxt = next(todo, None)
            if nxt is None:
                return
            seq, stream = fleet.submit(nxt[1])  # (a refusal raises: the others are aborted below)
            running[asyncio.ensure_future(_one(stream))] = (nxt[0], seq)

    try:
        launch()
        while running:
            done, _ = await asyncio.wait([*running, *([watch] if watch is not None else [])],
                                         return_when=asyncio.FIRST_COMPLETED)
            if watch is not None and watch in done:
                raise ClientGone()
            for task in done:
                index, _ = running.pop(task)
                results[index] = PooledResult(task.result(), len(requests[index].prompt_ids))  # (raises its error)
            limit[0] = window
            launch()
        return [r for r in results if r is not None]
    finally:
        for task, (_, seq) in running.items():
            task.cancel()
            fleet.abort(seq)
        if watch is not None:
            watch.cancel()


async def _one(stream: RequestStream) -> tuple[float, ...]:
    while True:
        event = await stream.events.get()
        if isinstance(event, TandemError):
            raise event
        if event.finish_reason is not None:
            if event.pooled is None:  # (ended without values: aborted at shutdown)
                raise Unavailable("the request ended before its values were computed: the server is shutting down")
            return event.pooled


async def _disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
