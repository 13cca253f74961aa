"""Versions that mix (the contract is additive): this tree's scheduler over the previous release's executor, and the
previous release's scheduler over this tree's executor, each built from git at test time
(tests/contract/previous_release.py), stream the tokens of the same-version pair whose executor they use (greedy
and seeded), and the newer scheduler sends only what the older executor's GetInfo capabilities allow (a proxy
between them checks every request: tests/capability_proxy.py).

The previous release may equal this tree (nothing landed since): then the pairs above mix nothing, so a third
test plays the oldest executor this scheduler must serve, the current one shown only tandem.capabilities.BASELINE
(its other calls answering UNIMPLEMENTED): the scheduler still streams the same tokens, sends no field or call of a
capability it was not shown, refuses clearly what it cannot do there (constrained output, prompt logprobs) — and
the current executor, serving it, serves a scheduler that sends none of the newer fields, as an older one would.
An executor shown less than the baseline is refused by name. And since an older executor drops a field it does
not know without a word, a static test fails on any request field that is neither read by every executor nor
gated by a capability (tests/capability_proxy.py's FIELD_GATES).
"""
from __future__ import annotations

import concurrent.futures as cf

import grpc
import pytest

from tandem import capabilities as caps
from tandem.common.v1 import common_pb2 as cpb
from tandem.generate.v1 import generate_pb2 as pb
from tandem.executor.v1 import executor_pb2 as epb
from tests.capability_proxy import FIELD_GATES, CapabilityProxy
from tests.contract import previous_release as release
from tests.grpc_harness import start_executor, start_for, start_scheduler
from tests.scheduler_client import collect, ids_request, rpc_error, wait_kv_free

KV = ("--kv-blocks", "128")
# What a scheduler shown every capability surely relies on with these requests (the checker's control case).
SURELY_USED = frozenset({caps.SESSIONS, caps.CREATE_CACHE, caps.REGISTERED_SAMPLING, caps.RELEASE_WITH_STEP})


def _requests() -> list[pb.GenerateRequest]:
    """Greedy and seeded, prompts of 12-40 tokens (two share a 24-token prefix), 8-28 new tokens each (so
    requests end while others run: their releases ride with a step)."""
    shared = [(5 + 11 * k) % 380 + 3 for k in range(24)]
    out = []
    for i in range(6):
        prompt = [1] + (shared if i in (2, 5) else []) + [(40 + 7 * i + 13 * k) % 380 + 3 for k in range(12 + 3 * i)]
        sampling = cpb.SamplingParams(temperature=0.8, top_k=30, seed=500 + i) if i % 3 == 1 else None
        out.append(ids_request(prompt, 0, sampling=sampling,
                               stopping=pb.StoppingCriteria(max_new_tokens=8 + 4 * i, ignore_eos=True)))
    return out


def _tokens(scheduler) -> list[list[int]]:
    reqs = _requests()
    with cf.ThreadPoolExecutor(len(reqs)) as pool:
        return [r.token_ids for r in pool.map(lambda r: collect(scheduler.stub, r), reqs)]


def _run(executor_address: str, source_root=None) -> list[list[int]]:
    with start_scheduler(executor_address, source_root=source_root) as scheduler:
        return _tokens(scheduler)


@pytest.fixture(scope="module")
def old_tree(tmp_path_factory):
    why = release.unavailable_reason()
    if why:
        pytest.skip(why)
    return release.extract(tmp_path_factory.mktemp("previous-release"))


@pytest.fixture(scope="module")
def kernel() -> tuple[str, ...]:
    """Both executors run the same decode step; the torch one where the native library's sources differ (the old
    one would need a build of its own, 1-2 CPU minutes: models/native/library.py keys its cache on them)."""
    return ("--decode-kernel", "torch") if release.differs("models/native") else ()


def _start_old(start, *args, **kw):
    try:
        return start(*args, **kw)
    except RuntimeError as exc:
        note = (" (its dependencies differ from this tree's pyproject.toml: install them in this venv)"
                if release.dependencies_differ() else "")
        raise AssertionError(f"the previous release {release.PREVIOUS_RELEASE[:12]} did not start{note}: {exc}")


@pytest.fixture(scope="module")
def new_executor(request, model_dir, kernel):
    return start_for(request, model_dir, *KV, *kernel)


@pytest.fixture(scope="module")
def old_executor(request, model_dir, kernel, old_tree):
    server = _start_old(start_executor, model_dir, *KV, *kernel, source_root=old_tree)
    request.addfinalizer(server.close)
    return server


@pytest.fixture(scope="module")
def new_reference(new_executor) -> list[list[int]]:
    """This tree's scheduler over this tree's executor."""
    return _run(new_executor.address)


