"""The token interceptors on real in-process gRPC servers (the executor's thread-pool kind and the scheduler's
asyncio kind) over every handler shape they wrap: unary (health Check), server streaming (health Watch: a
coroutine writing with context.write on asyncio), bidirectional streaming (reflection). Health is open unless
auth_health; reflection needs a token."""
from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tandem.grpc_setup import add_health_reflection_and_ports
from tandem.security.auth import Authenticator
from tandem.security.grpc_auth import AioAuthInterceptor, AuthInterceptor, everyone_user
from tandem.security.tokens import TokenFile

TOKEN = "t" * 32
OK, UNAUTH = grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture(scope="module")
def authenticator(tmp_path_factory) -> Authenticator:
    path = tmp_path_factory.mktemp("auth") / "tokens"
    path.write_text(f"{TOKEN}\n")
    return Authenticator(TokenFile(path))


def _codes(channel: grpc.Channel, metadata) -> dict[str, grpc.StatusCode]:
    """The status of a health Check, the first message of a health Watch, and a reflection listing."""
    stub = health_pb2_grpc.HealthStub(channel)
    calls = {"check": lambda: stub.Check(health_pb2.HealthCheckRequest(), metadata=metadata, timeout=10),
             "watch": lambda: next(stub.Watch(health_pb2.HealthCheckRequest(), metadata=metadata, timeout=10)),
             "reflection": lambda: next(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                 iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=metadata, timeout=10))}
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = OK
        except grpc.RpcError as exc:
            out[name] = exc.code()
    return out


EXPECTED = {  # (auth_health, with token) -> codes
    (False, False): {"check": OK, "watch": OK, "reflection": UNAUTH},
    (False, True): {"check": OK, "watch": OK, "reflection": OK},
    (True, False): {"check": UNAUTH, "watch": UNAUTH, "reflection": UNAUTH},
    (True, True): {"check": OK, "watch": OK, "reflection": OK},
}


@pytest.mark.parametrize("auth_health", [False, True])
def test_thread_pool_server(authenticator, auth_health):
    server = grpc.server(futures.ThreadPoolExecutor(4),
                         interceptors=[AuthInterceptor(authenticator, everyone_user, auth_health)])
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    (address,) = add_health_reflection_and_ports(server, servicer, "x.v1.X", "127.0.0.1", 0, None)
    server.start()
    try:
        with grpc.insecure_channel(address) as channel:
            for with_token in (False, True):
                md = (("authorization", f"Bearer {TOKEN}"),) if with_token else None
                assert _codes(channel, md) == EXPECTED[(auth_health, with_token)]
    finally:
        server.stop(0)


@pytest.mark.parametrize("auth_health", [False, True])
def test_asyncio_server(authenticator, auth_health):
    async def run() -> list[dict]:
        server = grpc.aio.server(interceptors=[AioAuthInterceptor(authenticator, everyone_user, auth_health)])
        servicer = health.aio.HealthServicer()
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        (address,) = add_health_reflection_and_ports(server, servicer, "x.v1.X", "127.0.0.1", 0, None)
        await server.start()
        try:  # a blocking client off the loop: the server runs on it
            return await asyncio.get_running_loop().run_in_executor(None, lambda: [
                _codes(grpc.insecure_channel(address), None),
                _codes(grpc.insecure_channel(address), (("authorization", f"Bearer {TOKEN}"),))])
        finally:
            await server.stop(0)

    without, with_token = asyncio.run(run())
    assert without == EXPECTED[(auth_health, False)] and with_token == EXPECTED[(auth_health, True)]
