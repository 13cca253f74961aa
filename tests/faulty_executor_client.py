"""An ExecutorClient that wraps a real one (usually the in-process client) and injects faults at the seam the
scheduler sees: no answer (UNAVAILABLE), a late answer, or an error status for a step. Scripted per call, so
tests are deterministic."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Sequence

from scheduler.executor_client import ExecutorUnreachable
from tandem.errors import RemoteError
from tandem.executor.v1 import executor_pb2 as epb


@dataclass
class Fault:
    kind: str  # "unavailable" | "late" | "status"
    status: str = "INTERNAL"  # for "status": the gRPC status name the executor answers with
    delay_s: float = 0.0  # for "late"


@dataclass
class FaultyExecutorClient:
    inner: object  # an ExecutorClient (with *_now methods when used synchronously)
    address: str = "faulty"
    step_faults: dict[int, Fault] = field(default_factory=dict)  # UnifiedDecode call index (from 0) -> fault
    down: bool = False  # while True every call is unreachable (the executor is gone)
    steps: int = 0  # UnifiedDecode calls seen

    def _check_down(self) -> None:
        if self.down:
            raise ExecutorUnreachable(f"executor {self.address} is unreachable (UNAVAILABLE: injected)")

    def _fault(self) -> Fault | None:
        self._check_down()
        fault = self.step_faults.get(self.steps)
        self.steps += 1
        if fault is not None and fault.kind == "unavailable":
            self.down = True  # it stays gone until the test brings it back
            self._check_down()
        if fault is not None and fault.kind == "status":
            raise RemoteError(fault.status, f"executor {self.address}: injected {fault.status}")
        return fault

    # synchronous (policy tests)
    def unified_decode_now(self, items: Sequence[epb.UnifiedItem]) -> epb.UnifiedDecodeResponse:
        self._fault()
        return self.inner.unified_decode_now(items)

    def release_now(self, cache_ids: Sequence[str]) -> epb.ReleaseCacheResponse:
        self._check_down()
        return self.inner.release_now(cache_ids)

    # ExecutorClient
    async def info(self) -> epb.GetInfoResponse:
        self._check_down()
        return await self.inner.info()

    async def unified_decode(self, items: Sequence[epb.UnifiedItem]) -> epb.UnifiedDecodeResponse:
        fault = self._fault()
        if fault is not None and fault.kind == "late":
            await asyncio.sleep(fault.delay_s)
        return await self.inner.unified_decode(items)

    async def release(self, cache_ids: Sequence[str]) -> epb.ReleaseCacheResponse:
        self._check_down()
        return await self.inner.release(cache_ids)

    async def list_adapters(self) -> epb.ListAdaptersResponse:
        self._check_down()
        return await self.inner.list_adapters()

    async def healthy(self) -> bool:
        return not self.down

    async def close(self) -> None:
        pass
