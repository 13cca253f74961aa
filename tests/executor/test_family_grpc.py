"""The families through the real executor process (gRPC): one sliding-window family (Mistral) and one MoE family
(Mixtral), default flags (the decode kernel chosen as in production). Greedy tokens and logits equal
transformers' in a batch of two sequences with chunked prefill, and a Mistral sequence four windows long holds
at most window / block_size + 1 blocks (KvUsage and ListCaches say so)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from executor_service.rpc import codec
from tandem.executor.v1 import executor_pb2 as pb
from tests.grpc_harness import start_for
from tests.hf_reference import HfReference, rel_err

KV_BLOCKS = 48
WINDOW = 32
BS = 16
LOGITS = pb.OutputOptions(mode=pb.OUTPUT_MODE_TOKENS_AND_LOGITS)
CASES = {"mistral": dict(sliding_window=WINDOW), "mixtral": {}}


def prompt_of(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(length)]


@pytest.fixture(scope="module", params=list(CASES))
def family(request, family_checkpoint):
    model_dir = family_checkpoint(request.param, **CASES[request.param])
    server = start_for(request, model_dir, "--kv-blocks", str(KV_BLOCKS), "--block-size", str(BS))
    return request.param, model_dir, server.stub


def logits_of(out: pb.SequenceOutput) -> torch.Tensor:
    return torch.from_numpy(np.array(codec.decode_logits(out.logits)))[0]


def test_batch_of_two_matches_transformers(family):
    name, model_dir, stub = family
    info = stub.GetInfo(pb.GetInfoRequest())
    assert info.architecture == {"mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM"}[name]
    assert "native_decode" not in info.capabilities  # both are refused by the native step
    if name == "mixtral":
        assert (info.num_experts, info.num_experts_per_tok, list(info.moe_layers)) == (4, 2, [0, 1])
    hf = HfReference(model_dir)
    prompts = [prompt_of(4 * WINDOW, seed=1), prompt_of(21, seed=2)]
    refs = [hf.greedy(p, 12) for p in prompts]
    caches, fed = ["", ""], [0, 0]
    gen: list[list[int]] = [[], []]
    logits: list[list[torch.Tensor]] = [[], []]
    peak = 0
    while min(len(g) for g in gen) < 12:
        items = []
        for i, p in enumerate(prompts):
            if fed[i] < len(p):
                part = p[fed[i]:fed[i] + BS]
                items.append(pb.UnifiedItem(cache_id=caches[i], token_ids=part, pos_offset=fed[i],
                                            is_final_chunk=fed[i] + len(part) == len(p), output=LOGITS))
            else:
                items.append(pb.UnifiedItem(cache_id=caches[i], token_ids=[gen[i][-1]],
                                            pos_offset=len(p) + len(gen[i]) - 1, is_final_chunk=True, output=LOGITS))
        resp = stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=items))
        for i, (item, res) in enumerate(zip(items, resp.results)):
            assert res.status.code == 0, res.status.message
            caches[i] = res.cache.cache_id
            if fed[i] < len(prompts[i]):
                fed[i] += len(item.token_ids)
            if res.HasField("output"):
                gen[i].append(res.output.tokens[0].token_id)
                logits[i].append(logits_of(res.output))
        listing = stub.ListCaches(pb.ListCachesRequest())
        long_blocks = [c.blocks for s in listing.sessions for c in s.caches if c.cache_id == caches[0]]
        peak = max([peak, *long_blocks])
        assert resp.kv.total_blocks - resp.kv.free_blocks == sum(c.blocks for s in listing.sessions for c in s.caches)
    for i, (ref_tokens, ref_logits) in enumerate(refs):
        assert gen[i][:12] == ref_tokens, (name, i)
        assert max(rel_err(o, r) for o, r in zip(logits[i], ref_logits)) < 1e-4, (name, i)
    if name == "mistral":
        assert peak <= WINDOW // BS + 1
    stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=caches))
    kv = stub.GetInfo(pb.GetInfoRequest()).kv
    assert (kv.free_blocks, kv.active_caches) == (KV_BLOCKS, 0)
