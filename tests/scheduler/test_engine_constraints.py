"""Constrained requests in the async engine over the in-process executor (tiny random Llama; its outputs are
random, so only the grammar makes them valid): chunked prefill (a mask on the final chunk only: the executor
refuses one elsewhere), preemption under a small KV pool and recompute after the executor's restart leave the
tokens of a clean run; each mask is computed once (prefetched, never recomputed); a token the executor sampled
outside the mask fails the request; no constraint without an executor that applies masks; no drafts."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re

import pytest

from executor_service.in_process_client import InProcessExecutorClient
from scheduler.rpc import codec
from scheduler.structured.grammar import ConstraintKind, ConstraintSpec, GrammarCompiler
from scheduler.request import FinishReason, GenerateRequest, StoppingCriteria
from scheduler.sequence import Sequence
from scheduler.text.tokenizer import ModelTokenizer
from tandem.errors import InvalidRequest, RemoteError, Unsupported
from tandem.generate.v1 import generate_pb2 as pb
from tandem.sampling_params import SamplingParams
from tests.executor_driver import make_executor
from tests.faulty_executor_client import Fault, FaultyExecutorClient
from tests.scheduler.engine_harness import Running, collect, tokens, until
from scheduler.engine.executor_codec import executor_info_from_pb

WORDS = r"[a-z]{2,6}( [a-z]{2,6}){1,3}\."
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n", "tag"],
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["x", "yy"]}}}
PROMPTS = [[5 + (i * 13 + k * 7) % 280 for i in range(46)] for k in range(4)]  # 46 tokens: chunked by 8


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return ModelTokenizer(model_dir)


@pytest.fixture(scope="module")
def grammars(model_dir, tokenizer):
    info = InProcessExecutorClient(make_executor(model_dir, kv_blocks=8)).info_now()
    return GrammarCompiler(tokenizer, info.vocab_size, list(info.eos_token_ids))


def requests(grammars) -> list[GenerateRequest]:
    words = grammars.compile(ConstraintSpec(ConstraintKind.REGEX, WORDS))
    schema = grammars.compile(ConstraintSpec(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA)))
    samplings = [SamplingParams(), SamplingParams(temperature=1.0, seed=3)]
    return [GenerateRequest(f"r{k}", tuple(p), StoppingCriteria(48), samplings[k % 2],
                            constraint=words if k < 2 else schema) for k, p in enumerate(PROMPTS)]


def valid(text: str, k: int) -> bool:
    if k < 2:
        return re.fullmatch(WORDS, text) is not None
    value = json.loads(text)
    return set(value) == {"n", "tag"} and 0 <= value["n"] <= 99 and value["tag"] in ("x", "yy")


async def run(client, tokenizer, reqs, **cfg) -> tuple[list[list], object]:
    async with Running(client, tokenizer, **cfg) as engine:
        outs = [engine.submit(r)[1] for r in reqs]
        return [await collect(o) for o in outs], engine.masks.stats


def text(tokenizer, events) -> str:
    return "".join(e.text for e in events)


def test_chunked_prefill_and_preemption_keep_the_tokens_of_a_roomy_run(model_dir, tokenizer, grammars):
    reqs = requests(grammars)
    roomy, stats = asyncio.run(run(InProcessExecutorClient(make_executor(model_dir, kv_blocks=64)), tokenizer, reqs))
    for k, events in enumerate(roomy):
        assert events[-1].finish_reason is FinishReason.STOP, events[-1]  # the grammar completed
        assert valid(text(tokenizer, events), k), text(tokenizer, events)
    # every mask computed once: the first came with the compiled constraint, then one per token but the last
    assert stats.masks == sum(len(tokens(e)) - 1 for e in roomy)
    # 7 blocks of 16 tokens: two 46-token prompts fit; their outputs cross into a 4th block each: preemptions
    small = InProcessExecutorClient(make_executor(model_dir, kv_blocks=7))
    squeezed, _ = asyncio.run(run(small, tokenizer, reqs, prefill_chunk=8, max_batch_tokens=16))
    assert sum(e[-1].usage.preemptions for e in squeezed) > 0
    assert [tokens(e) for e in squeezed] == [tokens(e) for e in roomy]


def test_a_restart_recomputes_constrained_requests_to_the_same_tokens(model_dir, tokenizer, grammars):
    client = InProcessExecutorClient(make_executor(model_dir, kv_blocks=64))
    reqs = requests(grammars)[:3]
    want, _ = asyncio.run(run(client, tokenizer, reqs))

    async def restarted():
        faulty = FaultyExecutorClient(client, step_faults={4: Fault("unavailable")}, sessions=True)
        async with Running(faulty, tokenizer) as engine:
            outs = [engine.submit(r)[1] for r in reqs]
            await until(lambda: not engine.up, "the executor's loss")
            faulty.restart()
            faulty.down = False
            return [await collect(o) for o in outs]
    got = asyncio.run(restarted())
    assert [tokens(e) for e in got] == [tokens(e) for e in want]
    assert all(e[-1].usage.preemptions == 1 for e in got)


class MaskIgnoringClient(InProcessExecutorClient):
    """An executor that drops every token mask (as one that does not know the field would)."""

    async def unified_decode(self, items, session_id: str = "", release=()):
        for it in items:
            it.ClearField("allowed_tokens")
        return await super().unified_decode(items, session_id, release=release)


def test_a_token_outside_the_mask_fails_the_request(model_dir, tokenizer, grammars):
    fixed = grammars.compile(ConstraintSpec(ConstraintKind.CHOICE, choices=("zq" * 8,)))
    req = GenerateRequest("r", tuple(PROMPTS[0]), StoppingCriteria(20), constraint=fixed)
    (events,), _ = asyncio.run(run(MaskIgnoringClient(make_executor(model_dir, kv_blocks=64)), tokenizer, [req]))
    error = events[-1]
    assert isinstance(error, RemoteError) and error.status_name == "INTERNAL"
    assert "does not allow" in str(error)


def test_constraints_need_an_executor_that_applies_masks(model_dir, tokenizer, grammars):
    info = executor_info_from_pb(InProcessExecutorClient(make_executor(model_dir, kv_blocks=8)).info_now())
    m = pb.GenerateRequest(text="hi", constraint=pb.Constraint(regex="a+"))
    assert codec.request_from_pb(m, tokenizer, info, 8, grammars).constraint is not None
    old = dataclasses.replace(info, capabilities=info.capabilities - {"token_masks"})
    with pytest.raises(Unsupported, match="token_masks"):
        codec.request_from_pb(m, tokenizer, old, 8, grammars)


def test_constrained_sequences_never_draft(grammars):
    c = grammars.compile(ConstraintSpec(ConstraintKind.REGEX, "a+"))
    plain = GenerateRequest("p", (1, 2), StoppingCriteria(4))
    assert Sequence(plain, 0, (2,), 64).allows_drafts
    assert not Sequence(dataclasses.replace(plain, constraint=c), 1, (2,), 64).allows_drafts


def test_a_schema_nested_too_deep_is_invalid_not_internal(grammars):
    """A JSON Schema past llguidance's recursion limit (or past the JSON parser's) is the client's mistake:
    InvalidRequest (INVALID_ARGUMENT / 400), never a ValueError that would surface as INTERNAL / 500."""
    deep: dict = {"type": "object"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(InvalidRequest, match="cannot be compiled"):
        grammars.compile(ConstraintSpec(ConstraintKind.JSON_SCHEMA, json.dumps(deep)))
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        grammars.compile(ConstraintSpec(ConstraintKind.JSON_SCHEMA, "[" * 100_000 + "]" * 100_000))


def test_a_constraint_after_a_marker_leaves_the_tokens_before_it_free(model_dir, tokenizer, grammars):
    """constraint_after (a thinking model's answer, scheduler/reasoning/): the tokens up to and including the
    marker are the free run's, the rest follows the grammar; preemption and recompute keep the tokens; a marker
    that never comes leaves the whole output free."""
    free = GenerateRequest("free", tuple(PROMPTS[0]), StoppingCriteria(24))
    (plain,), _ = asyncio.run(run(InProcessExecutorClient(make_executor(model_dir, kv_blocks=64)), tokenizer, [free]))
    ids = tokens(plain)
    at = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])  # a token's first appearance
    words = grammars.compile(ConstraintSpec(ConstraintKind.REGEX, WORDS))
    gated = dataclasses.replace(free, request_id="gated", constraint=words, constraint_after=(ids[at],))
    never = dataclasses.replace(free, request_id="never", constraint=words, constraint_after=(ids[at], 10**6))
    (got, dormant), _ = asyncio.run(run(InProcessExecutorClient(make_executor(model_dir, kv_blocks=64)), tokenizer,
                                        [gated, never]))
    assert tokens(got)[:at + 1] == ids[:at + 1]
    assert got[-1].finish_reason is FinishReason.STOP
    assert re.fullmatch(WORDS, tokenizer.decode(tokens(got)[at + 1:])), tokenizer.decode(tokens(got)[at + 1:])
    assert tokens(dormant) == ids
    four = [dataclasses.replace(gated, request_id=f"g{k}", prompt_ids=tuple(PROMPTS[k])) for k in range(4)]
    roomy, _ = asyncio.run(run(InProcessExecutorClient(make_executor(model_dir, kv_blocks=64)), tokenizer, four))
    small = InProcessExecutorClient(make_executor(model_dir, kv_blocks=7))
    squeezed, _ = asyncio.run(run(small, tokenizer, four, prefill_chunk=8, max_batch_tokens=16))
    assert sum(e[-1].usage.preemptions for e in squeezed) > 0
    assert [tokens(e) for e in squeezed] == [tokens(e) for e in roomy] and tokens(roomy[0]) == tokens(got)
