"""A call that fails changed nothing, shown by injecting faults in process: the sampler or the
model forward raising (a bug, a device OOM) after the KV was reserved, at the first step or a later step of
a multi-step Decode; a call whose deadline passed before it reached the model thread; a reply over the
message limit. After each: every cache's length, tokens, prompt end and registered sampling, the free
blocks and the cache count are as before, and the next call answers as on a fresh executor. On each device
(tests/devices.py), without CUDA graphs (the faults are injected into the PyTorch forward, which a replayed graph
never calls); "as on a fresh executor" compares two executors on the same device, the same arithmetic."""
from __future__ import annotations

import grpc
import pytest
import torch

from executor_service.metrics.op_stats import RpcMetrics
from executor_service.model_thread import ModelThread
from executor_service.rpc.servicer import ExecutorServicer
from executor_service.types import CacheRef, DecodeItem, UnifiedItem
from tandem.errors import DeadlineExceeded, DeviceOutOfMemory, ReplyTooLarge
from tandem.executor.v1 import executor_pb2 as pb
from tandem.sampling_params import SamplingParams
from tandem.status_map import status_for
from tests.devices import Device
from tests.executor_driver import make_executor

PROMPTS = ([5, 6, 7, 8, 9], [10, 11, 12])


class Boom(RuntimeError):
    """The injected fault."""


def fail_on_call(monkeypatch, owner: object, name: str, n: int, exc: BaseException) -> None:
    """owner.name raises exc on its n-th call from now (1-based); the other calls go through."""
    real = getattr(owner, name)
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)


def state(ex) -> tuple:
    """Everything a call may change: per cache (length, tokens, prompt end, sampling, blocks), and the pool."""
    caches = {cid: (s.table.length, list(s.tokens), s.prompt_len, s.sampling, list(s.table.blocks))
              for cid, s in ((c, ex._caches[c]) for c in ex._caches)}
    return caches, ex.kv_usage()


def with_history(model_dir, device: Device):
    """An executor on the device holding PROMPTS' caches."""
    ex = make_executor(model_dir, kv_blocks=24, device=device, cuda_graphs=False)
    for p in PROMPTS:
        ex.prefill(p, sampling=SamplingParams(temperature=0.5, seed=7))
    return ex


@pytest.fixture()
def ex(model_dir, device):
    return with_history(model_dir, device)


def items_of(ex) -> tuple[list[str], list[int]]:
    ids = list(ex._caches)
    return ids, [ex.cache_length(c) for c in ids]


def unified_batch(ex) -> list[UnifiedItem]:
    """Decodes on the existing caches (one sending new sampling), a prompt chunk and a new final prompt."""
    ids, lens = items_of(ex)
    return [UnifiedItem((3,), ids[0], lens[0], sampling=SamplingParams(logit_bias={9: 5.0})),
            UnifiedItem((4,), ids[1], lens[1]),
            UnifiedItem((20,) * 20, None, 0, is_final_chunk=False),
            UnifiedItem((21, 22, 23))]


def answers_as_fresh(ex, model_dir, device: Device) -> None:
    """The same batch on ex and on a fresh executor with the same history: the same tokens."""
    fresh = with_history(model_dir, device)
    got = ex.unified_decode(unified_batch(ex))
    want = fresh.unified_decode(unified_batch(fresh))
    tokens = [[t.token_id for t in r.output.tokens] if r.output else None for r in got]
    assert tokens == [[t.token_id for t in r.output.tokens] if r.output else None for r in want]
    assert all(r.error is None for r in got)
    assert ex.kv_usage() == fresh.kv_usage()


@pytest.mark.parametrize("where", ["sampler", "forward"])
def test_unified_decode_fault_changes_nothing(ex, model_dir, monkeypatch, where, device):
    before = state(ex)
    owner, name = (ex.runner.sampler, "sample") if where == "sampler" else (ex.model, "forward")
    fail_on_call(monkeypatch, owner, name, 1, Boom("injected"))
    with pytest.raises(Boom):
        ex.unified_decode(unified_batch(ex))
    assert state(ex) == before
    monkeypatch.undo()
    answers_as_fresh(ex, model_dir, device)


