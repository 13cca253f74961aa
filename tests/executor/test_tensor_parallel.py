"""Tensor parallelism through real processes: `--tensor-parallel-size 2` and `4` (gloo, one machine:
rank 0 starts its workers) give the TP=1 executor's greedy tokens and logits within 1e-4 on four families (Llama
with tied embeddings, Qwen3's q/k norms, Gemma 2's soft caps and sandwich norms, Qwen3-MoE's experts split by
rank), through chunked prefill, batched decode, drafts, prompt logprobs, a truncation into a shared block
(copy-on-write on every rank) and prefix-cache reuse (tests/executor/tp_scenario.py); TP=1 is an in-process
executor. TP=4 runs Qwen3-MoE by default, the other three families under --long. A shard holds about 1/N of
the weights. Faults: a rank that never joins, or cannot reach rank 0, fails the start naming it; a worker
SIGKILLed mid-stream takes rank 0 down (exit 3) and a scheduler recomputes every request on its other
executor; a worker exits when rank 0 is SIGKILLed; sizes that do not divide the heads, and LoRA, are refused."""
from __future__ import annotations

import concurrent.futures as cf
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from executor_service.in_process_client import InProcessExecutorClient
from executor_service.tp.channel import EXIT_GROUP_DOWN
from models.loader import load_model
from models.parallel.shard import Shard, shard_model
from tandem import server_process
from tandem.executor.v1 import executor_pb2 as epb
from tandem.generate.v1 import generate_pb2 as pb
from tests.executor.tp_scenario import run_scenario
from tests.executor_driver import make_executor
from tests.grpc_harness import start_executor, start_for, start_scheduler_for
from tests.scheduler_client import collect, ids_request

HEADS = dict(num_attention_heads=8, num_key_value_heads=4)  # 4 KV heads: TP=4 gives each rank one
FAMILIES = ["llama", "qwen3", "gemma2", "qwen3_moe"]
ARGS = ("--kv-blocks", "64", "--threads", "1")


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint, family_checkpoint):
    def make(family: str) -> Path:
        if family == "gemma2":
            return family_checkpoint("gemma2", **HEADS)
        return tiny_checkpoint(family, config_overrides=HEADS)
    return make


class LocalStub:
    """The scenario's RPCs over an in-process TP=1 Executor, through the servers' codec (in_process_client.py):
    the reference costs no server start."""

    def __init__(self, model_dir: Path) -> None:
        self.ex = make_executor(model_dir, kv_blocks=64)
        self.client = InProcessExecutorClient(self.ex)

    def UnifiedDecode(self, request, timeout=None):  # noqa: N802  (the stub's names)
        return self.client.unified_decode_now(request.items)

    def CreateCache(self, request, timeout=None):  # noqa: N802
        return self.client.create_caches_now(request.items)

    def ReleaseCache(self, request, timeout=None):  # noqa: N802
        return self.client.release_now(request.cache_ids)

    def TruncateCache(self, request, timeout=None):  # noqa: N802
        return self.ex.truncate_cache(request.cache_id, request.new_len)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """family -> the TP=1 executor's scenario run."""
    runs = {}

    def get(family: str):
        if family not in runs:
            runs[family] = run_scenario(LocalStub(checkpoint(family)))
        return runs[family]
    return get


def _compare(got, want) -> None:
    assert got.tokens == want.tokens
    assert len(got.logits) == len(want.logits)
    worst = max(float(np.abs(a - b).max()) for a, b in zip(got.logits, want.logits))
    assert worst < 1e-4, worst


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_equals_tp1_token_for_token_and_logits_within_1e_4(family, checkpoint, reference):
    with start_executor(checkpoint(family), *ARGS, "--tensor-parallel-size", "2") as server:
        info = server.stub.GetInfo(epb.GetInfoRequest())
        assert info.tensor_parallel_size == 2 and info.num_kv_heads == 4  # the whole model's heads
        assert "tensor_parallel=2 ranks, not transferable" in info.kv_fingerprint  # ImportKv never matches it
        got = run_scenario(server.stub)
    _compare(got, reference(family))


@pytest.mark.parametrize("family", ["qwen3_moe"])  # two experts per rank; the others under --long
def test_tp4_equals_tp1(family, checkpoint, reference):
    with start_executor(checkpoint(family), *ARGS, "--tensor-parallel-size", "4") as server:
        got = run_scenario(server.stub)
    _compare(got, reference(family))


