"""The scheduler's only view of an executor: the ExecutorClient protocol, and its gRPC implementation.

The protocol speaks the contract's messages (tandem.executor.v1), so every implementation — gRPC here, the
in-process one over an Executor (executor_service/in_process_client.py), the fault-injecting fakes of the
tests — answers exactly what a remote executor would. Failures are domain errors: ExecutorUnreachable when
the transport failed (no answer: down, restarting, network), RemoteError with the status name when the
executor answered with an error, or answered too late (DEADLINE_EXCEEDED: a slow executor is not a lost one).
An executor that refuses the scheduler's credentials (its token, or with mTLS its certificate) is
ExecutorRefusedCredentials: unusable until the operator fixes them, like an unreachable one.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Protocol, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.errors import RemoteError, Unavailable
from tandem.executor.v1 import executor_pb2 as epb
from tandem.executor.v1 import executor_pb2_grpc as epb_grpc
from tandem.security.tls import ClientTls
from tandem.security.tokens import ClientToken

log = logging.getLogger("tandem.scheduler")

# Codes that mean the transport failed: the executor is not there (now). UNKNOWN is what gRPC reports for a
# stream cut mid-call (e.g. "Stream removed"); the executor itself never answers UNKNOWN (its interceptor
# maps every error to a specific code or INTERNAL). DEADLINE_EXCEEDED is not here: an executor under load
# answers late, and that must not fail every stream.
_TRANSPORT_FAILURES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN)
SERVICE_NAME = epb.DESCRIPTOR.services_by_name["ExecutorService"].full_name


class ExecutorUnreachable(Unavailable):
    """The transport to the executor failed (down, restarting, network): the outcome of the call is unknown."""


class ExecutorRefusedCredentials(ExecutorUnreachable):
    """The executor refused the scheduler's token (UNAUTHENTICATED, PERMISSION_DENIED): nothing ran. Treated as
    unreachable (requests wait --executor-retry-s and go on once the token is fixed) rather than relayed:
    the scheduler's client did nothing wrong."""


_REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


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

    async def unified_decode(self, items: Sequence[epb.UnifiedItem], session_id: str = "",
                             release: Sequence[str] = ()) -> epb.UnifiedDecodeResponse:
        """release: caches to release before the items run (capability "release_with_step")."""
        ...

    async def decode(self, items: Sequence[epb.DecodeItem], num_steps: int, session_id: str = "",
                     release: Sequence[str] = ()) -> epb.DecodeResponse:
        """num_steps device-side decode steps (capability "multi_step_decode")."""
        ...

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
    """ExecutorClient over a grpc.aio channel. tls: TLS (mTLS with a client certificate) to the executor, else
    plaintext; tls_name: the name its certificate must carry when not the host dialled (the DNS name of a
    dns:/// target). token: sent as `authorization: Bearer` on every call, streams and health included."""

    def __init__(self, address: str, max_message_mb: int = 64, step_timeout_s: float = 600.0,
                 control_timeout_s: float = 5.0, tls: ClientTls | None = None, tls_name: str | None = None,
                 token: ClientToken | None = None) -> None:
        self.address = address
        limit = max_message_mb * 1024 * 1024
        self._options = [
            ("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
            # reconnect quickly once the executor is back
            ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)]
        if tls is not None and (tls.server_name or tls_name):
            self._options.append(("grpc.ssl_target_name_override", tls.server_name or tls_name))
        self._tls = tls
        self._token = token
        self._step_timeout_s = step_timeout_s
        self._control_timeout_s = control_timeout_s  # info, sessions, adapters, health
        self._retired: set[asyncio.Task] = set()  # old channels finishing their calls after a certificate change
        self._open_channel()

    def _open_channel(self) -> None:
        if self._tls is None:
            self._channel = grpc.aio.insecure_channel(self.address, options=self._options)
        else:
            self._tls_version = self._tls.version()
            self._channel = grpc.aio.secure_channel(self.address, self._tls.credentials(), options=self._options)
        self._stub = epb_grpc.ExecutorServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _current(self) -> None:
        """After the certificate files changed: new calls go on a channel with the new ones; calls under way
        finish on the old channel (closed once they have, or after the step timeout)."""
        if self._tls is None or self._tls.version() == self._tls_version:
            return
        old = self._channel
        self._open_channel()
        task = asyncio.get_running_loop().create_task(old.close(grace=self._step_timeout_s))
        self._retired.add(task)
        task.add_done_callback(self._retired.discard)

    def _metadata(self) -> tuple[tuple[str, str], ...] | None:
        return self._token.metadata() if self._token is not None else None

    async def info(self) -> epb.GetInfoResponse:
        return await self._call("GetInfo", epb.GetInfoRequest(), self._control_timeout_s)

    async def unified_decode(self, items: Sequence[epb.UnifiedItem], session_id: str = "",
                             release: Sequence[str] = ()) -> epb.UnifiedDecodeResponse:
        return await self._call("UnifiedDecode", epb.UnifiedDecodeRequest(items=items, session_id=session_id,
                                                                          release_cache_ids=release),
                                self._step_timeout_s)

    async def decode(self, items: Sequence[epb.DecodeItem], num_steps: int, session_id: str = "",
                     release: Sequence[str] = ()) -> epb.DecodeResponse:
        return await self._call("Decode", epb.DecodeRequest(items=items, num_steps=num_steps, session_id=session_id,
                                                            release_cache_ids=release), self._step_timeout_s)

    async def release(self, cache_ids: Sequence[str], session_id: str = "") -> epb.ReleaseCacheResponse:
        return await self._call("ReleaseCache",
                                epb.ReleaseCacheRequest(cache_ids=list(cache_ids), session_id=session_id), 30.0)

    async def create_caches(self, items: Sequence[epb.CreateCacheItem],
                            session_id: str = "") -> epb.CreateCacheResponse:
        return await self._call("CreateCache", epb.CreateCacheRequest(items=items, session_id=session_id),
                                self._control_timeout_s)

    async def list_adapters(self) -> epb.ListAdaptersResponse:
        return await self._call("ListAdapters", epb.ListAdaptersRequest(), self._control_timeout_s)

    async def open_session(self, client_name: str) -> epb.OpenSessionResponse:
        return await self._call("OpenSession", epb.OpenSessionRequest(client_name=client_name),
                                self._control_timeout_s)

    async def keep_alive(self, session_id: str) -> epb.KeepAliveResponse:
        return await self._call("KeepAlive", epb.KeepAliveRequest(session_id=session_id),
                                self._control_timeout_s)

    async def close_session(self, session_id: str) -> epb.CloseSessionResponse:
        return await self._call("CloseSession", epb.CloseSessionRequest(session_id=session_id), 30.0)

    async def import_kv(self, source_address: str, source_cache_id: str, source_session_id: str = "",
                        session_id: str = "", timeout_s: float = 60.0) -> epb.ImportKvResponse:
        """This executor pulls a cache from the executor at source_address (ExportKv there; the bytes never
        pass through the scheduler) into a new cache of session_id (capability "kv_transfer")."""
        export = epb.ExportKvRequest(cache_id=source_cache_id, session_id=source_session_id)
        return await self._call("ImportKv", epb.ImportKvRequest(source_address=source_address, export=export,
                                                                create_cache=True, session_id=session_id), timeout_s)

    def health_watch(self):
        """The executor's health Watch stream (grpc.health.v1): an async iterator of its status changes."""
        self._current()
        return self._health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME), metadata=self._metadata())

    async def healthy(self) -> bool:
        try:
            resp = await self._call("Check", health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                    self._control_timeout_s, health=True)
        except (ExecutorUnreachable, RemoteError):
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def kv_events(self, summary_interval_ms: int = 5000):
        """The executor's KV event stream (SubscribeKvEvents): an async iterator of its messages; raises
        grpc.aio.AioRpcError when it ends with an error (a subscriber that falls behind is dropped)."""
        self._current()
        return self._stub.SubscribeKvEvents(epb.SubscribeKvEventsRequest(summary_interval_ms=summary_interval_ms),
                                            metadata=self._metadata())

    async def close(self) -> None:
        for task in list(self._retired):
            task.cancel()
        await self._channel.close()

    async def _call(self, rpc: str, request, timeout_s: float, health: bool = False):
        """rpc: an ExecutorService method's name (grpc.health.v1's with health=True), looked up on the channel
        in use now."""
        self._current()
        method = getattr(self._health if health else self._stub, rpc)
        try:
            return await method(request, timeout=timeout_s, metadata=self._metadata())
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code in _REFUSED:
                raise ExecutorRefusedCredentials(
                    f"executor {self.address} refused the scheduler's credentials ({code.name}: {exc.details()}); "
                    "check --executor-token-file (and the token's scope) against the executor's "
                    "--auth-token-file") from exc
            if code in _TRANSPORT_FAILURES:
                raise ExecutorUnreachable(f"executor {self.address} is unreachable ({code.name}: {exc.details()}); "
                                          "the scheduler reconnects when it is back") from exc
            raise RemoteError(code.name, f"executor {self.address}: {exc.details()}") from exc
