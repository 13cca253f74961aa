"""The scheduler's only view of an executor: the ExecutorClient protocol, and its gRPC implementation.

The protocol speaks the contract's messages (tandem.executor.v1), so every implementation — gRPC here, the
in-process one over an Executor (executor_service/in_process_client.py), the fault-injecting fakes of the
tests — answers exactly what a remote executor would. Failures are domain errors: ExecutorUnreachable when
the transport failed (no answer: down, restarting, network), RemoteError with the status name when the
executor answered with an error, or answered too late (DEADLINE_EXCEEDED: a slow executor is not a lost one).
"""
from __future__ import annotations

from typing import Protocol, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.errors import RemoteError, Unavailable
from tandem.executor.v1 import executor_pb2 as epb
from tandem.executor.v1 import executor_pb2_grpc as epb_grpc

# Codes that mean the transport failed: the executor is not there (now). UNKNOWN is what gRPC reports for a
# stream cut mid-call (e.g. "Stream removed"); the executor itself never answers UNKNOWN (its interceptor
# maps every error to a specific code or INTERNAL). DEADLINE_EXCEEDED is not here: an executor under load
# answers late, and that must not fail every stream.
_TRANSPORT_FAILURES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN)
SERVICE_NAME = epb.DESCRIPTOR.services_by_name["ExecutorService"].full_name


class ExecutorUnreachable(Unavailable):
    """The transport to the executor failed (down, restarting, network): the outcome of the call is unknown."""


def is_kv_exhaustion(error: RemoteError) -> bool:
    """Whether an error answer means "not enough free KV blocks now" (the executor's KvCapacityExceeded,
    tandem/errors.py, whose message starts "KV cache full"). Any other RESOURCE_EXHAUSTED — a message over the
    size limit, a bounded workspace, device memory — is not: preempting for it would loop."""
    return error.status_name == "RESOURCE_EXHAUSTED" and "KV cache full" in str(error)


class ExecutorClient(Protocol):
    """What the scheduler asks of one executor. session_id "" = the executor's anonymous session (and the
    only choice with an executor that has no sessions)."""

    address: str  # for logs and messages: where the executor is

    async def info(self) -> epb.GetInfoResponse: ...

    async def unified_decode(self, items: Sequence[epb.UnifiedItem],
                             session_id: str = "") -> epb.UnifiedDecodeResponse: ...

    async def release(self, cache_ids: Sequence[str], session_id: str = "") -> epb.ReleaseCacheResponse: ...

    async def create_caches(self, items: Sequence[epb.CreateCacheItem],
                            session_id: str = "") -> epb.CreateCacheResponse:
        """Caches holding the longest cached prefix of each prompt (capability "create_cache")."""
        ...

    async def list_adapters(self) -> epb.ListAdaptersResponse: ...

    async def open_session(self, client_name: str) -> epb.OpenSessionResponse:
        """RemoteError UNIMPLEMENTED from an executor without sessions."""
        ...

    async def keep_alive(self, session_id: str) -> epb.KeepAliveResponse: ...

    async def close_session(self, session_id: str) -> epb.CloseSessionResponse: ...

    async def healthy(self) -> bool:
        """Whether the executor reports SERVING (False while it loads or drains, or when unreachable)."""
        ...

    async def close(self) -> None: ...


class GrpcExecutorClient:
    """ExecutorClient over a grpc.aio channel."""

    def __init__(self, address: str, max_message_mb: int = 64, step_timeout_s: float = 600.0,
                 control_timeout_s: float = 5.0) -> None:
        self.address = address
        limit = max_message_mb * 1024 * 1024
        self._channel = grpc.aio.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
            # reconnect quickly once the executor is back
            ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)])
        self._stub = epb_grpc.ExecutorServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._step_timeout_s = step_timeout_s
        self._control_timeout_s = control_timeout_s  # info, sessions, adapters, health

    async def info(self) -> epb.GetInfoResponse:
        return await self._call(self._stub.GetInfo, epb.GetInfoRequest(), self._control_timeout_s)

    async def unified_decode(self, items: Sequence[epb.UnifiedItem],
                             session_id: str = "") -> epb.UnifiedDecodeResponse:
        return await self._call(self._stub.UnifiedDecode, epb.UnifiedDecodeRequest(items=items, session_id=session_id),
                                self._step_timeout_s)

    async def release(self, cache_ids: Sequence[str], session_id: str = "") -> epb.ReleaseCacheResponse:
        return await self._call(self._stub.ReleaseCache,
                                epb.ReleaseCacheRequest(cache_ids=list(cache_ids), session_id=session_id), 30.0)

    async def create_caches(self, items: Sequence[epb.CreateCacheItem],
                            session_id: str = "") -> epb.CreateCacheResponse:
        return await self._call(self._stub.CreateCache, epb.CreateCacheRequest(items=items, session_id=session_id),
                                self._control_timeout_s)

    async def list_adapters(self) -> epb.ListAdaptersResponse:
        return await self._call(self._stub.ListAdapters, epb.ListAdaptersRequest(), self._control_timeout_s)

    async def open_session(self, client_name: str) -> epb.OpenSessionResponse:
        return await self._call(self._stub.OpenSession, epb.OpenSessionRequest(client_name=client_name),
                                self._control_timeout_s)

    async def keep_alive(self, session_id: str) -> epb.KeepAliveResponse:
        return await self._call(self._stub.KeepAlive, epb.KeepAliveRequest(session_id=session_id),
                                self._control_timeout_s)

    async def close_session(self, session_id: str) -> epb.CloseSessionResponse:
        return await self._call(self._stub.CloseSession, epb.CloseSessionRequest(session_id=session_id), 30.0)

    async def healthy(self) -> bool:
        try:
            resp = await self._call(self._health.Check, health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                    self._control_timeout_s)
        except (ExecutorUnreachable, RemoteError):
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def kv_events(self, summary_interval_ms: int = 5000):
        """The executor's KV event stream (SubscribeKvEvents): an async iterator of its messages; raises
        grpc.aio.AioRpcError when it ends with an error (a subscriber that falls behind is dropped)."""
        return self._stub.SubscribeKvEvents(epb.SubscribeKvEventsRequest(summary_interval_ms=summary_interval_ms))

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, method, request, timeout_s: float):
        try:
            return await method(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code in _TRANSPORT_FAILURES:
                raise ExecutorUnreachable(f"executor {self.address} is unreachable ({code.name}: {exc.details()}); "
                                          "the scheduler reconnects when it is back") from exc
            raise RemoteError(code.name, f"executor {self.address}: {exc.details()}") from exc