def test_device_oom_is_resource_exhausted_and_changes_nothing(ex, model_dir, monkeypatch, device):
    before = state(ex)
    fail_on_call(monkeypatch, ex.model, "forward", 1, torch.cuda.OutOfMemoryError("CUDA out of memory (injected)"))
    with pytest.raises(DeviceOutOfMemory, match="4 items and 25 tokens; nothing was written") as err:
        ex.unified_decode(unified_batch(ex))
    assert status_for(err.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert state(ex) == before
    monkeypatch.undo()
    answers_as_fresh(ex, model_dir, device)


@pytest.mark.parametrize("fault", [Boom("injected"), torch.cuda.OutOfMemoryError("injected")], ids=["bug", "oom"])
@pytest.mark.parametrize("step", [1, 3])
def test_multi_step_decode_failing_at_any_step_changes_nothing(ex, model_dir, monkeypatch, fault, step, device):
    """Step `step` of 6 fails (the sampler raises): the earlier steps' writes are taken back too."""
    ids, lens = items_of(ex)
    items = [DecodeItem(CacheRef(c, n), 3, sampling=SamplingParams(logit_bias={9: 1.0})) for c, n in zip(ids, lens)]
    before = state(ex)
    fail_on_call(monkeypatch, ex.runner.sampler, "sample", step, fault)
    with pytest.raises(DeviceOutOfMemory if isinstance(fault, torch.cuda.OutOfMemoryError) else Boom):
        ex.decode(items, num_steps=6)
    assert state(ex) == before
    monkeypatch.undo()
    got = ex.decode(items, num_steps=6)
    fresh = with_history(model_dir, device)
    want = fresh.decode([DecodeItem(CacheRef(c, n), 3, sampling=SamplingParams(logit_bias={9: 1.0}))
                         for c, n in zip(items_of(fresh)[0], lens)], num_steps=6)
    assert [[t.token_id for t in r.output.tokens] for r in got] == [[t.token_id for t in r.output.tokens]
                                                                      for r in want]
    assert ex.kv_usage() == fresh.kv_usage()


class FakeContext:
    """The part of grpc.ServicerContext the servicer reads."""

    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining

    def time_remaining(self) -> float | None:
        return self.remaining


@pytest.fixture()
def servicer(ex):
    thread = ModelThread()
    s = ExecutorServicer(RpcMetrics(), thread, max_reply_bytes=256 << 10)
    s.attach(ex)
    yield s
    thread.shutdown()


def test_a_call_past_its_deadline_is_not_run(ex, servicer):
    ids, lens = items_of(ex)
    before, passes = state(ex), ex.metrics.forward_passes
    decode = pb.DecodeRequest(items=[pb.DecodeItem(cache=pb.CacheRef(cache_id=ids[0], seq_len=lens[0]), token_id=3)])
    calls = [(servicer.Prefill, pb.PrefillRequest(token_ids=[3, 4])), (servicer.Decode, decode),
             (servicer.UnifiedDecode, pb.UnifiedDecodeRequest(items=[pb.UnifiedItem(token_ids=[3],
                                                                                     is_final_chunk=True)])),
             (servicer.ForwardVerify, pb.ForwardVerifyRequest(cache=decode.items[0].cache, token_ids=[3]))]
    for rpc, request in calls:
        with pytest.raises(DeadlineExceeded, match="deadline passed") as err:
            rpc(request, FakeContext(remaining=-0.01))
        assert status_for(err.value) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert state(ex) == before and ex.metrics.forward_passes == passes
    # With time left (or no deadline at all) the same call runs.
    assert servicer.Decode(decode, FakeContext(remaining=30.0)).results[0].cache.seq_len == lens[0] + 1
    assert servicer.Prefill(pb.PrefillRequest(token_ids=[3, 4]), FakeContext(remaining=None)).cache.seq_len == 2


def test_a_reply_over_the_limit_is_refused_before_running(ex, servicer):
    """2 caches x 100 steps x a float32 logits row (4 x 448 bytes): ~0.34 MiB, over the servicer's 0.25 MiB:
    refused before running; in bfloat16 (half) it fits and runs."""
    ids, lens = items_of(ex)
    before, passes = state(ex), ex.metrics.forward_passes
    out = pb.OutputOptions(mode=pb.OUTPUT_MODE_TOKENS_AND_LOGITS)
    request = pb.DecodeRequest(num_steps=100, items=[
        pb.DecodeItem(cache=pb.CacheRef(cache_id=c, seq_len=n), token_id=3, output=out) for c, n in zip(ids, lens)])
    with pytest.raises(ReplyTooLarge, match=r"Decode could take 0\.3 MiB, over this executor's 0\.25 MiB") as err:
        servicer.Decode(request, FakeContext(remaining=None))
    assert status_for(err.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert state(ex) == before and ex.metrics.forward_passes == passes
    for item in request.items:
        item.output.logits_dtype = pb.LOGITS_DTYPE_BFLOAT16
    resp = servicer.Decode(request, FakeContext(remaining=None))
    assert [r.cache.seq_len for r in resp.results] == [n + 100 for n in lens]
    assert resp.ByteSize() < 256 << 10
