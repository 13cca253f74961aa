"""What both Tandem servers (the executor's sync server, the scheduler's asyncio one) set up alike."""
from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection


def add_health_reflection_and_ports(server, health_servicer, service_name: str, host: str, port: int,
                                    uds: str | None, credentials: grpc.ServerCredentials | None = None,
                                    with_reflection: bool = True, more_services: tuple[str, ...] = ()) -> list[str]:
    """What both Tandem servers (sync and asyncio) share: grpc.health.v1, reflection (unless turned off), TCP
    (TLS with `credentials`, else plaintext) and/or a Unix socket (plaintext: its file permissions decide who
    may connect; tokens are still checked). more_services: other services the server serves, listed by reflection
    too. Returns the addresses it listens on."""
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if with_reflection:
        reflection.enable_server_reflection(
            (service_name, *more_services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME),
            server)
    addresses = []
    if port >= 0:
        where = f"{host}:{port}"
        bound = server.add_secure_port(where, credentials) if credentials is not None \
            else server.add_insecure_port(where)
        if bound == 0:
            raise OSError(f"cannot listen on {host}:{port} (address in use?)")
        addresses.append(f"{host}:{bound}")
    if uds:
        server.add_insecure_port(f"unix:{uds}")
        addresses.append(f"unix:{uds}")
    if not addresses:
        raise ValueError("nothing to listen on: give --port >= 0 or --uds PATH")
    return addresses
