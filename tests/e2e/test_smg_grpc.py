"""SGLang's gateway smg (the real `smg` 1.13.0 binary from PyPI) routing to Tandem over gRPC, through vLLM's
engine protocol (vllm.grpc.engine.VllmEngine) that the scheduler serves beside GenerateService.

Real processes: two executor + scheduler pairs on the tiny llama and smg in gRPC mode in front of both (one smg
with --policy cache_aware, one with round_robin). Shown: smg detects Tandem as a vLLM worker; streamed chat and
completions through smg give the same greedy text (and tokens, and logprobs) as Tandem's own HTTP front;
cache-aware routing keeps requests that share a long prefix on one scheduler; one scheduler SIGKILLed, requests
keep succeeding through the other, and once it is started again on the same port smg routes to it again; a
client that leaves mid-stream aborts the request on Tandem (its KV freed). Plus the protocol itself through a
plain gRPC client: refused fields are INVALID_ARGUMENT naming them, what Tandem does not do is UNIMPLEMENTED,
GetTokenizer's bundle is the model's tokenizer, Abort ends a stream."""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem import server_process
from tandem.generate.v1 import generate_pb2 as gpb
from tandem.generate.v1 import generate_pb2_grpc
from tandem.vendor.smg import common_pb2 as smg_common
from tandem.vendor.smg import vllm_engine_pb2 as vpb
from tandem.vendor.smg import vllm_engine_pb2_grpc as vpb_grpc
from tests.grpc_harness import GrpcServer, start_for
from tests.scheduler_client import wait_kv_free

SMG = shutil.which("smg", path=str(Path(sys.executable).parent)) or shutil.which("smg")
pytestmark = pytest.mark.skipif(SMG is None, reason="no smg binary: install the test extra (smg==1.13.0)")
MODEL = "tiny"  # the schedulers' --served-model-name: the name smg routes by
MAX_POSITIONS = 4096  # room for generations long enough to be cut mid-stream, or to keep a scheduler busy
READY_S = 90.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Smg:
    """`smg launch` in gRPC mode in front of the given schedulers, on a free port; ready once every worker
    is registered and healthy. model_dir None: smg has no --model-path and fetches the tokenizer from a
    scheduler (GetTokenizer)."""

    def __init__(self, workers: list[str], model_dir: Path | None, policy: str, *extra: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile("w+", prefix="smg-", suffix=".log", delete=False)
        args = [SMG, "launch", "--worker-urls", *(f"grpc://{w}" for w in workers),
                *(["--model-path", str(model_dir)] if model_dir is not None else []), "--policy", policy,
                "--host", "127.0.0.1", "--port", str(self.port),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port()),
                # a lost worker is noticed within seconds, and taken back after one good probe
                "--health-check-interval-secs", "1", "--health-check-timeout-secs", "2",
                "--health-failure-threshold", "1", "--health-success-threshold", "1", "--log-level", "info",
                "--shutdown-grace-period-secs", "2", *extra]
        env = {**os.environ, "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.wait_workers(len(workers))

    def workers(self) -> list[dict]:
        return httpx.get(f"{self.url}/workers", timeout=5).json()["workers"]

    def wait_workers(self, healthy: int, timeout: float = READY_S) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"smg exited with {self.proc.returncode}; log:\n{self.log()}")
            try:
                found = self.workers()
                if sum(w["is_healthy"] for w in found) == healthy:
                    return found
            except (httpx.HTTPError, ValueError, KeyError):
                found = None
            if time.monotonic() > deadline:
                raise AssertionError(f"smg: not {healthy} healthy workers within {timeout:.0f}s ({found}); log:\n"
                                     f"{self.log()}")
            time.sleep(0.1)

    def log(self) -> str:
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")[-20000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
        os.unlink(self._log.name)


