"""GrpcExecutorClient as a TLS client (scheduler → executor) against a real in-process gRPC server with mTLS
and tokens: it presents its client certificate and its token on every call (health included), and after its
certificate files are replaced (SIGHUP's reload_now) its next call goes on a new channel with the new files,
without a restart."""
from __future__ import annotations

import asyncio
import shutil

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from scheduler.executor.client import SERVICE_NAME, ExecutorRefusedCredentials, GrpcExecutorClient
from tandem.security.auth import Authenticator
from tandem.security.grpc_auth import AioAuthInterceptor, everyone_user
from tandem.security.tls import ClientTls, client_paths
from tandem.security.tokens import ClientToken, TokenFile
from tests.security_fixtures import make_pki

TOKEN = "s" * 32


def test_client_certificate_token_and_rotation(tmp_path):
    pki = make_pki(tmp_path / "pki")
    (tmp_path / "tokens").write_text(f"{TOKEN} admin\n")
    files = tmp_path / "client"
    files.mkdir()
    cert, key = pki.client()  # signed by the CA the server does NOT accept (it takes the other CA's clients)
    shutil.copy(cert, files / "client.pem")
    shutil.copy(key, files / "client.key")

    async def run() -> tuple[bool, bool, bool]:
        server = grpc.aio.server(interceptors=[AioAuthInterceptor(Authenticator(TokenFile(tmp_path / "tokens")),
                                                                  everyone_user, auth_health=True)])
        servicer = health.aio.HealthServicer()
        await servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        server_cert, server_key = pki.server()
        credentials = grpc.ssl_server_credentials([(server_key.read_bytes(), server_cert.read_bytes())],
                                                  root_certificates=pki.other.ca.read_bytes(),
                                                  require_client_auth=True)
        port = server.add_secure_port("127.0.0.1:0", credentials)
        await server.start()
        tls = ClientTls(client_paths(pki.ca, files / "client.pem", files / "client.key"))
        without_token = GrpcExecutorClient(f"localhost:{port}", tls=tls, control_timeout_s=5)
        client = GrpcExecutorClient(f"localhost:{port}", tls=tls, token=ClientToken(tmp_path / "tokens"),
                                    control_timeout_s=5)
        try:
            refused = await client.healthy()  # the handshake fails: a client certificate of the wrong CA
            other_cert, other_key = pki.other.client()
            shutil.copy(other_cert, files / "client.pem")
            shutil.copy(other_key, files / "client.key")
            tls.reload_now()  # SIGHUP
            rotated = await client.healthy()
            try:  # the same certificate, no token: refused by the token check, after the handshake
                await without_token._call("Check", health_pb2.HealthCheckRequest(service=SERVICE_NAME), 5, health=True)
                no_token = "answered"
            except ExecutorRefusedCredentials as exc:
                no_token = str(exc)
            return refused, rotated, no_token
        finally:
            await client.close()
            await without_token.close()
            await server.stop(0)

    refused, rotated, no_token = asyncio.run(run())
    assert (refused, rotated) == (False, True)
    assert "UNAUTHENTICATED" in no_token and "--executor-token-file" in no_token