@pytest.mark.long
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_tp4_equals_tp1_more_families(family, checkpoint, reference):
    with start_executor(checkpoint(family), *ARGS, "--tensor-parallel-size", "4") as server:
        got = run_scenario(server.stub)
    _compare(got, reference(family))


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_a_shard_holds_about_a_quarter_of_the_weights_at_tp4(family, checkpoint):
    def weight_bytes(model) -> int:
        return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    whole = weight_bytes(load_model(checkpoint(family), "cpu", progress=False))
    for rank in (0, 3):
        model = load_model(checkpoint(family), "cpu", progress=False)
        shard_model(model, Shard(rank, 4))
        part = weight_bytes(model)
        assert whole / 4 <= part < whole / 4 * 1.15, (rank, part, whole)  # norms and the router stay whole


def _run(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return server_process.run_to_exit("executor_service", *args, timeout=timeout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_rank_that_never_joins_fails_the_start_naming_it(model_dir):
    port = _free_port()
    start = time.monotonic()
    done = _run("--model", str(model_dir), "--port", "0", "--tensor-parallel-size", "2",
                "--tp-master", f"127.0.0.1:{port}", "--tp-rank", "0", "--tp-join-timeout", "2")
    assert done.returncode == 2, done.stderr
    assert "tensor-parallel rank 1 did not join within 2 s" in done.stderr
    assert time.monotonic() - start < 60


def test_a_worker_that_cannot_reach_rank_0_fails_naming_the_rendezvous(model_dir):
    port = _free_port()
    done = _run("--model", str(model_dir), "--tensor-parallel-size", "2", "--tp-master", f"127.0.0.1:{port}",
                "--tp-rank", "1", "--tp-join-timeout", "2")
    assert done.returncode == 2, done.stderr
    assert f"tensor-parallel rank 1 could not reach rank 0's rendezvous at 127.0.0.1:{port} within 2 s" in done.stderr


def test_a_size_that_does_not_divide_the_heads_is_refused_before_any_worker_starts(model_dir):
    done = _run("--model", str(model_dir), "--port", "0", "--tensor-parallel-size", "3")
    assert done.returncode == 2
    assert "do not both divide by --tensor-parallel-size 3" in done.stderr
    assert "joined" not in done.stderr


def test_lora_is_refused_with_a_reason(model_dir, tmp_path):
    done = _run("--model", str(model_dir), "--port", "0", "--tensor-parallel-size", "2",
                "--adapter-root", str(tmp_path))
    assert done.returncode == 2
    assert "LoRA adapters (--adapter, --adapter-root) are not sharded" in done.stderr


def _workers(tp) -> list[int]:
    """The pids of the workers rank 0 started, as it logs them (the suite's fork server makes them its siblings,
    not its children)."""
    return [int(pid) for pid in re.findall(r"tensor-parallel rank \d+ started \(pid (\d+)\)", tp.stderr())]


def test_a_worker_sigkilled_mid_stream_takes_rank_0_down_and_the_scheduler_recomputes_elsewhere(request, model_dir):
    """(Also: an idle group outlives --tp-timeout.)"""
    # --tp-timeout 4 and an idle pause longer than it: the heartbeat keeps idle workers within the bound
    tp = start_executor(model_dir, *ARGS, "--tensor-parallel-size", "2", "--tp-timeout", "4")
    request.addfinalizer(lambda: tp.process.kill())
    other = start_for(request, model_dir, *ARGS)
    scheduler = start_scheduler_for(request, tp.address, "--executor", other.address)
    time.sleep(6)
    assert tp.proc.poll() is None, tp.stderr()
    stop = pb.StoppingCriteria(max_new_tokens=40, ignore_eos=True)
    reqs = [ids_request([1, 90 + n, 17, 5 * n + 2], 0, stopping=stop) for n in range(8)]
    with cf.ThreadPoolExecutor(8) as pool:
        clean = list(pool.map(lambda r: collect(scheduler.stub, r), reqs))
    calls = [scheduler.stub.Generate(r, timeout=120) for r in reqs]
    firsts = [next(c) for c in calls]  # every stream is running, on both executors
    (worker,) = _workers(tp)
    subprocess.run(["kill", "-9", str(worker)], check=True)
    killed = time.monotonic()
    assert tp.process.wait_exit(timeout=30) == EXIT_GROUP_DOWN
    assert time.monotonic() - killed < 10  # the watchdog polls every 0.2 s
    assert "rank 1" in tp.stderr() and "the group is down" in tp.stderr()
    moved = 0
    for want, first, call in zip(clean, firsts, calls):
        rest = list(call)  # no error: a pause at most
        ids = list(first.token_ids) + [t for m in rest for t in m.token_ids]
        assert ids == want.token_ids  # exactly the clean run's tokens: none lost, none repeated
        moved += rest[-1].usage.preemptions  # recomputed on the other executor
    assert moved > 0, "no stream was running on the tensor-parallel executor"


def _alive(pid: int) -> bool:
    try:
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State:"))
    except FileNotFoundError:
        return False
    return "Z" not in state.split()[1]  # a zombie has exited


@pytest.mark.parametrize("start", ["forked", pytest.param("fresh", marks=pytest.mark.fresh_process)])
def test_the_workers_exit_when_rank_0_is_sigkilled(model_dir, start, request):
    """forked: the suite's fork server starts rank 0 and its worker (siblings); fresh: rank 0 a fresh interpreter
    that starts its worker itself (its child), as outside the suite."""
    if start == "forked" and request.config.getoption("--no-fork-server"):
        pytest.skip("--no-fork-server: every server starts fresh")
    tp = start_executor(model_dir, *ARGS, "--tensor-parallel-size", "2")
    try:
        (worker,) = _workers(tp)
        parent = int(Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert (parent == tp.proc.pid) == (start == "fresh"), (parent, tp.proc.pid)
        tp.process.kill()  # SIGKILL: rank 0 says nothing to its workers
        deadline = time.monotonic() + 10  # the parent check runs every 0.5 s
        while _alive(worker):
            assert time.monotonic() < deadline, "the worker outlived rank 0"
            time.sleep(0.1)
    finally:
        tp.channel.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores")
def test_local_ranks_each_get_their_slice_of_cpu_cores(model_dir):
    """--cpu-cores with TP on one machine: rank 0 and the worker it starts run every thread on their own half."""
    first, second = sorted(os.sched_getaffinity(0))[:2]
    tp = start_executor(model_dir, "--kv-blocks", "64", "--tensor-parallel-size", "2",
                        "--cpu-cores", f"{first},{second}")
    try:
        assert tp.stub.GetInfo(epb.GetInfoRequest()).tensor_parallel_size == 2
        (worker,) = _workers(tp)
        for pid, core in ((tp.proc.pid, first), (worker, second)):
            for tid in os.listdir(f"/proc/{pid}/task"):
                assert os.sched_getaffinity(int(tid)) == {core}, (pid, tid)
    finally:
        tp.close()


def test_a_shard_is_cut_on_the_host_before_it_moves_to_its_device(model_dir):
    """load_shard for a device other than the CPU (CUDA in service; the meta device stands in here): the rank's
    device receives the cut shard only, never the whole model."""
    from executor_service.config import ExecutorConfig
    from executor_service.tp.stack import load_shard
    whole = load_model(model_dir, "cpu", "float32", progress=False)
    shard = load_shard(ExecutorConfig(model_dir, dtype="float32"), Shard(0, 2), torch.device("meta"), progress=False)
    assert {p.device.type for p in shard.parameters()} == {"meta"}
    q_whole = whole.model.layers[0].self_attn.qkv_proj.weight.shape[0]
    assert shard.model.layers[0].self_attn.qkv_proj.weight.shape[0] == q_whole // 2
    assert shard.rotary.inv_freq.device.type == "meta"


def test_layers_are_cut_as_they_load_so_one_layer_at_most_is_whole(checkpoint, monkeypatch):
    """load_model's on_layer (what a rank loads with): when layer k is handed over, the layers before it are cut
    already and those after it not read yet (still on the meta device), so the whole fused q/k/v and stacked
    experts of one layer at most exist at a time; the result equals loading whole and cutting."""
    from models.parallel.shard import shard_layer
    model_dir = checkpoint("qwen3_moe")
    shard = Shard(1, 2)
    seen = []

    def on_layer(layer) -> None:
        layers = list(model.model.layers)
        k = layers.index(layer)
        seen.append(k)
        assert all(p.device.type == "meta" for later in layers[k + 1:] for p in later.parameters())
        assert all(isinstance(earlier.mlp.experts_gate_up, torch.nn.Parameter) and earlier.mlp.num_experts
                   == layer.mlp.num_experts // 2 for earlier in layers[:k])
        shard_layer(layer, shard)

    import models.loader as loader
    built = loader.DecoderModel

    def capture(cfg):  # the real class; kept so that on_layer can look at the other layers of the model
        nonlocal model
        model = built(cfg)
        return model

    model = None
    monkeypatch.setattr(loader, "DecoderModel", capture)
    cut = loader.load_model(model_dir, "cpu", "float32", progress=False, on_layer=on_layer)
    shard_model(cut, shard, layers_cut=True)
    assert seen == list(range(len(cut.model.layers)))
    whole = load_model(model_dir, "cpu", "float32", progress=False)
    shard_model(whole, shard)
    a, b = cut.state_dict(), whole.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert cut.model.layers[0].mlp.expert_tokens.shape == whole.model.layers[0].mlp.expert_tokens.shape
