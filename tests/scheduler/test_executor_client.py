"""scheduler.executor.client: which gRPC failures mean the executor is lost (only the transport's, and a refusal
of the scheduler's own credentials), and which RESOURCE_EXHAUSTED means KV exhaustion (only the executor's "KV
cache full")."""
from __future__ import annotations

import asyncio
import types

import grpc
import pytest

from scheduler.executor.client import (ExecutorRefusedCredentials, ExecutorUnreachable, GrpcExecutorClient,
                                       is_kv_exhaustion)
from tandem.errors import RemoteError


def _failing(code: grpc.StatusCode, details: str):
    async def method(request, timeout, metadata=None):
        raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)
    return method


@pytest.mark.parametrize("code, lost", [(grpc.StatusCode.UNAVAILABLE, True), (grpc.StatusCode.UNKNOWN, True),
                                        (grpc.StatusCode.DEADLINE_EXCEEDED, False),
                                        (grpc.StatusCode.UNIMPLEMENTED, False), (grpc.StatusCode.NOT_FOUND, False),
                                        (grpc.StatusCode.RESOURCE_EXHAUSTED, False),
                                        (grpc.StatusCode.UNAUTHENTICATED, True),
                                        (grpc.StatusCode.PERMISSION_DENIED, True)])
def test_only_transport_failures_mean_the_executor_is_lost(code, lost):
    async def run():
        client = GrpcExecutorClient("127.0.0.1:1")
        client._stub = types.SimpleNamespace(Rpc=_failing(code, "why"))
        try:
            with pytest.raises(RemoteError if not lost else ExecutorUnreachable) as err:
                await client._call("Rpc", None, 1.0)
            if not lost:  # a slow answer (DEADLINE_EXCEEDED) included: the engine retries it
                assert err.value.status_name == code.name and "why" in str(err.value)
            # The scheduler's own token refused: the executor is unusable until the operator fixes it; the
            # scheduler's clients do not get UNAUTHENTICATED for a fault that is not theirs.
            refused = code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
            assert isinstance(err.value, ExecutorRefusedCredentials) == refused
            if refused:
                assert "--executor-token-file" in str(err.value)
        finally:
            await client.close()
    asyncio.run(run())


def test_only_the_executors_kv_message_is_kv_exhaustion():
    assert is_kv_exhaustion(RemoteError("RESOURCE_EXHAUSTED", "executor x: KV cache full: the request needs 3 "
                                                              "more blocks but only 1 of 64 are free"))
    assert not is_kv_exhaustion(RemoteError("RESOURCE_EXHAUSTED", "Received message larger than max (9 vs. 4)"))
    assert not is_kv_exhaustion(RemoteError("RESOURCE_EXHAUSTED", "CUDA out of memory"))
    assert not is_kv_exhaustion(RemoteError("INVALID_ARGUMENT", "KV cache full"))
