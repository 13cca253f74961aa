"""Ports a test picks before the server that binds them starts (ZMQ's --kv-events endpoints)."""
from __future__ import annotations

import random
import socket


def free_port() -> int:
    """A free port below the ephemeral range (Linux: 32768 up): one handed out by a port-0 bind and released could
    go to another port-0 bind meanwhile (the executor's own metrics server) before the server binds it."""
    while True:
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
