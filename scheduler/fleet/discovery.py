"""Executor addresses from the scheduler's --executor targets: HOST:PORT and unix:PATH stand for themselves;
dns:///NAME:PORT (gRPC's target syntax, e.g. a Kubernetes headless Service) stands for every address NAME
resolves to, looked up again every --resolve-interval seconds so executors that appear later join."""
from __future__ import annotations

import asyncio
import socket

DNS_PREFIX = "dns:///"


def is_dns(target: str) -> bool:
    return target.startswith(DNS_PREFIX)


def split_host_port(hostport: str) -> tuple[str, int]:
    """"name:port" or "[v6]:port" -> (host, port); ValueError naming the target otherwise."""
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"executor target {DNS_PREFIX}{hostport!r} needs NAME:PORT")
    return host.strip("[]"), int(port)


async def resolve(target: str) -> list[str]:
    """The addresses a target stands for now, sorted (a name that does not resolve: none)."""
    if not is_dns(target):
        return [target]
    host, port = split_host_port(target[len(DNS_PREFIX):])
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    out = set()
    for family, _, _, _, sockaddr in infos:
        ip = sockaddr[0]
        out.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return sorted(out)


async def resolve_all(targets: list[str] | tuple[str, ...]) -> list[str]:
    """Every address of every target, once each, in the targets' order."""
    return list(await resolve_named(targets))


async def resolve_named(targets: list[str] | tuple[str, ...]) -> dict[str, str | None]:
    """resolve_all's addresses (in order), each with the DNS name it was found under (None for a HOST:PORT or
    unix: target): TLS checks the executor's certificate against that name, not against the pod IP dialled."""
    named: dict[str, str | None] = {}
    for target, addrs in zip(targets, await asyncio.gather(*(resolve(t) for t in targets))):
        name = split_host_port(target[len(DNS_PREFIX):])[0] if is_dns(target) else None
        for a in addrs:
            named.setdefault(a, name)
    return named
