"""The real vllm-router 0.1.17 (`--policy kv_aware`) in front of two Tandem schedulers, each over its own
executor publishing KV events on ZMQ (--kv-events-endpoint, --kv-events-replay-endpoint, the default topic):
a prefix warmed on one executor directly (through its scheduler's HTTP port) draws the router's requests that
start with it to that executor's scheduler, and another prefix warmed on the other draws its own requests
there, so one warm prefix does not pull every request; after one executor is restarted at the same addresses
the router sees the new incarnation, its events resume, and a prefix warmed on the new process draws its
requests there. Where each request went is read from each scheduler's own Prometheus counter
(tandem:request_success_total), and the router's answer reports the cached prompt tokens.

The router is told nothing but where the events are (--kv-event-source URL=ENDPOINT); it matches prompts by
tokenizing them itself (VLLM_ROUTER_TOKENIZER) and hashing the blocks' token ids. It reads only batches whose
topic frame is exactly "" (vLLM's default, Tandem's default): with any other topic it credited nothing. A test
waits for the router to have applied a batch by reading its debug log (`... sequence advanced source=URL
rank=0 seq=N`), the sequence number found on the executor's replay socket."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from tests.ports import free_port
from tests.grpc_harness import start_for, start_scheduler_for
from tests.vllm_kv_event_defs import BlockStored, replay

BS = 16  # the executors' block size, given to the router as --kv-event-block-size
MODEL = "tiny"
ROUTER_BIN = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")
_ADVANCED = re.compile(r"sequence advanced source=(\S+) rank=\d+ seq=(\d+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")




class Pod:
    """One executor (fixed gRPC and ZMQ ports, so it can be restarted at the same addresses) and its
    scheduler with an HTTP port."""

    def __init__(self, request, model_dir: Path) -> None:
        self.request, self.model_dir = request, model_dir
        self.grpc_port, self.pub, self.rep = free_port(), free_port(), free_port()
        self.executor = self.start_executor()
        self.scheduler = start_scheduler_for(request, self.executor.address, "--http-port", "0",
                                             "--served-model-name", MODEL)
        self.url = self.scheduler.process.http_url

    def start_executor(self):
        return start_for(self.request, self.model_dir, "--port", str(self.grpc_port), "--kv-blocks", "256",
                         "--kv-events-endpoint", f"tcp://*:{self.pub}",
                         "--kv-events-replay-endpoint", f"tcp://*:{self.rep}")

    def restart_executor(self) -> None:
        self.executor.close()  # SIGTERM: its caches and its publisher go with it
        self.executor = self.start_executor()

    def served(self) -> float:
        """Requests this scheduler finished (any reason), from its own /metrics."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "tandem:request_success_total")

    def stored_seq(self, ctx: zmq.Context, tokens_start: list[int] | None = None) -> int:
        """The last batch sequence number on this executor's replay socket that stored blocks (whose token
        ids start with tokens_start, when given); polls until one is there (the publisher thread sends it
        a moment after the step)."""
        for _ in range(200):
            seqs = [seq for _, seq, batch in replay(ctx, f"tcp://127.0.0.1:{self.rep}", 0)
                    for e in batch.events if isinstance(e, BlockStored)
                    and (tokens_start is None or e.token_ids[:len(tokens_start)] == tokens_start)]
            if seqs:
                return max(seqs)
            time.sleep(0.02)
        raise AssertionError(f"{self.url}: no stored blocks on the replay socket")


