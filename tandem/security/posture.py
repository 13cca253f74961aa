"""Safe by default: a server bound to a non-loopback address without TLS does not start unless told --insecure
(with tokens but no TLS the bearer tokens themselves would travel in clear); and the one line of the startup
log that states what protects it. The rule covers every TCP port a server opens on --host: gRPC, the
scheduler's HTTP front, the metrics port."""
from __future__ import annotations

import ipaddress
from typing import Sequence


class InsecureBinding(ValueError):
    """A non-loopback address without TLS, and no --insecure."""


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and the name localhost; any other name counts as reachable from elsewhere."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, ports: Sequence[str], tls: bool, tokens: bool, insecure: bool) -> str | None:
    """ports: what listens on host over TCP ("gRPC", "HTTP", "metrics"; empty: a Unix socket only). Raises
    InsecureBinding when the rule refuses; returns the warning to log when --insecure let plaintext through
    (None when nothing needs saying)."""
    if not ports or is_loopback(host) or tls:
        return None
    where = f"{host} ({', '.join(ports)})"
    if insecure:
        what = "bearer tokens, prompts and replies" if tokens else "prompts and replies, to anyone who reaches it"
        return (f"INSECURE: listening on {where} without TLS (--insecure): {what} travel in clear over the "
                "network. Give --tls-cert/--tls-key (docs/security.md) unless the network itself is trusted")
    if tokens:
        raise InsecureBinding(
            f"refusing to listen on {where}, not loopback, without TLS: the bearer tokens of --auth-token-file "
            "(and every prompt and reply) would travel in clear, for anyone on the path to read and reuse. Give "
            "--tls-cert/--tls-key (docs/security.md), or --insecure if the network itself is trusted")
    raise InsecureBinding(
        f"refusing to listen on {where}, not loopback, with neither TLS nor tokens: anyone who reaches the port "
        "could generate, read caches and load adapters. Give --tls-cert/--tls-key and --auth-token-file "
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
