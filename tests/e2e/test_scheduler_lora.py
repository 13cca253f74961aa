"""LoRA through the whole stack: Generate with `adapter` set streams peft's greedy continuation, base and
adapter requests share batches, GetModelInfo lists adapters loaded at run time, unknown ones are NOT_FOUND."""
from __future__ import annotations

import concurrent.futures as cf

import grpc
import pytest

from tandem.executor.v1 import executor_pb2 as epb
from tandem.generate.v1 import generate_pb2 as pb
from tests.grpc_harness import start_for, start_scheduler_for
from tests.hf_reference import HfReference
from tests.lora_fixtures import PeftReference, make_peft_adapter
from tests.scheduler_client import collect, ids_request, rpc_error, wait_kv_free

PROMPTS = [[1, 5, 9, 33, 44, 100, 7], [1, 250, 17, 3, 99], [1, 8, 8, 120, 64, 31, 200, 11]]
STEPS = 12


@pytest.fixture(scope="module")
def setup(request, tiny_checkpoint, tmp_path_factory):
    base = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("adapters")
    make_peft_adapter(base, root / "alpha", r=8, alpha=16, seed=1)
    make_peft_adapter(base, root / "beta", r=4, alpha=8, target_modules=("q_proj", "v_proj"), seed=2)
    executor = start_for(request, base, "--kv-blocks", "128", "--adapter-root", str(root), "--adapter",
                         f"alpha={root / 'alpha'}")
    scheduler = start_scheduler_for(request, executor.address)
    return base, root, executor, scheduler


def test_adapters_through_the_scheduler(setup):
    base, root, executor, scheduler = setup
    info = scheduler.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert list(info.adapters) == ["alpha"]
    executor.stub.LoadAdapter(epb.LoadAdapterRequest(name="beta", path="beta"))
    assert list(scheduler.stub.GetModelInfo(pb.GetModelInfoRequest()).adapters) == ["alpha", "beta"]

    stop = pb.StoppingCriteria(max_new_tokens=STEPS, ignore_eos=True)
    jobs = [(p, a) for p in PROMPTS for a in ("", "alpha", "beta")]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:  # base and both adapters in the same steps
        results = list(pool.map(lambda j: collect(scheduler.stub, ids_request(j[0], STEPS, stopping=stop,
                                                                              adapter=j[1])), jobs))
    refs = {"": HfReference(base), "alpha": PeftReference(base, root / "alpha"),
            "beta": PeftReference(base, root / "beta")}
    for (prompt, adapter), got in zip(jobs, results):
        assert got.token_ids == refs[adapter].greedy(prompt, STEPS)[0], adapter
    assert len({tuple(r.token_ids) for r in results[:3]}) > 1, "the adapters should change the output"
    wait_kv_free(executor.stub)

    err = rpc_error(lambda: list(scheduler.stub.Generate(ids_request([1, 5], 4, adapter="gamma"))))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "gamma" in err.details()
