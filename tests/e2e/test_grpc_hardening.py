"""Both gRPC servers against malformed input and overload (the gRPC half of the hardening), with real processes: a tiny
llama executor with an adapter root, a scheduler with default limits and one with a low --max-concurrent-rpcs.
Each refusal is a precise status with a plain message, a neighbour request is served, and the KV ends idle.

3. bytes that are not a valid request message -> INVALID_ARGUMENT naming the message type (no class names, no
   traceback), on every method of both servers, noted in the log once per method, not per call;
4. many more concurrent Generate streams than the scheduler takes -> each one tokens or RESOURCE_EXHAUSTED
   naming the limit, none CANCELLED (gRPC core no longer drops calls it holds untaken);
7. a NUL byte, an over-long name or path in LoadAdapter -> INVALID_ARGUMENT; odd ids elsewhere -> NOT_FOUND;
9. a non-loopback --host with tokens but no TLS -> exit 2 naming --insecure, on every port (gRPC, HTTP,
   metrics) of both servers; with --insecure it starts and says so in a warning.
"""
from __future__ import annotations

import asyncio
import collections
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tandem import server_process
from tandem.executor.v1 import executor_pb2 as epb
from tandem.generate.v1 import generate_pb2 as gpb
from tandem.generate.v1 import generate_pb2_grpc
from tests.grpc_harness import start_for, start_scheduler_for
from tests.scheduler_client import collect, rpc_error, wait_kv_free
from tests.security_fixtures import new_token, write_tokens

GENERATE, EXECUTOR = "/tandem.generate.v1.GenerateService/", "/tandem.executor.v1.ExecutorService/"
# Not a valid message of any type: a bad tag, a cut-short string, a cut-short varint, field number 0.
GARBAGE = [b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x08\xff", bytes(range(256)) * 4]
LIMIT = 8  # --max-concurrent-rpcs of the limited scheduler
STREAMS = 1500  # opened at once on one channel: past the limit, and past gRPC core's default backlog (1000)


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory):
    return tmp_path_factory.mktemp("adapters")


@pytest.fixture(scope="module")
def executor(request, model_dir, adapter_root):
    return start_for(request, model_dir, "--kv-blocks", "256", "--adapter-root", str(adapter_root),
                     "--decode-kernel", "torch")


@pytest.fixture(scope="module")
def scheduler(request, executor):
    return start_scheduler_for(request, executor.address)


@pytest.fixture(scope="module")
def limited(request, executor):
    return start_scheduler_for(request, executor.address, "--max-concurrent-rpcs", str(LIMIT))


def greedy(max_new: int = 4) -> gpb.GenerateRequest:
    return gpb.GenerateRequest(text="hello world", stopping=gpb.StoppingCriteria(max_new_tokens=max_new,
                                                                               ignore_eos=True))


def _raw(channel: grpc.Channel, method: str, data: bytes, stream: bool = False) -> grpc.RpcError:
    call = channel.unary_stream(method) if stream else channel.unary_unary(method)  # no serializer: bytes go as-is
    return rpc_error(call, data, timeout=30)


def _plain(details: str) -> None:
    assert "<class" not in details and "Error" not in details and "Traceback" not in details and "/" not in details, \
        details


# ----------------------------------------------------------------------------------------- 3: garbage bytes
def test_garbage_bytes_to_the_scheduler_are_invalid_argument(scheduler):
    for data in GARBAGE:
        for method, message, stream in (("Generate", "GenerateRequest", True), ("Tokenize", "TokenizeRequest", False),
                                        ("GetModelInfo", "GetModelInfoRequest", False)):
            err = _raw(scheduler.channel, GENERATE + method, data, stream)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, err.details())
            assert err.details().startswith(f"the request is not a valid tandem.generate.v1.{message} message: ")
            _plain(err.details().split(": ", 1)[1])
    err = _raw(scheduler.channel, "/grpc.health.v1.Health/Check", GARBAGE[0])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert collect(scheduler.stub, greedy()).token_ids  # the neighbour on the same channel
    log = scheduler.stderr()
    assert "Traceback" not in log and "DecodeError" not in log
    assert log.count(f"{GENERATE}Generate -> INVALID_ARGUMENT: undecodable request bytes") == 1  # not one per call


def test_garbage_bytes_to_the_executor_are_invalid_argument(executor):
    methods = [("GetInfo", False), ("UnifiedDecode", False), ("ReleaseCache", False), ("LoadAdapter", False),
               ("OpenSession", False), ("SubscribeKvEvents", True)]
    for data in GARBAGE:
        for method, stream in methods:
            err = _raw(executor.channel, EXECUTOR + method, data, stream)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, err.details())
            assert err.details().startswith(f"the request is not a valid tandem.executor.v1.{method}Request message")
            _plain(err.details().split(": ", 1)[1])
    assert executor.stub.GetInfo(epb.GetInfoRequest()).model_id
    log = executor.stderr()
    assert "Exception deserializing" not in log and "Traceback" not in log
    assert log.count(f"{EXECUTOR}UnifiedDecode -> INVALID_ARGUMENT: undecodable request bytes") == 1
    wait_kv_free(executor.stub)


# ----------------------------------------------------------------------------------------- 4: overload
async def _storm(address: str, n: int) -> tuple[collections.Counter, collections.Counter]:
    """n Generate streams opened at once on one channel; (outcomes, refusal messages)."""
    outcomes, messages = collections.Counter(), collections.Counter()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)

        async def one() -> None:
            tokens = 0
            try:
                async for msg in stub.Generate(greedy(), timeout=300):
                    tokens += len(msg.token_ids)
                outcomes["OK with tokens" if tokens else "OK without tokens"] += 1
            except grpc.RpcError as exc:
                outcomes[exc.code().name] += 1
                messages[exc.details()] += 1

        await asyncio.gather(*(one() for _ in range(n)))
    return outcomes, messages


