"""How decode calls run, decided once (executor_service/step/decode_choice.py): one table of flags that do not
combine, each row's refusal naming the flag; on CPU the eager forward without CUDA graphs and the log says why in
one line, --cuda-graphs there is refused, --no-cuda-graphs asks nothing; on CUDA (marked `cuda`, skipped here;
scripts/gpu_check runs it) an executor replaying graphs gives the eager executor's greedy tokens."""
from __future__ import annotations

import logging
import random

import grpc
import pytest
import torch

from executor_service.config import ExecutorConfig
from executor_service.kv.tiers.config import KvTierConfig
from executor_service.step.decode_choice import CONFLICTS, choose_decode, flag_refusal
from models.kv.paged_cache import PagedKvCache
from models.loader import load_model
from tandem.executor.v1 import executor_pb2 as pb


@pytest.fixture(scope="module")
def model_and_kv(model_dir):
    model = load_model(model_dir, "cpu", "float32", progress=False)
    cfg = model.config
    return model, PagedKvCache(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                               torch.device("cpu"))


CLASHES = [  # (flags, the flag named first): one per row of CONFLICTS, in its order
    (dict(deterministic=True, compile=True), "--deterministic: --compile"),
    (dict(deterministic=True, decode_kernel="torch"), "--deterministic: --decode-kernel torch"),
    (dict(deterministic=True, tensor_parallel_size=2), "--deterministic: --tensor-parallel-size > 1"),
    (dict(deterministic=True, adapter_root="/tmp"), "--deterministic: LoRA adapters"),
    (dict(compile=True, decode_kernel="native"), "--compile: --compile is the torch decode step"),
    (dict(cuda_graphs=True, compile=True), "--cuda-graphs: --compile"),
    (dict(tensor_parallel_size=2, compile=True), "--tensor-parallel-size: --compile"),
    (dict(tensor_parallel_size=2, decode_kernel="native"), "--tensor-parallel-size: --decode-kernel native"),
    (dict(tensor_parallel_size=2, adapter_root="/tmp"), "--tensor-parallel-size: LoRA adapters"),
    (dict(tensor_parallel_size=2, kv_tiers=KvTierConfig(host_gb=1.0)), "--tensor-parallel-size: KV tiers"),
    (dict(tensor_parallel_size=2, attention_backend="flex"), "--tensor-parallel-size: the ranks run the gathered"),
    (dict(tensor_parallel_size=2, kv_dtype="bfloat16"), "--tensor-parallel-size: --kv-dtype"),
]


def test_every_row_of_the_table_refuses_its_pair_and_nothing_else(model_dir):
    assert len(CLASHES) == len(CONFLICTS)
    for flags, words in CLASHES:
        why = flag_refusal(ExecutorConfig(model_dir, **flags))
        assert why is not None and why.startswith(words), (flags, why)
        for name in flags:  # each flag alone combines with the defaults
            alone = ExecutorConfig(model_dir, **{name: flags[name]})
            assert flag_refusal(alone) is None, (name, flag_refusal(alone))
    assert "unknown --decode-kernel 'fast'" in flag_refusal(ExecutorConfig(model_dir, decode_kernel="fast"))


def test_cpu_eager_steps_say_why_in_one_line(model_dir, model_and_kv, caplog):
    model, kv = model_and_kv
    with caplog.at_level(logging.INFO, logger="tandem.executor"):
        choice = choose_decode(ExecutorConfig(model_dir, decode_kernel="torch"), model, kv)
    assert choice.step is None and choice.capabilities == ()
    line = "decode calls run the PyTorch forward (--decode-kernel torch; no CUDA graphs: the device is cpu, not CUDA)"
    assert [r.getMessage() for r in caplog.records] == [line]
    assert choose_decode(ExecutorConfig(model_dir, decode_kernel="torch", cuda_graphs=False), model,
                         kv).reason == "the PyTorch forward (--decode-kernel torch; --no-cuda-graphs)"


def test_required_graphs_on_cpu_are_refused(model_dir, model_and_kv):
    model, kv = model_and_kv
    with pytest.raises(ValueError, match="--cuda-graphs cannot run here: the device is cpu, not CUDA"):
        choose_decode(ExecutorConfig(model_dir, cuda_graphs=True), model, kv)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_refusals_on_cuda(model_dir):
    model = load_model(model_dir, "cuda", "float32", progress=False)
    cfg = model.config
    kv = PagedKvCache(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, torch.device("cuda"))
    choice = choose_decode(ExecutorConfig(model_dir, cuda_graph_max_batch=4), model, kv)
    assert choice.capabilities == ("cuda_graphs",) and "CUDA graphs of the PyTorch forward" in choice.reason
    with pytest.raises(ValueError, match="--cuda-graphs: --compile"):
        choose_decode(ExecutorConfig(model_dir, cuda_graphs=True, compile=True), model, kv)
    with pytest.raises(ValueError, match="--deterministic: the native step cannot run here: it runs on CPUs"):
        choose_decode(ExecutorConfig(model_dir, deterministic=True), model, kv)


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
