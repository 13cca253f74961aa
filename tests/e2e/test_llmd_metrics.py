"""llm-d's model-server protocol on the scheduler's HTTP /metrics (the port an InferencePool targets), real
processes (tiny llama with two PEFT adapters, a scheduler running at most 2 sequences): the vLLM-named gauges
are one series per pod with vLLM's meaning — running / waiting requests, KV usage as 1 - free/total blocks,
the cache config (block size, blocks), and `vllm:lora_requests_info` whose labels name the adapters of the
running and the waiting requests and whose value is the time of the update — read with prometheus_client's
own parser, as the endpoint picker reads them, and checked against what the executor and the requests say."""
from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.executor.v1 import executor_pb2 as epb
from tandem.generate.v1 import generate_pb2 as pb
from tests.grpc_harness import start_for, start_scheduler_for
from tests.lora_fixtures import make_peft_adapter
from tests.scheduler_client import ids_request, wait_kv_free

MAX_RUNNING = 2
LONG = 250  # tokens each request must generate (min = max; the tiny model holds 256): the first two run
# while we look, the other two wait for them


@pytest.fixture(scope="module")
def setup(request, tiny_checkpoint, tmp_path_factory):
    base = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("adapters")
    make_peft_adapter(base, root / "alpha", r=4, alpha=8, seed=1)
    make_peft_adapter(base, root / "beta", r=4, alpha=8, seed=2)
    executor = start_for(request, base, "--kv-blocks", "200", "--adapter-root", str(root), "--adapter",
                         f"alpha={root / 'alpha'}", "--adapter", f"beta={root / 'beta'}",
                         "--max-adapters-on-device", "4")
    scheduler = start_scheduler_for(request, executor.address, "--http-port", "0", "--max-running",
                                    str(MAX_RUNNING), "--served-model-name", "smol")
    return executor, scheduler


def gauges(scheduler) -> dict[str, list[tuple[dict[str, str], float]]]:
    """name -> [(labels, value)] of every vllm: family on the scheduler's HTTP /metrics."""
    with urllib.request.urlopen(f"{scheduler.process.http_url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("vllm:"):
                out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def single(found: dict, name: str) -> tuple[dict[str, str], float]:
    assert len(found.get(name, [])) == 1, f"{name}: one series per pod, got {found.get(name)}"
    return found[name][0]


def test_idle_pod_reports_its_cache_config_and_no_load(setup):
    executor, scheduler = setup
    kv = wait_kv_free(executor.stub)
    g = gauges(scheduler)
    assert single(g, "vllm:num_requests_running")[1] == 0 and single(g, "vllm:num_requests_waiting")[1] == 0
    labels, usage = single(g, "vllm:kv_cache_usage_perc")
    assert usage == 0.0 and labels == {"model_name": "smol", "engine": "0"}
    config, one = single(g, "vllm:cache_config_info")
    assert one == 1.0 and config["block_size"] == str(kv.block_size)
    assert config["num_gpu_blocks"] == str(kv.total_blocks) == "200" and config["enable_prefix_caching"] == "True"
    lora, stamp = single(g, "vllm:lora_requests_info")
    assert lora == {"max_lora": "4", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert abs(stamp - time.time()) < 60  # the time of the update: the picker takes the latest series


def test_running_waiting_and_adapters_follow_the_requests(setup):
    executor, scheduler = setup
    adapters = ["alpha", "", "beta", "beta"]  # the first two run (max 2), the other two wait
    calls, started = [], []
    for n, adapter in enumerate(adapters):
        req = ids_request([1, 5 + n, 9, 33], LONG, adapter=adapter,
                          stopping=pb.StoppingCriteria(max_new_tokens=LONG, min_new_tokens=LONG))
        call = scheduler.stub.Generate(req, timeout=120)
        calls.append(call)
        if n < MAX_RUNNING:
            started.append(next(call))  # running before the next arrives: the order decides who waits

    def drain(call) -> None:  # a cancelled call ends its stream with CANCELLED: that is the point here
        try:
            for _ in call:
                pass
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.CANCELLED, e

    drained = [threading.Thread(target=drain, args=(c,)) for c in calls]
    try:
        deadline = time.monotonic() + 10
        while True:  # the two that wait have reached the scheduler's queue (their calls are asynchronous)
            g = gauges(scheduler)
            if single(g, "vllm:num_requests_waiting")[1] == len(adapters) - MAX_RUNNING:
                break
            assert time.monotonic() < deadline, g
        assert single(g, "vllm:num_requests_running")[1] == MAX_RUNNING
        assert single(g, "vllm:num_requests_waiting")[1] == len(adapters) - MAX_RUNNING
        lora, _ = single(g, "vllm:lora_requests_info")
        assert lora["running_lora_adapters"] == "alpha" and lora["waiting_lora_adapters"] == "beta", lora
        kv = executor.stub.GetInfo(epb.GetInfoRequest()).kv
        usage = single(g, "vllm:kv_cache_usage_perc")[1]
        held = 1 - kv.free_blocks / kv.total_blocks
        # the same blocks (two sequences grow a block per block_size tokens between the two reads)
        assert usage > 0 and abs(usage - held) <= 2 * MAX_RUNNING / kv.total_blocks, (usage, held)
    finally:
        for c in calls:
            c.cancel()
        for t in drained:
            t.start()
        for t in drained:
            t.join(30)
    wait_kv_free(executor.stub)
    g = gauges(scheduler)
    assert single(g, "vllm:num_requests_running")[1] == 0 and single(g, "vllm:num_requests_waiting")[1] == 0