def test_overload_is_resource_exhausted_never_a_silent_cancel(limited, executor):
    outcomes, messages = asyncio.run(_storm(limited.address, STREAMS))
    assert set(outcomes) <= {"OK with tokens", "RESOURCE_EXHAUSTED"}, (outcomes, messages.most_common(5))
    assert outcomes["OK with tokens"] >= 1 and outcomes["RESOURCE_EXHAUSTED"] >= 1, outcomes
    ours = f"the scheduler is serving its limit of {LIMIT} calls at once (--max-concurrent-rpcs); retry later"
    assert messages[ours] > 0, messages.most_common(5)
    assert set(messages) == {ours}, messages  # the queue (--max-waiting 1024) is never reached
    assert collect(limited.stub, greedy()).token_ids  # served again once the storm is over
    wait_kv_free(executor.stub)
    assert not any(s.caches for s in executor.stub.ListCaches(epb.ListCachesRequest()).sessions)


def test_the_limit_refuses_at_once_and_health_is_not_counted(limited):
    from grpc_health.v1 import health_pb2_grpc
    calls = [limited.stub.Generate(greedy(200), timeout=120) for _ in range(LIMIT)]
    try:
        for call in calls:  # every place is held: each stream has its first tokens
            assert next(call).token_ids
        err = rpc_error(limited.stub.Tokenize, gpb.TokenizeRequest(text="hi"), timeout=30)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-concurrent-rpcs" in err.details()
        health = health_pb2_grpc.HealthStub(limited.channel)
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        for call in calls:
            call.cancel()


# ----------------------------------------------------------------------------------------- 7: path-ish inputs
@pytest.mark.parametrize("path, words", [("ad\x00apter", "NUL byte"), ("a" * 300, "File name too long"),
                                         ("a/" * 2100, "at most 4096")])
def test_unusable_adapter_paths_are_invalid_argument(executor, path, words):
    err = rpc_error(executor.stub.LoadAdapter, epb.LoadAdapterRequest(name="fuzzed", path=path))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert words in err.details() and "internal" not in err.details()
    assert list(executor.stub.ListAdapters(epb.ListAdaptersRequest()).adapters) == []  # nothing half-loaded
    assert "Traceback" not in executor.stderr()


def test_odd_names_and_ids_are_precise(executor):
    stub = executor.stub
    assert rpc_error(stub.LoadAdapter, epb.LoadAdapterRequest(name="a\x00b", path="x")).code() == \
        grpc.StatusCode.INVALID_ARGUMENT
    for call, req in ((stub.KeepAlive, epb.KeepAliveRequest(session_id="a\x00b")),
                      (stub.ListCaches, epb.ListCachesRequest(session_id="\x00")),
                      (stub.UnloadAdapter, epb.UnloadAdapterRequest(name="\x00")),
                      (stub.TruncateCache, epb.TruncateCacheRequest(cache_id="\x00" * 100, new_len=1))):
        assert rpc_error(call, req).code() == grpc.StatusCode.NOT_FOUND, req
    lease = stub.OpenSession(epb.OpenSessionRequest(client_name="odd\x00name\u202e"))
    stub.CloseSession(epb.CloseSessionRequest(session_id=lease.session_id))
    assert "Traceback" not in executor.stderr()
    wait_kv_free(stub)


# ----------------------------------------------------------------------------------------- 9: exposure
def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    return server_process.run_to_exit(module, *args, timeout=120)  # (started as the suite starts servers)


@pytest.mark.parametrize("module, ports, listening", [
    ("executor_service", ["--port", "0"], "gRPC"),
    ("executor_service", ["--port", "-1", "--uds", "{tmp}/e.sock", "--metrics-port", "0"], "metrics"),
    ("scheduler", ["--port", "0", "--http-port", "0"], "gRPC, HTTP"),
    ("scheduler", ["--port", "-1", "--uds", "{tmp}/s.sock", "--http-port", "0"], "HTTP"),
    ("scheduler", ["--port", "-1", "--uds", "{tmp}/m.sock", "--metrics-port", "0"], "metrics"),
])
def test_tokens_without_tls_on_a_non_loopback_host_refuse_to_start(module, ports, listening, model_dir, tmp_path):
    tokens = write_tokens(tmp_path / "tokens", {new_token(): "admin"})
    where = ["--executor", "127.0.0.1:1"] if module == "scheduler" else ["--model", str(model_dir)]
    run = _run(module, *where, "--host", "0.0.0.0", "--auth-token-file", str(tokens),
               *[p.format(tmp=tmp_path) for p in ports])
    assert run.returncode == 2 and "READY" not in run.stdout, run.stderr[-2000:]
    assert f"refusing to listen on 0.0.0.0 ({listening}), not loopback, without TLS" in run.stderr
    assert "--insecure" in run.stderr and "in clear" in run.stderr and "Traceback" not in run.stderr


def test_insecure_starts_with_a_loud_warning(model_dir, tmp_path):
    tokens = write_tokens(tmp_path / "tokens", {new_token(): "admin"})
    server = server_process.launch_executor(model_dir, "--host", "0.0.0.0", "--auth-token-file", str(tokens),
                                            "--insecure", "--decode-kernel", "torch")
    try:
        assert server.address.startswith("0.0.0.0:")
        assert "WARNING tandem.security: INSECURE: listening on 0.0.0.0 (gRPC) without TLS (--insecure): bearer " \
               "tokens" in server.log()
    finally:
        assert server.stop() == 0