class Scheduler:
    """A scheduler that a test may SIGKILL and start again on the same port (the finalizer stops the current
    one and asserts a clean exit for it alone)."""

    def __init__(self, executor_address: str) -> None:
        self.executor_address = executor_address
        self.server = self._start("0")
        self.address = self.server.address

    def _start(self, port: str) -> GrpcServer:
        process = server_process.launch_scheduler(self.executor_address, "--port", port, "--http-port", "0",
                                                  "--served-model-name", MODEL)
        return GrpcServer(process, generate_pb2_grpc.GenerateServiceStub)

    @property
    def http_url(self) -> str:
        return self.server.process.http_url

    def sigkill(self) -> None:
        self.server.channel.close()
        self.server.process.send_signal(signal.SIGKILL)
        self.server.process.proc.wait(timeout=20)
        self.server.process.kill()  # (bookkeeping: no longer a live child)
        self.server._closed = True

    def restart(self) -> None:
        self.server = self._start(self.address.rsplit(":", 1)[1])
        assert self.server.address == self.address

    def served(self) -> float:
        """Requests this scheduler finished (its Prometheus counter, by every finish reason)."""
        return _counter(self.http_url, "tandem:request_success")

    def close(self) -> None:
        self.server.close()


def _gauge(http_url: str, name: str) -> float:
    text = httpx.get(f"{http_url}/metrics", timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name)


def _counter(http_url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{http_url}/metrics", timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == f"{name}_total" and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


@pytest.fixture(scope="module")
def model(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama", config_overrides={"max_position_embeddings": MAX_POSITIONS})


@pytest.fixture(scope="module")
def executors(request, model):
    return [start_for(request, model, "--kv-blocks", "512") for _ in range(2)]


@pytest.fixture(scope="module")
def schedulers(request, executors):
    out = []
    for e in executors:
        s = Scheduler(e.address)
        request.addfinalizer(s.close)
        out.append(s)
    return out


def _smg(request, schedulers, model: Path | None, policy: str, *extra: str) -> Smg:
    router = Smg([s.address for s in schedulers], model, policy, *extra)
    request.addfinalizer(router.close)
    return router


@pytest.fixture(scope="module")
def smg_rr(request, schedulers, model):
    return _smg(request, schedulers, model, "round_robin")


@pytest.fixture(scope="module")
def smg_cache(request, schedulers, model):
    # No load poll within the test (the default, every 10 s, could land mid-test and reset what smg counted): where
    # a prompt matches no worker's prefix, smg then scores the workers by what it dispatched to each
    # (and no --model-path: this smg tokenizes with the files GetTokenizer sends)
    return _smg(request, schedulers, None, "cache_aware", "--load-monitor-interval", "3600")


def _stream(base: str, path: str, body: dict) -> dict:
    """A streamed OpenAI request read to its end: text, finish reason, completion tokens, and (chat, when
    asked) each token's bytes and logprob."""
    out = {"text": "", "finish": None, "tokens": None, "logprobs": []}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{base}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                out["tokens"] = chunk["usage"]["completion_tokens"]
            for c in chunk["choices"]:
                out["text"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
                out["finish"] = c.get("finish_reason") or out["finish"]
                for lp in ((c.get("logprobs") or {}).get("content") or []):
                    out["logprobs"].append((bytes(lp["bytes"]), lp["logprob"]))
    return out


def _same(via_smg: dict, direct: dict) -> None:
    # The random tiny model emits stray byte tokens: a stream that ends inside a UTF-8 sequence is flushed by
    # Tandem as U+FFFD and held back by smg's detokenizer. Everything before it, and every token, is the same.
    assert via_smg["text"].rstrip("\ufffd") == direct["text"].rstrip("\ufffd")
    assert (via_smg["finish"], via_smg["tokens"]) == (direct["finish"], direct["tokens"])
    # smg leaves out the logprobs of a token whose text it holds back (part of a UTF-8 sequence, when it comes
    # alone in a chunk): what it reports is Tandem's, in order, each with the same value
    rest = iter(direct["logprobs"])
    for token, logprob in via_smg["logprobs"]:
        assert any(t == token and abs(v - logprob) < 1e-4 for t, v in rest), (token, logprob, direct["logprobs"])
    assert len(via_smg["logprobs"]) >= len(direct["logprobs"]) // 2


def test_smg_detects_tandem_as_a_vllm_worker(smg_rr, schedulers):
    workers = smg_rr.workers()
    assert sorted(w["url"] for w in workers) == sorted(f"grpc://{s.address}" for s in schedulers)
    for w in workers:
        assert (w["runtime_type"], w["connection_mode"], w["model_id"]) == ("vllm", "grpc", MODEL)
        assert w["labels"]["max_context_length"] == str(MAX_POSITIONS)
    models = httpx.get(f"{smg_rr.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 24}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 40, "stop": ["e"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 24,
                              "logprobs": True, "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Sample"}], "max_tokens": 24,
                              "temperature": 0.9, "seed": 11}),
], ids=["completion", "completion-stop", "chat-logprobs", "chat-seeded"])
def test_streams_through_smg_match_tandem_http(smg_rr, schedulers, path, body):
    body = {"model": MODEL, "temperature": 0, **body}
    direct = _stream(schedulers[0].http_url, path, body)
    assert direct["tokens"] and direct["text"]
    for _ in range(2):  # round robin: once through each scheduler
        _same(_stream(smg_rr.url, path, body), direct)
    if "logprobs" in body:
        assert len(direct["logprobs"]) == direct["tokens"]


