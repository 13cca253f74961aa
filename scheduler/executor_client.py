"""The scheduler's view of one executor: the few ExecutorService calls it makes, with gRPC failures turned
into domain errors (UNAVAILABLE-like ones into ExecutorUnreachable, the rest relayed as RemoteError)."""
from __future__ import annotations

from typing import Sequence

import grpc

from tandem.errors import RemoteError, Unavailable
from tandem.executor.v1 import executor_pb2 as epb
from tandem.executor.v1 import executor_pb2_grpc as epb_grpc

# Codes that mean "the executor is not there (now)", not "the request was wrong".
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                grpc.StatusCode.UNKNOWN)


class ExecutorUnreachable(Unavailable):
    """The executor did not answer (down, restarting, network); in-flight requests cannot continue."""


class GrpcExecutorClient:
    def __init__(self, address: str, max_message_mb: int = 64, step_timeout_s: float = 600.0) -> None:
        self.address = address
        limit = max_message_mb * 1024 * 1024
        self._channel = grpc.aio.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
            # reconnect quickly once the executor is back
            ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)])
        self._stub = epb_grpc.ExecutorServiceStub(self._channel)
        self._step_timeout_s = step_timeout_s

    async def info(self, timeout_s: float = 5.0) -> epb.GetInfoResponse:
        return await self._call(self._stub.GetInfo, epb.GetInfoRequest(), timeout_s)

    async def unified_decode(self, items: Sequence[epb.UnifiedItem]) -> epb.UnifiedDecodeResponse:
        return await self._call(self._stub.UnifiedDecode, epb.UnifiedDecodeRequest(items=items), self._step_timeout_s)

    async def release(self, cache_ids: Sequence[str]) -> epb.ReleaseCacheResponse:
        return await self._call(self._stub.ReleaseCache, epb.ReleaseCacheRequest(cache_ids=list(cache_ids)), 30.0)

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
