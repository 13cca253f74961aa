"""A block-quantized GGUF file (the tiny Llama in Q8_0, its tokenizer in the file) served through real
processes on its blocks: GetInfo names the formats, the scheduler generates, and under a KV pool too small for
every request at once (preemption, recompute) each request gets the tokens it got alone."""
from __future__ import annotations

import concurrent.futures as cf
import random

import pytest

from tandem.executor.v1 import executor_pb2
from tandem.generate.v1 import generate_pb2 as pb
from tests.gguf_files import write_gguf
from tests.grpc_harness import start_for, start_scheduler_for
from tests.scheduler_client import collect, ids_request, wait_kv_free

SMALL_KV_BLOCKS = 12  # x 16 tokens: 192 tokens for everyone


@pytest.fixture(scope="module")
def stack(request, model_dir, tmp_path_factory):
    path, _ = write_gguf(model_dir, tmp_path_factory.mktemp("gguf") / "tiny-Q8_0.gguf", "Q8_0")
    executor = start_for(request, path, "--kv-blocks", str(SMALL_KV_BLOCKS))
    # (no drafts: a repeat of the first pass's requests would draft from its outputs and need no preemption)
    return executor, start_scheduler_for(request, executor.address, "--speculative", "off")


def test_served_on_its_blocks_with_preemption(stack):
    executor, scheduler = stack
    info = executor.stub.GetInfo(executor_pb2.GetInfoRequest())
    assert info.quantization == "gguf-blocks:Q8_0" and "weight_format=gguf-blocks:Q8_0" in info.kv_fingerprint
    rng = random.Random(7)
    prompts = [[1] + [rng.randrange(3, 400) for _ in range(rng.randrange(4, 40))] for _ in range(8)]
    stop = pb.StoppingCriteria(max_new_tokens=40, ignore_eos=True)
    alone = [collect(scheduler.stub, ids_request(p, 40, stopping=stop)) for p in prompts]
    assert all(len(r.token_ids) == 40 for r in alone) and sum(r.usage.preemptions for r in alone) == 0
    with cf.ThreadPoolExecutor(8) as pool:  # each needs <= 5 blocks; all together far more than 12
        squeezed = list(pool.map(lambda p: collect(scheduler.stub, ids_request(p, 40, stopping=stop)), prompts))
    assert sum(r.usage.preemptions for r in squeezed) > 0, "the pool was meant to be too small for all at once"
    assert [r.token_ids for r in squeezed] == [r.token_ids for r in alone]
    wait_kv_free(executor.stub)