def test_this_scheduler_over_the_previous_executor(old_executor, old_tree):
    reference = _start_old(_run, old_executor.address, source_root=old_tree)  # the previous release alone
    with CapabilityProxy(old_executor.address) as proxy, start_scheduler(proxy.address) as scheduler:
        assert _tokens(scheduler) == reference
        shown = proxy.shown
    assert proxy.violations == []  # every field and call it sent, checked against what the old executor listed
    assert SURELY_USED & shown <= set(proxy.used), proxy.used  # the checker saw the features in use
    wait_kv_free(old_executor.stub)


def test_the_previous_scheduler_over_this_executor(new_executor, new_reference, old_tree):
    assert _start_old(_run, new_executor.address, source_root=old_tree) == new_reference
    wait_kv_free(new_executor.stub)


@pytest.fixture(scope="module")
def oldest(new_executor):
    """This tree's scheduler over this tree's executor shown less than the baseline capabilities (given first: the
    fleet's reference), and shown only the baseline: (the latter's proxy, the scheduler, the former's proxy)."""
    with CapabilityProxy(new_executor.address, hide={caps.UNIFIED_DECODE}) as too_old, \
            CapabilityProxy(new_executor.address, hide=caps.ALL - caps.BASELINE) as proxy, \
            start_scheduler(too_old.address, "--executor", proxy.address) as scheduler:
        yield proxy, scheduler, too_old


def test_a_scheduler_shown_only_the_baseline_streams_the_same_tokens_and_sends_nothing_newer(
        oldest, new_reference, new_executor):
    proxy, scheduler, _ = oldest
    assert _tokens(scheduler) == new_reference
    assert proxy.shown == caps.BASELINE & proxy.shown and caps.UNIFIED_DECODE in proxy.shown
    assert proxy.violations == []
    assert set(proxy.used) <= caps.BASELINE | {caps.SESSIONS, caps.KV_EVENTS}, proxy.used  # (probes only)
    assert proxy.probed["OpenSession"] >= 1  # no session there: the anonymous one
    assert proxy.calls["CreateCache"] == 0 and proxy.calls["Decode"] == 0  # no prefix lookup, no bursts
    wait_kv_free(new_executor.stub)


@pytest.mark.parametrize("field, capability", [
    ("constraint", caps.TOKEN_MASKS), ("prompt_logprobs", caps.PROMPT_LOGPROBS)])
def test_what_the_older_executor_cannot_do_is_refused_by_name(oldest, field, capability):
    _, scheduler, _ = oldest
    extra = {"constraint": pb.Constraint(regex="[a-z]+")} if field == "constraint" else {"prompt_logprobs": 2}
    err = rpc_error(collect, scheduler.stub, ids_request([1, 40, 41, 42], 4, **extra))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert capability in err.details()


def test_an_executor_older_than_the_baseline_is_refused_by_name_while_the_others_serve(oldest):
    """An executor that lacks a baseline capability (from before capabilities existed) would fail every step: the
    scheduler refuses it at once, naming what it lacks, even as the first executor it is given."""
    _, scheduler, too_old = oldest
    executors = scheduler.stub.GetModelInfo(pb.GetModelInfoRequest()).executors
    assert [e.state for e in executors] == [pb.ExecutorStatus.STATE_REFUSED, pb.ExecutorStatus.STATE_SERVING]
    assert "lacks the capabilities ['unified_decode']" in executors[0].reason
    assert len(collect(scheduler.stub, ids_request([1, 40, 41], 4)).token_ids) == 4
    assert too_old.calls["UnifiedDecode"] == too_old.calls["CreateCache"] == 0


def test_the_proxy_records_what_was_not_shown(new_executor):
    """Control: the checker flags a gated field and a gated call sent to an executor that did not list them."""
    from tandem.executor.v1 import executor_pb2_grpc as epb_grpc

    with CapabilityProxy(new_executor.address, hide={caps.RELEASE_WITH_STEP, caps.CREATE_CACHE}) as proxy, \
            grpc.insecure_channel(proxy.address) as channel:
        stub = epb_grpc.ExecutorServiceStub(channel)
        assert caps.RELEASE_WITH_STEP not in stub.GetInfo(epb.GetInfoRequest()).capabilities
        resp = stub.UnifiedDecode(epb.UnifiedDecodeRequest(
            items=[epb.UnifiedItem(token_ids=[1, 5, 6], is_final_chunk=True)], release_cache_ids=["gone"]))
        stub.ReleaseCache(epb.ReleaseCacheRequest(cache_ids=[resp.results[0].cache.cache_id]))
        with pytest.raises(grpc.RpcError) as refused:
            stub.CreateCache(epb.CreateCacheRequest(items=[epb.CreateCacheItem(token_ids=[1, 5])]))
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert proxy.violations == ["UnifiedDecode relied on ['release_with_step'], which GetInfo did not list",
                                "CreateCache relied on ['create_cache'], which GetInfo did not list"]


