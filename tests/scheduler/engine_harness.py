"""Drives the async Engine in tests: an engine over a (fault-injecting) client with its loop running, the
events of one request's stream, and a deadline-bounded wait for a condition."""
from __future__ import annotations

import asyncio
from typing import Callable

from scheduler.config import SchedulerConfig
from scheduler.engine.engine import Engine
from scheduler.request import Delta
from scheduler.engine.executor_codec import executor_info_from_pb
from tandem.errors import TandemError


class Running:
    """An Engine over `client` with its loop running: `async with Running(...) as engine`. Health changes are
    recorded; on exit the engine drains and every KV block must be free again."""

    def __init__(self, client, tokenizer, **cfg) -> None:
        self.client = client
        self.health: list[bool] = []
        cfg.setdefault("reconnect_interval_s", 0.01)
        self.engine = Engine(SchedulerConfig("faulty", **cfg), client, tokenizer, executor_info_from_pb(client.info_now()),
                             on_health=self.health.append, client_name="tandem-scheduler test")

    async def __aenter__(self) -> Engine:
        await self.engine.start()
        self.task = asyncio.create_task(self.engine.run())
        return self.engine

    async def __aexit__(self, *exc) -> None:
        await self.engine.drain(0)
        self.task.cancel()
        if exc[0] is None:
            kv = self.client.info_now().kv
            assert (kv.active_caches, kv.free_blocks) == (0, kv.total_blocks), "KV blocks leaked"


async def collect(output) -> list[Delta | TandemError]:
    events = []
    while True:
        event = await asyncio.wait_for(output.events.get(), 30)
        events.append(event)
        if isinstance(event, TandemError) or event.finish_reason is not None:
            return events


def tokens(events) -> list[int]:
    return [t.token_id for e in events if isinstance(e, Delta) for t in e.tokens]


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Polls condition (a deadline, not a timing assert: it fails only if the engine never gets there)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        await asyncio.sleep(0.005)
