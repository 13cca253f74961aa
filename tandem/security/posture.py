"""Safe by default: a server bound to a non-loopback address with neither TLS nor tokens does not start unless
told --insecure; and the one line of the startup log that states what protects it."""
from __future__ import annotations

import ipaddress


class InsecureBinding(ValueError):
    """A non-loopback address without TLS or tokens, and no --insecure."""


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and the name localhost; any other name counts as reachable from elsewhere."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, listens_on_tcp: bool, tls: bool, tokens: bool, insecure: bool) -> None:
    if not listens_on_tcp or is_loopback(host) or tls or tokens or insecure:
        return
    raise InsecureBinding(
        f"refusing to listen on {host} (not loopback) with neither TLS nor tokens: anyone who reaches the port "
        "could generate, read caches and load adapters. Give --tls-cert/--tls-key and/or --auth-token-file "
        "(docs/security.md), or --insecure if the network itself is trusted")


def posture_line(tls: bool, mtls: bool, tokens: str | None, reflection: bool, health_open: bool,
                 extra: list[str] | None = None) -> str:
    """e.g. `security: TLS on (mTLS), tokens on (3 tokens, 1 admin), reflection off, health open`.
    tokens: the token file's summary, None when tokens are off."""
    parts = [f"TLS {'on (mTLS)' if mtls else 'on' if tls else 'off'}",
             f"tokens on ({tokens})" if tokens is not None else "tokens off",
             f"reflection {'on' if reflection else 'off'}",
             f"health {'open' if health_open else 'needs a token'}"]
    return "security: " + ", ".join(parts + (extra or []))