# The fields of the requests a scheduler sends that every executor reads (since capabilities exist; those of a call
# that is a capability, CALLS, since that capability). The others are FIELD_GATES'. An older executor drops a field
# it does not know without a word, so a field added to these messages is one or the other: read as before when
# dropped (then it goes here), or under a new capability (tandem/capabilities.py) that the scheduler checks before
# setting it, with its entry in FIELD_GATES (tests/capability_proxy.py).
READ_BY_EVERY_EXECUTOR = frozenset({
    "UnifiedDecodeRequest.items", "UnifiedDecodeRequest.session_id",
    "UnifiedItem.cache_id", "UnifiedItem.token_ids", "UnifiedItem.pos_offset", "UnifiedItem.is_final_chunk",
    "UnifiedItem.sampling", "UnifiedItem.output", "UnifiedItem.adapter", "UnifiedItem.prompt_len",
    "DecodeRequest.items", "DecodeRequest.session_id",
    "DecodeItem.cache", "DecodeItem.token_id", "DecodeItem.sampling", "DecodeItem.output", "DecodeItem.adapter",
    "DecodeItem.stop_token_ids",
    "SamplingParams.temperature", "SamplingParams.top_k", "SamplingParams.top_p", "SamplingParams.min_p",
    "SamplingParams.repetition_penalty", "SamplingParams.presence_penalty", "SamplingParams.frequency_penalty",
    "SamplingParams.seed", "SamplingParams.logit_bias",
    "OutputOptions.mode", "OutputOptions.top_logprobs", "OutputOptions.logits_dtype",
    "CacheRef.cache_id", "CacheRef.seq_len",
    "NgramDrafts.max_draft_tokens", "NgramDrafts.ngram_min", "NgramDrafts.ngram_max",  # (under multi_step_drafts)
    "PoolingOptions.task", "PoolingOptions.type", "PoolingOptions.normalize", "PoolingOptions.token_ids",  # (pooling)
    "CreateCacheRequest.items", "CreateCacheRequest.session_id",  # (create_cache)
    "CreateCacheItem.token_ids", "CreateCacheItem.adapter", "CreateCacheItem.cache_salt",
    "ReleaseCacheRequest.cache_ids", "ReleaseCacheRequest.session_id",
    "ImportKvRequest.source_address", "ImportKvRequest.export", "ImportKvRequest.create_cache",  # (kv_transfer)
    "ImportKvRequest.session_id", "ExportKvRequest.cache_id", "ExportKvRequest.block_hashes",
    "ExportKvRequest.max_chunk_bytes", "ExportKvRequest.session_id",
    # (an older exporter drops it and sends no image spans: this tree's importer refuses such a header whose
    # tokens hold the image token, executor_service/kv/transfer/image_spans.py)
    "ExportKvRequest.accept_images",
    "OpenSessionRequest.client_name", "KeepAliveRequest.session_id", "CloseSessionRequest.session_id",  # (sessions)
    "SubscribeKvEventsRequest.summary_interval_ms",  # (kv_events)
    "ImageInput.content_hash", "ImageInput.dtype", "ImageInput.shape", "ImageInput.pixel_values",  # (vision)
    "ImageInput.offset", "ImageInput.length",
})
# What a scheduler calls (and ExportKv, which an executor calls on its peer for ImportKv).
SENT = ("GetInfo", "UnifiedDecode", "Decode", "ReleaseCache", "CreateCache", "ImportKv", "ExportKv", "OpenSession",
        "KeepAlive", "CloseSession", "SubscribeKvEvents")


def _fields(descriptor, out: set[str], seen: set[str]) -> None:
    """Every "Message.field" of descriptor and of the contract's messages in it (map entries left out)."""
    seen.add(descriptor.full_name)
    for field in descriptor.fields:
        out.add(f"{descriptor.name}.{field.name}")
        sub = field.message_type
        if sub is not None and sub.full_name.startswith("tandem.") and not sub.GetOptions().map_entry \
                and sub.full_name not in seen:
            _fields(sub, out, seen)


def test_every_request_field_a_scheduler_sends_is_read_by_every_executor_or_gated_by_a_capability():
    service = epb.DESCRIPTOR.services_by_name["ExecutorService"]
    found: set[str] = set()
    seen: set[str] = set()
    for name in SENT:
        _fields(service.methods_by_name[name].input_type, found, seen)
    gated = {f"{message}.{field}" for message, field in FIELD_GATES}
    assert found - READ_BY_EVERY_EXECUTOR - gated == set(), (
        "a request field an older executor would drop without a word: gate it by a capability (tandem/capabilities.py,"
        " checked by the scheduler before setting it) and add it to FIELD_GATES, or list it above if dropping it"
        " changes nothing")
    assert (READ_BY_EVERY_EXECUTOR | gated) - found == set()  # (no stale names)
    assert READ_BY_EVERY_EXECUTOR & gated == set()