def test_cache_aware_routing_keeps_a_shared_prefix_on_one_scheduler(smg_cache, schedulers):
    prefix = "In the beginning the scheduler and the executor agreed on a contract of messages. " * 3

    def complete(prompt: str) -> list[float]:
        """Sends one request through smg; returns how many each scheduler served for it (one 1, one 0)."""
        before = [s.served() for s in schedulers]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"{smg_cache.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return [s.served() - b for s, b in zip(schedulers, before)]

    first = [complete(f"{prefix} Question {i}:") for i in range(4)]
    home = first[0].index(1)
    assert all(f[home] == 1 for f in first), first
    # The control (a policy stuck on one worker would pass the check above too): while a long request with the
    # prefix keeps its scheduler busy, prompts that share nothing go by load (smg's count of what it dispatched:
    # the other scheduler, at least once), and prompts with the prefix still go home (by cache affinity).
    body = {"model": MODEL, "prompt": f"{prefix} A long one:", "max_tokens": MAX_POSITIONS - 256, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{smg_cache.url}/v1/completions", json=body, timeout=60) as busy:
        assert busy.status_code == 200, busy.read()
        lines = busy.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        away = [complete(f"{word} " * 60) for word in ("apple", "river", "stone")]
        again = [complete(f"{prefix} Question {i}:") for i in range(4, 7)]
        still = _gauge(schedulers[home].http_url, "tandem:num_requests_running")
        assert still == 1, "the long request ended before the checks: the control shows nothing"
    assert any(a[home] == 0 for a in away), away
    assert all(a[home] == 1 for a in again), again


def test_client_disconnect_mid_stream_aborts_on_tandem(smg_rr, schedulers, executors):
    before = [_counter(s.http_url, "tandem:request_failure", code="CANCELLED")
              + _counter(s.http_url, "tandem:request_success", finished_reason="aborted") for s in schedulers]
    body = {"model": MODEL, "prompt": "Tell me everything", "max_tokens": MAX_POSITIONS - 64, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{smg_rr.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 3:
                break  # leave: the connection closes with the stream mid-way
    deadline = time.monotonic() + 30
    while True:
        ended = [_counter(s.http_url, "tandem:request_failure", code="CANCELLED")
                 + _counter(s.http_url, "tandem:request_success", finished_reason="aborted") for s in schedulers]
        if sum(ended) > sum(before):
            break
        assert time.monotonic() < deadline, "the request was not aborted on Tandem after the client left"
        time.sleep(0.05)
    for e in executors:
        wait_kv_free(e.stub)


def test_a_scheduler_restart_fails_no_request_and_smg_routes_to_it_again(smg_rr, schedulers):
    victim, survivor = schedulers[1], schedulers[0]
    victim.sigkill()
    body = {"model": MODEL, "prompt": "Still here?", "max_tokens": 4, "temperature": 0}
    before = survivor.served()
    for _ in range(6):  # smg retries a request that meets the dead worker, then stops sending it any
        r = httpx.post(f"{smg_rr.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, (r.text, smg_rr.log())
    assert survivor.served() - before == 6
    smg_rr.wait_workers(healthy=1)

    victim.restart()
    smg_rr.wait_workers(healthy=2)
    deadline = time.monotonic() + 30
    while victim.served() == 0:  # a fresh process: its counters start at 0
        r = httpx.post(f"{smg_rr.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert time.monotonic() < deadline, "smg does not route to the restarted scheduler"


# ---------------------------------------------------------------- the protocol, through a plain gRPC client

@pytest.fixture(scope="module")
def engine(schedulers):
    channel = grpc.insecure_channel(schedulers[0].address)
    yield vpb_grpc.VllmEngineStub(channel)
    channel.close()


def _generate(**sampling) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(request_id="r1", tokenized=vpb.TokenizedInput(input_ids=[5, 6, 7, 8]), stream=True,
                               sampling_params=vpb.SamplingParams(max_tokens=4, **sampling))


@pytest.mark.parametrize("request_, field", [
    (_generate(prompt_logprobs=-1), "prompt_logprobs"),
    (_generate(truncate_prompt_tokens=8), "truncate_prompt_tokens"),
    (_generate(structural_tag="{}"), "structural_tag"),
    (_generate(logprobs=-1), "logprobs"),
    (vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=[5]),
                         mm_inputs=vpb.MultimodalInputs(mm_hashes=["x"])), "mm_inputs"),
    (vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=[5]), kv_transfer_params_json="{}"),
     "kv_transfer_params_json"),
    (_generate(temperature=-1.0), "temperature"),
    (vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=[100000])), "token id 100000"),
], ids=["prompt_logprobs", "truncate_prompt_tokens", "structural_tag", "logprobs-all", "mm_inputs",
        "kv_transfer_params_json", "temperature", "token-id"])