class Router:
    def __init__(self, pods: list[Pod], model_dir: Path, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        args = [ROUTER_BIN, "--policy", "kv_aware", "--host", "127.0.0.1", "--port", str(self.port),
                "--prometheus-port", str(free_port()), "--log-level", "debug",
                "--worker-urls", *[p.url for p in pods]]
        for p in pods:
            args += ["--kv-event-source", f"{p.url}=tcp://127.0.0.1:{p.pub}",
                     "--kv-event-replay-source", f"{p.url}=tcp://127.0.0.1:{p.rep}"]
        args += ["--kv-event-block-size", str(BS), "--kv-event-model", MODEL]
        env = dict(os.environ, VLLM_ROUTER_TOKENIZER=str(model_dir))
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(args, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, f"vllm-router exited ({self.proc.returncode}):\n{self.log()}"
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, f"vllm-router not healthy in 60 s:\n{self.log()}"
                time.sleep(0.1)

    def log(self, start: int = 0) -> str:
        return _ANSI.sub("", self.log_path.read_text(errors="replace")[start:])

    def log_size(self) -> int:
        return len(self.log_path.read_text(errors="replace"))

    def wait_for(self, pattern: str, after: int, timeout_s: float = 20) -> int:
        """Until pattern shows in the log past `after`; returns the offset just past the match."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = re.search(pattern, self.log(after))
            if m is not None:
                return after + m.end()
            assert time.monotonic() < deadline, f"no {pattern!r} in vllm-router's log:\n{self.log()[-4000:]}"
            time.sleep(0.02)

    def wait_applied(self, source: str, seq: int, after: int = 0, timeout_s: float = 20) -> None:
        """Until the router's log says it applied batch `seq` (or a later one) of source, in log text past
        `after` (a restarted source counts from 0 again)."""
        deadline = time.monotonic() + timeout_s
        while True:
            done = [int(n) for url, n in _ADVANCED.findall(self.log(after)) if url == source]
            if done and max(done) >= seq:
                return
            assert time.monotonic() < deadline, \
                f"vllm-router did not apply batch {seq} of {source} in {timeout_s} s:\n{self.log()[-4000:]}"
            time.sleep(0.02)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def complete(base_url: str, prompt: str) -> dict:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}).encode()
    req = urllib.request.Request(f"{base_url}/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{base_url}: HTTP {exc.code}: {exc.read()[:500]!r}") from None


def prefix(word: str) -> str:
    """Six or more full blocks (the tiny model holds 256 tokens) that share nothing with another word's prefix
    after the first few tokens."""
    return " ".join(f"{word}{i}" for i in range(20))


def tokens_of(model_dir: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids


@pytest.fixture(scope="module")
def setup(request, model_dir, tmp_path_factory):
    if ROUTER_BIN is None:
        pytest.fail("vllm-router is not installed (the test extra pins vllm-router==0.1.17)")
    pods = [Pod(request, model_dir), Pod(request, model_dir)]
    router = Router(pods, model_dir, tmp_path_factory.mktemp("router") / "router.log")
    request.addfinalizer(router.close)
    ctx = zmq.Context()
    request.addfinalizer(ctx.term)
    return pods, router, ctx


def warm(pod: Pod, router: Router, ctx: zmq.Context, model_dir: Path, text: str) -> None:
    """Sends text to pod's scheduler directly, then waits until the router applied the batch that stored
    its blocks."""
    complete(pod.url, text)
    seq = pod.stored_seq(ctx, tokens_of(model_dir, text)[:BS])
    router.wait_applied(pod.url, seq)


def route(router: Router, pods: list[Pod], prompts: list[str]) -> list[tuple[int, int]]:
    """Sends each prompt through the router, one at a time; per prompt, the pod index that served it and the
    cached prompt tokens the answer reports."""
    out = []
    for prompt in prompts:
        before = [p.served() for p in pods]
        usage = complete(router.url, prompt)["usage"]
        gained = [i for i, p in enumerate(pods) if p.served() > before[i]]
        assert len(gained) == 1, (prompt[:40], gained)
        out.append((gained[0], usage["prompt_tokens_details"]["cached_tokens"]))
    return out


def test_requests_follow_the_prefix_each_executor_holds(setup, model_dir):
    pods, router, ctx = setup
    warm(pods[0], router, ctx, model_dir, prefix("alpha") + " warm")
    warm(pods[1], router, ctx, model_dir, prefix("beta") + " warm")
    prompts = [prefix(word) + f" then question {k}" for k in range(3) for word in ("alpha", "beta")]
    got = route(router, pods, prompts)
    # alpha's requests go where alpha was warmed, beta's where beta was: neither warm prefix pulls them all
    assert [pod for pod, _ in got] == [0, 1] * 3, got
    # and each found its prefix's full blocks cached there
    full = {word: len(tokens_of(model_dir, prefix(word))) // BS * BS for word in ("alpha", "beta")}
    assert [cached >= full[word] for (_, cached), word in zip(got, ["alpha", "beta"] * 3)] == [True] * 6, \
        (got, full)
    credited = [int(n) for n in re.findall(r"credited_prefix_tokens=(\d+)", router.log())]
    assert len(credited) >= len(prompts) and min(credited[-len(prompts):]) >= min(full.values()), credited


def test_router_follows_an_executor_restart(setup, model_dir):
    pods, router, ctx = setup
    pod = pods[1]
    for k in range(4):  # the old incarnation's sequence numbers run ahead of what the new one will send
        complete(pod.url, prefix(f"fill{k}"))
    router.wait_applied(pod.url, pod.stored_seq(ctx))
    mark = router.log_size()
    pod.restart_executor()  # the same gRPC and ZMQ addresses: the scheduler and the router reconnect
    gamma = prefix("gamma") + " warm"
    complete(pod.url, gamma)
    # the router notices the sequence numbers starting over, drops what it knew of the old process, and
    # applies the new one's batches (a replay fills what it missed while reconnecting)
    restarted = router.wait_for(rf"kv_index {re.escape(pod.url)}: restart seq \d+ < \d+", mark)
    router.wait_applied(pod.url, pod.stored_seq(ctx, tokens_of(model_dir, gamma)[:BS]), restarted)
    got = route(router, pods, [prefix("gamma") + " after restart", prefix("alpha") + " still there"])
    assert [p for p, _ in got] == [1, 0], got
    assert router.proc.poll() is None


def test_chat_goes_through_the_router(setup):
    """vllm-router 0.1.17 adds SGLang's chat fields (no_stop_trim, separate_reasoning, stream_reasoning,
    return_hidden_states, ...) to every chat request it forwards: served at their defaults, not refused."""
    _, router, _ = setup
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{router.url}/v1/chat/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            answer = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"HTTP {exc.code}: {exc.read()[:500]!r}") from None
    assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] == 2, answer
