"""The ZMQ endpoints of --kv-events-endpoint / --kv-events-replay-endpoint: parsed, resolved to what binds
or connects, and held to the executor's exposure rule.

`tcp://*:PORT` binds, on the executor's --host (loopback by default, as the gRPC port); `tcp://HOST:PORT`
connects the PUB socket to HOST (vLLM's ZmqEventPublisher: bind when the address has a wildcard, else
connect) and binds the replay ROUTER socket on HOST (vLLM always binds it). ZMQ has no TLS here and the
events carry prompts' token ids, so an address off loopback is refused unless --insecure, whatever TLS the
gRPC port has.

The topic frame defaults to vLLM's own default, the empty string. Consumers compare it exactly:
vllm-router 0.1.17's --kv-event-source subscribes to the topic "" and skips, without a word, every batch
whose topic frame is not exactly "" (a ZMQ SUB matches prefixes; the router then checks the whole frame).
llm-d's KV event pool wants `kv@<pod>@<model>` instead, which a vLLM pod there is given explicitly
(--kv-events-config '{"topic": ...}') and a Tandem pod with --kv-events-topic.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from tandem.security.posture import InsecureBinding, is_loopback

log = logging.getLogger("tandem.executor")
_FORM = re.compile(r"tcp://(\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})")


@dataclass(frozen=True)
class ZmqEndpoint:
    flag: str  # the flag it came from, for messages
    host: str  # "*" (bind on --host) or an address or name
    port: int

    @property
    def binds(self) -> bool:
        return self.host == "*"

    def address(self, bind_host: str) -> str:
        """The ZMQ address to bind or connect: `*` becomes bind_host."""
        host = bind_host if self.binds else self.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # an IPv6 literal
        return f"tcp://{host}:{self.port}"


def parse_endpoint(flag: str, value: str) -> ZmqEndpoint:
    """ValueError naming the flag and the form it wants."""
    m = _FORM.fullmatch(value.strip())
    if m is None:
        raise ValueError(f"{flag} wants tcp://HOST:PORT (HOST '*' to bind on --host, else an address to "
                         f"connect to), got {value!r}")
    port = int(m.group(2))
    if not 1 <= port <= 65535:
        raise ValueError(f"{flag}: port must be 1..65535, got {port}")
    return ZmqEndpoint(flag, m.group(1), port)


def check_exposure(endpoint: ZmqEndpoint, bind_host: str, insecure: bool) -> None:
    """Raises InsecureBinding for an address off loopback without --insecure; warns when --insecure lets it."""
    host = (bind_host if endpoint.binds else endpoint.host).strip("[]")
    if is_loopback(host):
        return
    what = f"{endpoint.flag} {endpoint.address(bind_host)}"
    if not insecure:
        raise InsecureBinding(
            f"refusing {what}: not loopback, and ZMQ KV events travel without TLS or tokens (they carry the "
            "token ids of every cached prompt). Keep it on loopback (tcp://*:PORT binds on --host), or give "
            "--insecure if the network itself is trusted")
    log.warning("INSECURE: %s is not loopback (--insecure): KV events, with prompts' token ids, travel in clear "
                "to anyone who reaches it", what)


@dataclass(frozen=True)
class ZmqKvConfig:
    """--kv-events-endpoint and its companions (README: docs/ecosystem.md, KV events in vLLM's format)."""

    endpoint: str  # tcp://*:PORT (bind on --host) or tcp://HOST:PORT (connect)
    replay_endpoint: str | None = None  # a ROUTER socket for replays; None: no replay
    topic: str = ""  # the topic frame: vLLM's default (empty), what vllm-router's --kv-event-source matches
    replay_buffer: int = 10_000  # batches kept for replay

    def endpoints(self) -> tuple[ZmqEndpoint, ZmqEndpoint | None]:
        """Parsed (ValueError naming the flag): done before the executor listens."""
        pub = parse_endpoint("--kv-events-endpoint", self.endpoint)
        replay = None if self.replay_endpoint is None else \
            parse_endpoint("--kv-events-replay-endpoint", self.replay_endpoint)
        if self.replay_buffer < 1:
            raise ValueError(f"--kv-events-replay-buffer must be >= 1, got {self.replay_buffer}")
        return pub, replay

    def check(self, bind_host: str, insecure: bool) -> None:
        """Parses and applies the exposure rule: ValueError / InsecureBinding before anything listens."""
        for endpoint in self.endpoints():
            if endpoint is not None:
                check_exposure(endpoint, bind_host, insecure)
