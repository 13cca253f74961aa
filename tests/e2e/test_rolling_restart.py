"""A rolling restart of a 2-executor fleet onto a new build loses no request (docs/operations.md#upgrading-a-fleet).

A scheduler drives two executors of the previous release (tests/contract/previous_release.py, built from git; this
tree's when the history is not there) under a steady load of streaming (gRPC Generate) and non-streaming (the
OpenAI client's completions) requests, greedy and seeded. Each executor in turn, while it runs requests, is told
to stop (SIGTERM: it drains, the scheduler moves its streams with their KV to the other one), and this tree's
executor is started on its port; once the scheduler serves it again, the next one goes. Every request completes,
with exactly the tokens of a run without restarts, nothing fails, and afterwards every KV block of both is free.
In the middle the fleet mixes releases, and streams move between them.
"""
from __future__ import annotations

import random
import re
import socket
import threading
import time
import urllib.request

import openai
import pytest

from tandem.common.v1 import common_pb2 as cpb
from tandem.generate.v1 import generate_pb2 as pb
from tests.contract import previous_release as release
from tests.grpc_harness import GrpcServer, start_executor, start_scheduler_for
from tests.scheduler_client import collect, ids_request, wait_kv_free

KV = ("--kv-blocks", "160", "--session-ttl", "3")
CLIENTS = 4  # clients, each sending a request THINK_S after its last one ended: about two on each executor
THINK_S = 0.1  # (a steady load, not a saturating one: the suite's cores are shared)
_URL = re.compile(r"metrics on (https?://\S+/metrics)")
_SAMPLE = re.compile(r"^(tandem:[a-z_]+) ([0-9.e+-]+)$", re.M)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _counter(scheduler: GrpcServer, name: str) -> float:
    with urllib.request.urlopen(_URL.search(scheduler.stderr()).group(1), timeout=10) as resp:
        return sum(float(m.group(2)) for m in _SAMPLE.finditer(resp.read().decode()) if m.group(1) == name)


# (prompt, new tokens, seed or None, over HTTP): gRPC ones alternate greedy and seeded; HTTP ones are greedy
KINDS = [([1] + [(60 + 7 * i + 13 * k) % 380 + 3 for k in range(20 + 6 * i)], 24 + 4 * i,
          (700 + i) if i % 4 == 1 else None, i % 2 == 0) for i in range(8)]


def _run(scheduler: GrpcServer, client: openai.OpenAI, kind: int) -> list[int]:
    prompt, new_tokens, seed, http = KINDS[kind]
    if http:
        done = client.completions.create(model="", prompt=prompt, max_tokens=new_tokens, temperature=0, logprobs=1,
                                         extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        return [int(t.removeprefix("token_id:")) for t in done.choices[0].logprobs.tokens]
    sampling = cpb.SamplingParams(temperature=0.8, top_k=30, seed=seed) if seed is not None else None
    stop = pb.StoppingCriteria(max_new_tokens=new_tokens, ignore_eos=True)
    return collect(scheduler.stub, ids_request(prompt, 0, sampling=sampling, stopping=stop), timeout=90).token_ids


class Load:
    """CLIENTS threads, each sending one request after another (kinds in a random order) until stopped."""

    def __init__(self, scheduler: GrpcServer, client: openai.OpenAI) -> None:
        self.scheduler, self.client = scheduler, client
        self.done: list[tuple[int, list[int]]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(CLIENTS)]
        for t in self._threads:
            t.start()

    def _loop(self, seed: int) -> None:
        order = random.Random(seed)
        while not self._stop.is_set():
            kind = order.randrange(len(KINDS))
            try:
                self.done.append((kind, _run(self.scheduler, self.client, kind)))
            except Exception as exc:  # every failure is the test's finding
                self.errors.append(f"kind {kind}: {type(exc).__name__}: {exc}")
            self._stop.wait(THINK_S)

    def wait_for(self, completed: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.done) < completed:
            assert time.monotonic() < deadline, f"{len(self.done)} requests completed; errors: {self.errors}"
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """(the build the fleet runs first, the build it is restarted onto): source roots (None: this tree)."""
    if release.unavailable_reason() is not None:
        return None, None  # restarted onto the same build: still a rolling restart
    return release.extract(tmp_path_factory.mktemp("previous-release")), None


def _serving(scheduler: GrpcServer) -> list[pb.ExecutorStatus]:
    return list(scheduler.stub.GetModelInfo(pb.GetModelInfoRequest()).executors)


def _wait_until(what: str, condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_rolling_restart_onto_a_new_build_loses_no_request(request, model_dir, builds):
    old, new = builds
    kernel = ("--decode-kernel", "torch") if old is not None and release.differs("models/native") else ()
    ports = [_free_port(), _free_port()]
    fleet = [start_executor(model_dir, "--port", str(p), *KV, *kernel, source_root=old) for p in ports]
    request.addfinalizer(lambda: [e.close() for e in fleet])
    scheduler = start_scheduler_for(request, fleet[0].address, "--executor", fleet[1].address, "--http-port", "0",
                                    "--metrics-port", "0")
    client = openai.OpenAI(base_url=f"{scheduler.process.http_url}/v1", api_key="unused", max_retries=0, timeout=90)
    before = [_run(scheduler, client, kind) for kind in range(len(KINDS))]  # one at a time, no restart
    moved = _counter(scheduler, "tandem:requests_migrated_total")

    load = Load(scheduler, client)
    try:
        load.wait_for(CLIENTS)
        for i, port in enumerate(ports):
            _wait_until(f"no request runs on executor {i}", lambda: _serving(scheduler)[i].running > 0)
            fleet[i].send_sigterm()  # it drains: its streams move to the other one
            assert fleet[i].wait_exit() == 0, fleet[i].stderr()
            fleet[i].close()
            fleet[i] = start_executor(model_dir, "--port", str(port), *KV, *kernel, source_root=new)
            _wait_until(f"the restarted executor {i} did not rejoin", lambda: all(
                e.state == pb.ExecutorStatus.STATE_SERVING for e in _serving(scheduler)))
            completed = len(load.done)
            load.wait_for(completed + CLIENTS)  # served on the new fleet before the next one goes
    finally:
        load.stop()

    assert load.errors == []
    after = [_run(scheduler, client, kind) for kind in range(len(KINDS))]  # the new build's tokens
    assert after == before, "the two builds' executors sample different tokens: compare releases whose do not"
    wrong = [kind for kind, tokens in load.done if tokens != before[kind]]
    assert wrong == [], f"{len(wrong)} of {len(load.done)} requests streamed other tokens (kinds {sorted(set(wrong))})"
    assert _counter(scheduler, "tandem:requests_migrated_total") > moved  # streams moved off the draining ones
    for executor in fleet:
        wait_kv_free(executor.stub)
