"""A client that stops reading its stream, with real processes: the scheduler (--stream-stall-timeout-s 2) stops
the request and frees its KV on the executor within seconds, counts it, and a request sent beside it runs
unaffected; over HTTP (a streamed chat of 8000 tokens with top-20 logprobs whose client reads the first bytes and then nothing,
the socket left open) and over gRPC (a client process stopped with SIGSTOP mid-stream: a client that merely does not iterate its
stream still has its gRPC core read everything into memory, so nothing stalls and its KV is freed when the
generation ends)."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import openai
import pytest

from tandem.executor.v1 import executor_pb2 as epb
from tandem.generate.v1 import generate_pb2 as pb
from tests.e2e.test_prometheus_metrics import scrape
from tests.grpc_harness import start_for, start_scheduler_for
from tests.scheduler_client import ids_request, wait_kv_free

STALL_S = 2.0


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    """The tiny Llama with room for long generations (8192 positions)."""
    return tiny_checkpoint("llama", config_overrides={"max_position_embeddings": 8192})


@pytest.fixture(scope="module")
def stack(request, model_dir):
    executor = start_for(request, model_dir, "--kv-blocks", "1200")
    scheduler = start_scheduler_for(request, executor.address, "--http-port", "0", "--metrics-port", "0",
                                    "--stream-stall-timeout-s", str(STALL_S), "--speculative", "off")
    return executor, scheduler


def held_caches(executor) -> int:
    return executor.stub.GetInfo(epb.GetInfoRequest()).kv.active_caches


def stalled_http_stream(url: str) -> socket.socket:
    """Sends a streamed chat that would run 8000 tokens with top-20 logprobs (big messages) over a socket with a
    small receive window, reads the first bytes and returns the socket unread from then on."""
    parts = urllib.parse.urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    sock.connect((parts.hostname, parts.port))
    body = json.dumps({"model": "", "messages": [{"role": "user", "content": "hello"}], "stream": True,
                       "max_tokens": 8000, "ignore_eos": True, "logprobs": True, "top_logprobs": 20}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    head = sock.recv(1024)
    assert head.startswith(b"HTTP/1.1 200"), head + sock.recv(1024)
    return sock


def stalls(scheduler) -> float:
    return scrape(scheduler).get("tandem:stream_stalls_total", 0.0)


def wait_until(predicate, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, f"{what} not within {timeout}s"
        time.sleep(0.1)
    return time.monotonic() - t0


def test_a_stalled_http_reader_loses_its_request_and_frees_its_kv(stack):
    executor, scheduler = stack
    before = stalls(scheduler)
    sock = stalled_http_stream(scheduler.process.http_url)
    try:
        wait_until(lambda: held_caches(executor) == 1, 10, "the stalled request's cache")
        client = openai.OpenAI(base_url=f"{scheduler.process.http_url}/v1", api_key="x", max_retries=0, timeout=30)
        t0 = time.monotonic()
        other = client.completions.create(model="", prompt="a b c", max_tokens=8, temperature=0)
        assert other.usage.completion_tokens == 8 and time.monotonic() - t0 < 10  # the rest goes on meanwhile
        took = wait_until(lambda: stalls(scheduler) == before + 1, 60, "the stall")
        wait_kv_free(executor.stub, timeout=10)  # its KV is free though the socket is still open
        assert took < 60
    finally:
        sock.close()
    wait_kv_free(executor.stub)


_FROZEN_CLIENT = """
import sys, grpc
from tandem.generate.v1 import generate_pb2 as pb, generate_pb2_grpc
# (no BDP probing and a small socket buffer: the window stays small, as across a real network)
options = [("grpc.http2.bdp_probe", 0), ("grpc.tcp_receive_buffer_size", 4096)]
stub = generate_pb2_grpc.GenerateServiceStub(grpc.insecure_channel(sys.argv[1], options=options))
req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 5, 9, 13]), top_logprobs=20,
                         stopping=pb.StoppingCriteria(max_new_tokens=8000, ignore_eos=True))
call = stub.Generate(req)
next(call)
print("reading", flush=True)
for _ in call:  # reads on until stopped (SIGSTOP) by the test
    pass
"""


def test_a_frozen_grpc_client_is_stopped_too(stack):
    """A gRPC client process that stops (SIGSTOP) mid-stream: its transport stops reading, the HTTP/2 window
    fills, and the scheduler stops the request and frees its KV while the client is still stopped."""
    executor, scheduler = stack
    before = stalls(scheduler)
    client = subprocess.Popen([sys.executable, "-c", _FROZEN_CLIENT, scheduler.address], stdout=subprocess.PIPE,
                              text=True, cwd=Path(__file__).resolve().parents[2])
    try:
        assert client.stdout.readline().strip() == "reading"
        client.send_signal(signal.SIGSTOP)
        wait_until(lambda: stalls(scheduler) == before + 1, 60, "the stall")
        wait_kv_free(executor.stub, timeout=10)
        assert client.poll() is None  # (still stopped: the scheduler did not wait for it)
    finally:
        client.send_signal(signal.SIGCONT)
        client.kill()
        client.wait(10)
    wait_kv_free(executor.stub)