def test_refused_fields_are_invalid_argument_naming_them(engine, request_, field):
    with pytest.raises(grpc.RpcError) as err:
        list(engine.Generate(request_, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()


@pytest.mark.parametrize("call, what", [
    (lambda e: e.FlushCache(smg_common.FlushCacheRequest(), timeout=10), "no flush"),
    (lambda e: list(e.SubscribeKvEvents(smg_common.SubscribeKvEventsRequest(), timeout=10)), "ZMQ"),
], ids=["FlushCache", "SubscribeKvEvents"])
def test_what_tandem_does_not_do_is_unimplemented(engine, call, what):
    with pytest.raises(grpc.RpcError) as err:
        call(engine)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert what in err.value.details()


def test_embed_is_the_last_token_hidden_state_normalised(engine, model):
    """VllmEngine.Embed (docs/agents.md#embeddings-and-rerank): the tiny Llama has no sentence-transformers
    modules.json, so its embedding is the last position's final hidden state, L2-normalised."""
    import torch
    import transformers

    resp = engine.Embed(vpb.EmbedRequest(request_id="e", tokenized=vpb.TokenizedInput(input_ids=[1, 40, 41, 42])),
                        timeout=30)
    assert resp.embedding_dim == len(resp.embedding) == 64 and resp.prompt_tokens == 4
    ref = transformers.AutoModel.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(torch.tensor([[1, 40, 41, 42]])).last_hidden_state[0, -1]
    assert float(torch.nn.functional.cosine_similarity(torch.tensor(list(resp.embedding)), want, dim=0)) >= 0.9999
    with pytest.raises(grpc.RpcError) as err:
        engine.Embed(vpb.EmbedRequest(tokenized=vpb.TokenizedInput(input_ids=[])), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "input_ids" in err.value.details()


def test_get_tokenizer_streams_the_model_tokenizer(engine, model):
    chunks = list(engine.GetTokenizer(smg_common.GetTokenizerRequest(), timeout=30))
    data = b"".join(c.data for c in chunks)
    assert [bool(c.sha256) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        assert zf.read("tokenizer.json") == (model / "tokenizer.json").read_bytes()
        assert "model.safetensors" not in zf.namelist()


def test_model_info_loads_and_health(engine, executors):
    info = engine.GetModelInfo(vpb.GetModelInfoRequest(), timeout=10)
    assert (info.served_model_name, info.max_context_length, info.is_generation) == (MODEL, MAX_POSITIONS, True)
    assert info.model_path == f"tandem://{MODEL}"  # no host path goes out, nor a name smg would look up
    assert engine.HealthCheck(vpb.HealthCheckRequest(), timeout=10).healthy
    loads = engine.GetLoads(vpb.GetLoadsRequest(), timeout=10)
    assert loads.dp_rank_count == 1 and len(loads.loads) == 1 and 0 <= loads.loads[0].token_usage < 1


def test_abort_ends_the_stream_and_frees_its_cache(engine, executors):
    request = _generate(ignore_eos=True)
    request.request_id = "to-abort"
    request.sampling_params.max_tokens = MAX_POSITIONS - 64
    call = engine.Generate(request, timeout=60)
    first = next(call)
    assert first.WhichOneof("response") == "chunk"
    engine.Abort(vpb.AbortRequest(request_ids=["to-abort", "unknown-id"]), timeout=10)
    last = list(call)[-1]
    assert last.complete.finish_reason == "abort"
    wait_kv_free(executors[0].stub)


def test_prompt_logprobs_are_generate_services(engine, schedulers):
    ids = [5, 6, 7, 8, 9]
    request = vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=ids), stream=True, sampling_params=vpb.
                                  SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2))
    first = next(iter(engine.Generate(request, timeout=30))).chunk.input_logprobs
    ours = next(iter(schedulers[0].server.stub.Generate(gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=ids), stopping=gpb.StoppingCriteria(max_new_tokens=2), prompt_logprobs=2),
        timeout=30))).prompt_logprobs
    assert list(first.token_ids) == ids and not first.token_logprobs[0].HasField("value")
    assert [v.value for v in first.token_logprobs[1:]] == pytest.approx([t.logprob for t in ours])
    assert [list(t.token_ids) for t in first.top_logprobs[1:]] == [[a.token_id for a in t.top_logprobs] for t in ours]


