"""The scheduler's only view of an executor: the ExecutorClient protocol, and its gRPC implementation.

The protocol speaks the contract's messages (tandem.executor.v1), so every implementation — gRPC here, the
in-process one over an Executor (executor_service/in_process_client.py), the fault-injecting fakes of the
tests — answers exactly what a remote executor would. Failures are domain errors: ExecutorUnreachable when
there was no answer (down, restarting, network), RemoteError with the status name when the executor
answered with an error (nothing of that call was written).
"""
from __future__ import annotations

from typing import Protocol, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.errors import RemoteError, Unavailable
from tandem.executor.v1 import executor_pb2 as epb
from tandem.executor.v1 import executor_pb2_grpc as epb_grpc

# Codes that mean "the executor is not there (now)", not "the request was wrong".
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                grpc.StatusCode.UNKNOWN)
SERVICE_NAME = epb.DESCRIPTOR.services_by_name["ExecutorService"].full_name


class ExecutorUnreachable(Unavailable):
    """The executor did not answer (down, restarting, network); in-flight requests cannot continue."""


class ExecutorClient(Protocol):
    """What the scheduler asks of one executor."""

    address: str  # for logs and messages: where the executor is

    async def info(self) -> epb.GetInfoResponse: ...

    async def unified_decode(self, items: Sequence[epb.UnifiedItem]) -> epb.UnifiedDecodeResponse: ...

    async def release(self, cache_ids: Sequence[str]) -> epb.ReleaseCacheResponse: ...

    async def list_adapters(self) -> epb.ListAdaptersResponse: ...

    async def healthy(self) -> bool:
        """Whether the executor reports SERVING (False while it loads or drains, or when unreachable)."""
        ...

    async def close(self) -> None: ...


class GrpcExecutorClient:
    """ExecutorClient over a grpc.aio channel."""

    def __init__(self, address: str, max_message_mb: int = 64, step_timeout_s: float = 600.0) -> None:
        self.address = address
        limit = max_message_mb * 1024 * 1024
        self._channel = grpc.aio.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
            # reconnect quickly once the executor is back
            ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)])
        self._stub = epb_grpc.ExecutorServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._step_timeout_s = step_timeout_s

    async def info(self, timeout_s: float = 5.0) -> epb.GetInfoResponse:
        return await self._call(self._stub.GetInfo, epb.GetInfoRequest(), timeout_s)

    async def unified_decode(self, items: Sequence[epb.UnifiedItem]) -> epb.UnifiedDecodeResponse:
        return await self._call(self._stub.UnifiedDecode, epb.UnifiedDecodeRequest(items=items), self._step_timeout_s)

    async def release(self, cache_ids: Sequence[str]) -> epb.ReleaseCacheResponse:
        return await self._call(self._stub.ReleaseCache, epb.ReleaseCacheRequest(cache_ids=list(cache_ids)), 30.0)

    async def list_adapters(self) -> epb.ListAdaptersResponse:
        return await self._call(self._stub.ListAdapters, epb.ListAdaptersRequest(), 5.0)

    async def healthy(self) -> bool:
        try:
            resp = await self._call(self._health.Check, health_pb2.HealthCheckRequest(service=SERVICE_NAME), 5.0)
        except (ExecutorUnreachable, RemoteError):
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, method, request, timeout_s: float):
        try:
            return await method(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code in _UNREACHABLE:
                raise ExecutorUnreachable(f"executor {self.address} is unreachable ({code.name}: {exc.details()}); "
                                          "the scheduler reconnects when it is back") from exc
            raise RemoteError(code.name, f"executor {self.address}: {exc.details()}") from exc
