"""Whether decode steps replay CUDA graphs (executor_service/step/cuda_graph_step.py): on CPU the chosen step stays and
the log says why, --cuda-graphs there is refused, --no-cuda-graphs asks nothing; on CUDA (marked `cuda`, skipped
here; scripts/gpu_check runs it) an executor replaying graphs gives the eager executor's greedy tokens."""
from __future__ import annotations

import logging
import random

import grpc
import pytest
import torch

from executor_service.config import ExecutorConfig
from executor_service.step.cuda_graph_step import cuda_graph_refusal, graph_decode_step
from models.kv_cache import PagedKvCache
from models.loader import load_model
from tandem.executor.v1 import executor_pb2 as pb


@pytest.fixture(scope="module")
def model_and_kv(model_dir):
    model = load_model(model_dir, "cpu", "float32", progress=False)
    cfg = model.config
    return model, PagedKvCache(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                               torch.device("cpu"))


def test_cpu_keeps_the_chosen_step_and_logs_why(model_dir, model_and_kv, caplog):
    model, kv = model_and_kv
    chosen = object()  # whatever executor_service/step/decode_kernel.py chose stays
    with caplog.at_level(logging.INFO, logger="tandem.executor"):
        step, reason = graph_decode_step(ExecutorConfig(model_dir), model, kv, chosen)  # type: ignore[arg-type]
    assert step is chosen and reason == "the device is cpu, not CUDA"
    assert "decode steps do not replay CUDA graphs: the device is cpu, not CUDA" in caplog.text
    step, reason = graph_decode_step(ExecutorConfig(model_dir), model, kv, None)
    assert step is None and reason is not None


def test_required_graphs_on_cpu_are_refused_and_off_asks_nothing(model_dir, model_and_kv):
    model, kv = model_and_kv
    with pytest.raises(ValueError, match="--cuda-graphs cannot run here: the device is cpu, not CUDA"):
        graph_decode_step(ExecutorConfig(model_dir, cuda_graphs=True), model, kv, None)
    assert graph_decode_step(ExecutorConfig(model_dir, cuda_graphs=False), model, kv, None) == (None, None)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_refusals_on_cuda(model_dir):
    model = load_model(model_dir, "cuda", "float32", progress=False)
    cfg = model.config
    kv = PagedKvCache(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, torch.device("cuda"))
    assert cuda_graph_refusal(ExecutorConfig(model_dir), model, kv, None) is None
    assert "--compile" in cuda_graph_refusal(ExecutorConfig(model_dir, compile=True), model, kv, None)
    assert "decode steps run" in cuda_graph_refusal(ExecutorConfig(model_dir), model, kv, object())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_executor_gives_the_eager_tokens(request, model_dir):
    from tests.grpc_harness import start_for
    graphed = start_for(request, model_dir, "--device", "cuda", "--kv-blocks", "64", "--cuda-graph-max-batch", "8")
    eager = start_for(request, model_dir, "--device", "cuda", "--kv-blocks", "64", "--no-cuda-graphs")
    assert "cuda_graphs" in graphed.stub.GetInfo(pb.GetInfoRequest()).capabilities
    assert "cuda_graphs" not in eager.stub.GetInfo(pb.GetInfoRequest()).capabilities
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (5, 17, 33)]  # 3 rows: the bucket of 4, padded

    def run(server) -> list[list[int]]:
        try:
            return calls(server.stub)
        except grpc.RpcError as e:  # the executor's own log says why (a lent GPU's run comes back as text)
            raise AssertionError(f"{e.code()}: {e.details()}; executor log:\n{server.stderr()[-6000:]}") from None

    def calls(stub) -> list[list[int]]:
        firsts = [stub.Prefill(pb.PrefillRequest(token_ids=p)) for p in prompts]
        res = stub.Decode(pb.DecodeRequest(num_steps=12, items=[pb.DecodeItem(
            cache=pb.CacheRef(cache_id=f.cache.cache_id, seq_len=len(p)), token_id=f.output.tokens[0].token_id)
            for f, p in zip(firsts, prompts)]))
        stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[f.cache.cache_id for f in firsts]))
        return [[t.token_id for t in r.output.tokens] for r in res.results]

    assert run(graphed) == run(eager)
