"""--kv-dtype other than the weights' and --cuda-graphs on CPU, against real executor processes (tiny Llama, float32
weights): a float32-KV executor (the reference), a bfloat16-KV one (gathered attention) and an fp8_e4m3-KV one
(flex attention). GetInfo reports the KV dtype and the attention backend, the pool's bytes are half and a quarter
of float32's for the same blocks, decode steps run the PyTorch forward (the native kernel reads the weights'
dtype only), greedy tokens follow the float32 executor's; the refusals exit 2 with their reason."""
from __future__ import annotations

import random
import subprocess

import pytest

from tandem import server_process
from tandem.executor.v1 import executor_pb2 as pb
from tests.grpc_harness import start_for

KV_BLOCKS = 32
# Greedy tokens equal to the float32-KV executor's, measured on this prompt: bfloat16 the first 6, fp8_e4m3 (3
# mantissa bits) the first 4, before a near tie of the random tiny model's flat logits flips (the logits' error
# bounds, and the argmax wherever the top two are apart, are tests/models/test_kv_dtype.py's).
STEPS = 16
SAME_TOKENS = {"bfloat16": 6, "fp8_e4m3": 4}


@pytest.fixture(scope="module")
def executors(request, model_dir):
    common = ("--kv-blocks", str(KV_BLOCKS))
    return {"float32": start_for(request, model_dir, *common, "--kv-dtype", "float32"),
            "bfloat16": start_for(request, model_dir, *common, "--kv-dtype", "bfloat16"),
            "fp8_e4m3": start_for(request, model_dir, *common, "--kv-dtype", "fp8_e4m3",
                                  "--attention-backend", "flex")}


def _greedy(stub, prompt: list[int]) -> list[int]:
    first = stub.Prefill(pb.PrefillRequest(token_ids=prompt))
    try:
        (d,) = stub.Decode(pb.DecodeRequest(num_steps=STEPS, items=[pb.DecodeItem(
            cache=pb.CacheRef(cache_id=first.cache.cache_id, seq_len=len(prompt)),
            token_id=first.output.tokens[0].token_id)])).results
        return [first.output.tokens[0].token_id] + [t.token_id for t in d.output.tokens]
    finally:
        stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[first.cache.cache_id]))


def test_info_reports_the_kv_dtype_backend_and_smaller_pool(executors):
    infos = {name: s.stub.GetInfo(pb.GetInfoRequest()) for name, s in executors.items()}
    for name, info in infos.items():
        assert info.dtype == "float32" and info.kv_dtype == name
        assert info.kv_pool.blocks == KV_BLOCKS
        assert "cuda_graphs" not in info.capabilities  # a CPU executor never replays graphs
    assert [infos[n].attention_backend for n in infos] == ["gathered", "gathered", "flex"]
    full = infos["float32"].kv_pool.bytes
    assert infos["bfloat16"].kv_pool.bytes * 2 == full and infos["fp8_e4m3"].kv_pool.bytes * 4 == full
    # the native CPU kernel reads a pool in the weights' dtype only: the converted executors decode through the
    # PyTorch forward (the log says why)
    assert "native_decode" not in infos["bfloat16"].capabilities
    assert "native_decode" not in infos["fp8_e4m3"].capabilities
    assert infos["bfloat16"].kv_fingerprint != full and infos["bfloat16"].kv_fingerprint != infos["float32"].kv_fingerprint


def test_greedy_tokens_follow_the_float32_kv_executor(executors):
    rng = random.Random(3)
    prompt = [rng.randrange(3, 400) for _ in range(40)]  # 3 blocks: the decode steps cross a block boundary
    want = _greedy(executors["float32"].stub, prompt)
    assert len(want) == STEPS + 1
    for name, n in SAME_TOKENS.items():
        got = _greedy(executors[name].stub, prompt)
        assert got[:n] == want[:n], (name, got, want)
        assert got == _greedy(executors[name].stub, prompt)  # repeatable


def _exit_of(model_dir, *args: str) -> subprocess.CompletedProcess:
    return server_process.run_to_exit("executor_service", "--model", str(model_dir), "--port", "0",
                                      "--kv-blocks", "8", *args, timeout=180)


def test_native_decode_kernel_with_another_kv_dtype_exits_2(model_dir):
    done = _exit_of(model_dir, "--kv-dtype", "bfloat16", "--decode-kernel", "native")
    assert done.returncode == 2, done.stderr
    assert "--decode-kernel native: the native step cannot run here" in done.stderr and "not the model's dtype" in done.stderr


def test_cuda_graphs_required_on_cpu_exits_2(model_dir):
    done = _exit_of(model_dir, "--cuda-graphs")
    assert done.returncode == 2 and "--cuda-graphs cannot run here: the device is cpu, not CUDA" in done.stderr, \
        done.stderr
