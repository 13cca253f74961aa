"""A scheduler SIGTERMed while an HTTP client has stopped reading its stream (real processes): the drain ends the
generation at --grace, the response that cannot be written is closed at the HTTP front's bound, and the process
exits 0 with a clean log — no uvicorn "graceful shutdown exceeded", no traceback. (Streams whose clients keep
reading end with their finish and `[DONE]`: tests/e2e/test_scheduler_resilience.py covers the gRPC side.)"""
from __future__ import annotations

import json
import socket
import time

import pytest

from tests.e2e.test_prometheus_metrics import scrape
from tests.fuzz.http_raw import address, request_bytes
from tests.grpc_harness import start_for, start_scheduler
from tests.scheduler_client import wait_kv_free

CHOICES, TOP = 16, 20  # ~20 KB of SSE per step: megabytes are waiting to be written within a few hundred steps


@pytest.fixture(scope="module")
def executor(request, tiny_checkpoint):
    model = tiny_checkpoint("llama", config_overrides={"max_position_embeddings": 2048})
    return start_for(request, model, "--kv-blocks", "1200")


def _generated(scheduler) -> float:
    return scrape(scheduler).get("tandem:generation_tokens_total", 0.0)


@pytest.mark.serial  # (it measures time)
def test_sigterm_with_a_stream_nobody_reads_exits_0_without_a_traceback(executor):
    scheduler = start_scheduler(executor.address, "--http-port", "0", "--metrics-port", "0", "--grace", "1",
                                "--speculative", "off", "--stream-stall-timeout-s", "600",
                                "--stream-max-buffered", "1000000")
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (before connecting: a small window)
        sock.settimeout(60)
        sock.connect(address(scheduler.process.http_url))
        body = json.dumps({"model": "", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1500,
                           "n": CHOICES, "logprobs": True, "top_logprobs": TOP, "ignore_eos": True,
                           "stream": True}).encode()
        sock.sendall(request_bytes("POST", "/v1/chat/completions", body))
        head = b""
        while b"data: " not in head:  # the status line and the first chunk; then the client reads no more
            head += sock.recv(4096)
        assert head.startswith(b"HTTP/1.1 200"), head[:200]
        deadline = time.monotonic() + 120
        while _generated(scheduler) < CHOICES * 600:  # ~12 MB of events: far past every buffer on the way
            assert time.monotonic() < deadline, "the generation did not get far enough"
            time.sleep(0.2)
        t0 = time.monotonic()
        scheduler.send_sigterm()
        code = scheduler.wait_exit()
        took = time.monotonic() - t0
        log = scheduler.stderr()
        assert code == 0, log
        for bad in ("Traceback", "graceful shutdown exceeded", "Exception in ASGI", "ERROR"):
            assert bad not in log, f"{bad!r} in the log:\n{log[-4000:]}"
        assert "closed 1 HTTP connection(s) whose clients did not read" in log, log[-4000:]
        assert took < 1 + 5 + 10, took  # the grace, the HTTP front's bound, slack for a shared machine
        sock.settimeout(30)  # the connection is closed: what was sent, then the end (never a hang)
        try:
            while sock.recv(1 << 20):
                pass
        except ConnectionResetError:  # (closed with bytes unread: a reset is how TCP says it)
            pass
    finally:
        sock.close()
        scheduler.close()
    wait_kv_free(executor.stub)