def test_the_schedulers_tokens_guard_the_service(request, executors, tmp_path):
    token = "vllm-engine-test-token-0123456789abcdef"
    (tmp_path / "tokens").write_text(f"{token}\n")
    (tmp_path / "tokens").chmod(0o600)
    guarded = server_process.launch_scheduler(executors[0].address, "--auth-token-file", str(tmp_path / "tokens"))
    request.addfinalizer(lambda: guarded.stop() == 0 or pytest.fail(f"unclean exit; log:\n{guarded.log()}"))
    with grpc.insecure_channel(guarded.address) as channel:
        stub = vpb_grpc.VllmEngineStub(channel)
        for call in (lambda **kw: stub.HealthCheck(vpb.HealthCheckRequest(), timeout=10, **kw),
                     lambda **kw: list(stub.Generate(_generate(), timeout=30, **kw))):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert call(metadata=[("authorization", f"Bearer {token}")])


def test_a_draining_scheduler_reports_unhealthy(executors):
    """SIGTERM: while its running requests finish (--grace), HealthCheck says no, so smg stops sending it work."""
    draining = server_process.launch_scheduler(executors[1].address, "--grace", "2")
    try:
        with grpc.insecure_channel(draining.address) as channel:
            stub = vpb_grpc.VllmEngineStub(channel)
            assert stub.HealthCheck(vpb.HealthCheckRequest(), timeout=10).healthy
            request = _generate(ignore_eos=True)
            request.sampling_params.max_tokens = MAX_POSITIONS - 64
            call = stub.Generate(request, timeout=60)
            assert next(call).WhichOneof("response") == "chunk"  # running
            draining.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while (health := stub.HealthCheck(vpb.HealthCheckRequest(), timeout=10)).healthy:
                assert time.monotonic() < deadline, "still healthy after SIGTERM"
                time.sleep(0.02)
            assert "shutting down" in health.message
            assert list(call)[-1].complete.finish_reason == "abort"  # cut at the end of --grace
    finally:
        assert draining.stop() == 0, draining.log()


def test_generate_not_streamed_answers_once_with_every_token(engine):
    request = _generate(logprobs=2, n=2, seed=3, temperature=0.8)
    request.stream = False
    answers = list(engine.Generate(request, timeout=60))
    assert sorted(a.complete.index for a in answers) == [0, 1]
    for a in answers:
        c = a.complete
        assert len(c.output_ids) == c.completion_tokens == 4 and c.finish_reason == "length"
        assert list(c.output_logprobs.token_ids) == list(c.output_ids)
        assert all(len(t.token_ids) == 2 for t in c.output_logprobs.top_logprobs)
