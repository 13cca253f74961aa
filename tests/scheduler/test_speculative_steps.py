"""Speculative steps through the scheduler against the in-process executor (a tiny random Llama): the policy
driven step by step as the engine drives it, then the async engine itself. Drafts come from an oracle
proposer (a DraftProposer that knows the greedy continuation, and spoils the drafts of chosen calls), so
how many tokens each step accepts is known: several tokens per step, the speculator adapting, a stop token
or the length limit inside an accepted run, min_new_tokens holding drafts back, and in the engine a stop
string inside an accepted run, several tokens per stream message, and usage's drafted / accepted tokens."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from executor_service.in_process_client import InProcessExecutorClient
from scheduler.engine import executor_codec as codec
from scheduler.config import SchedulerConfig
from scheduler.engine.policy import SchedulingPolicy
from scheduler.request import Delta, FinishReason, GenerateRequest, StoppingCriteria
from scheduler.sequence import Sequence
from scheduler.config import BurstConfig, SpeculativeConfig
from scheduler.text.tokenizer import ModelTokenizer
from tandem.codec import kv_usage_from_pb
from tests.executor_driver import greedy_run, make_executor
from tests.scheduler.engine_harness import Running, collect, tokens

PROMPT = [5, 17, 33, 8, 91, 120, 7, 64, 3, 250, 11, 42]
NEW = 30
SPEC = SpeculativeConfig("ngram", num_tokens=4)


@pytest.fixture(scope="module")
def reference(model_dir) -> list[int]:
    """The greedy continuation of PROMPT (the executor driven directly, one token per step)."""
    _, out, _ = greedy_run(make_executor(model_dir, kv_blocks=64), PROMPT, NEW + 8)
    return out


@pytest.fixture
def client(model_dir):
    return InProcessExecutorClient(make_executor(model_dir, kv_blocks=64))


class OracleProposer:
    """Drafts the reference continuation; the drafts of the calls in `spoil` (call number -> how many stay
    right) turn wrong after that many tokens. Records every call's max_tokens and the sequences forgotten."""

    def __init__(self, continuation: list[int], spoil: dict[int, int] | None = None) -> None:
        self.full = PROMPT + continuation
        self.spoil = spoil or {}
        self.asked: list[int] = []
        self.forgotten: list[Sequence] = []

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        right = self.spoil.get(len(self.asked), max_tokens)
        self.asked.append(max_tokens)
        n = seq.num_tokens
        return [t if j < right else (t + 1) % 400 for j, t in enumerate(self.full[n:n + max_tokens])]

    def forget(self, seq: Sequence) -> None:
        self.forgotten.append(seq)


def new_policy(client, proposer: OracleProposer, spec: SpeculativeConfig = SPEC) -> tuple[SchedulingPolicy, object]:
    info = client.info_now()
    assert "speculative_drafts" in info.capabilities
    policy = SchedulingPolicy(SchedulerConfig("in-process", speculative=spec), kv_usage_from_pb(info.kv),
                              info.max_batch_tokens)
    policy.speculator.proposer = proposer
    policy.planner.speculator = policy.speculator  # as the engine does for an executor that verifies drafts
    return policy, info


def submit(policy: SchedulingPolicy, info, stopping: StoppingCriteria) -> Sequence:
    req = GenerateRequest("r", tuple(PROMPT), stopping)
    seq = Sequence(req, policy.next_arrival(), info.eos_token_ids, info.max_seq_len,
                   codec.executor_sampling(req, info.eos_token_ids))
    policy.add(seq)
    return seq


@dataclasses.dataclass
class Step:
    drafts: int  # sent with the decode item
    returned: int  # tokens the executor returned (accepted drafts + 1)
    emitted: list[int]
    outcome_drafted: int
    outcome_accepted: int
    finish: object


def run_steps(policy: SchedulingPolicy, client, edit=None) -> list[Step]:
    """Steps until the policy has no work (as scheduler/engine/engine.py: plan, release, run, apply); releases what
    finished. edit(plan) may change a plan before it is sent."""
    steps = []
    while policy.has_work:
        plan = policy.schedule()
        if edit is not None:
            plan = edit(plan)
        if ids := policy.releases.take():
            client.release_now(ids)
        drafts = sum(len(i.drafts) for i in plan.items)
        resp = client.unified_decode_now(codec.step_to_pb(plan))
        results = codec.item_results_from_pb(resp)
        out = policy.update(plan, results, kv_usage_from_pb(resp.kv))
        steps.append(Step(drafts, sum(len(r.tokens) for r in results), [e.token.token_id for e in out.emitted],
                          out.drafted, out.accepted, next((e.finish for e in out.emitted if e.finish), None)))
    if ids := policy.releases.take():
        client.release_now(ids)
    kv = client.info_now().kv
    assert (kv.free_blocks, kv.active_caches) == (kv.total_blocks, 0)
    return steps


def test_accepted_runs_and_the_adaptive_length(client, reference):
    proposer = OracleProposer(reference, spoil={1: 1, 3: 0})
    policy, info = new_policy(client, proposer)
    seq = submit(policy, info, StoppingCriteria(NEW, ignore_eos=True))
    steps = run_steps(policy, client)
    assert seq.output_ids == reference[:NEW] and [t for s in steps for t in s.emitted] == reference[:NEW]
    assert steps[-1].finish.reason is FinishReason.LENGTH
    # the prompt step samples one token; then: 4 drafted, 4 accepted; 4 drafted, 1 accepted (spoiled); 2, 2;
    # 3 drafted, none accepted (spoiled): 2 steps without drafts, then 1 token, growing while accepted
    assert [s.drafts for s in steps[:8]] == [0, 4, 4, 2, 3, 0, 0, 1]
    assert [len(s.emitted) for s in steps[:8]] == [1, 5, 2, 3, 1, 1, 1, 2]
    assert proposer.asked[:6] == [4, 4, 2, 3, 1, 2]
    for s in steps:
        assert s.outcome_drafted == s.drafts and s.outcome_accepted == len(s.emitted) - 1 == s.returned - 1
    assert seq.drafted_tokens == sum(s.drafts for s in steps) and seq.accepted_tokens == NEW - len(steps)
    assert proposer.forgotten == [seq]  # the speculator let go of it when it ended


def test_a_stop_token_inside_an_accepted_run_ends_it_there(client, reference):
    k = next(i for i in range(8, NEW) if reference[i] not in reference[:i])
    proposer = OracleProposer(reference)  # every draft right: the executor accepts past the stop token
    policy, info = new_policy(client, proposer, dataclasses.replace(SPEC, num_tokens=8))
    seq = submit(policy, info, StoppingCriteria(NEW, ignore_eos=True, stop_token_ids=frozenset({reference[k]})))
    steps = run_steps(policy, client)
    assert seq.output_ids == reference[:k + 1]
    last = steps[-1]
    assert last.finish.reason is FinishReason.STOP and last.finish.stop_reason == str(reference[k])
    assert last.returned > len(last.emitted), "the stop token was meant to be inside the accepted run"
    assert last.emitted[-1] == reference[k]
    # the step still counts every draft the executor verified (and accepted) for the request
    assert seq.accepted_tokens == sum(s.returned - 1 for s in steps) > k + 1 - len(steps)


def test_max_length_inside_a_run_ends_with_length(client, reference):
    """draft_room keeps drafts within max_new_tokens; if a step still returns more (drafts planned past it),
    the sequence ends at max_new_tokens with LENGTH and nothing after it is emitted."""
    new = 9

    def overdraft(plan):  # decode items get the next 8 reference tokens as drafts, past draft_room
        def drafts(seq):
            return tuple(reference[len(seq.output_ids):len(seq.output_ids) + 8])
        return dataclasses.replace(plan, items=[dataclasses.replace(i, drafts=drafts(i.seq)) if i.seq.output_ids
                                                else i for i in plan.items])

    policy, info = new_policy(client, OracleProposer(reference))
    seq = submit(policy, info, StoppingCriteria(new, ignore_eos=True))
    steps = run_steps(policy, client, overdraft)
    assert seq.output_ids == reference[:new] and steps[-1].finish.reason is FinishReason.LENGTH
    assert steps[-1].returned > len(steps[-1].emitted)  # the executor accepted past the limit; not emitted

    policy, info = new_policy(client, OracleProposer(reference))  # and as planned: exactly up to the limit
    seq = submit(policy, info, StoppingCriteria(new, ignore_eos=True))
    steps = run_steps(policy, client)
    assert seq.output_ids == reference[:new] and steps[-1].finish.reason is FinishReason.LENGTH
    assert [s.returned for s in steps] == [len(s.emitted) for s in steps]  # nothing verified past the limit


def test_no_drafts_before_min_new_tokens(client, reference):
    proposer = OracleProposer(reference)
    policy, info = new_policy(client, proposer)
    seq = submit(policy, info, StoppingCriteria(NEW, min_new_tokens=6, ignore_eos=True))
    steps = run_steps(policy, client)
    assert seq.output_ids == reference[:NEW]
    # one token per step until 6 outputs exist (the EOS ban changes there), then drafts
    assert [s.drafts for s in steps[:6]] == [0] * 6 and steps[6].drafts == 4
    assert proposer.asked[0] == 4


# ------------------------------------------------------------------ the engine


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return ModelTokenizer(model_dir)


def engine_run(client, tokenizer, stopping: StoppingCriteria, proposer: OracleProposer | None
               ) -> tuple[list, Sequence]:
    """One request through a running engine (speculative with the oracle's drafts, or off): its stream's
    events and its sequence."""
    async def run():
        # Drafts pinned (a fixed --speculative-max-batch: the keep rule's measured costs, which vary with the
        # machine's load, do not decide) and one step per call (no burst whose length depends on timing), so
        # which step shows a stop string is the same on every run.
        cfg = dict(speculative=dataclasses.replace(SPEC, num_tokens=8, max_batch=8) if proposer
                   else SpeculativeConfig("off"), bursts=BurstConfig(window_ms=0))
        async with Running(client, tokenizer, **cfg) as engine:
            if proposer:
                engine.policy.speculator.proposer = proposer
            seq, output = engine.submit(GenerateRequest("r", tuple(PROMPT), stopping))
            events = await collect(output)
            await asyncio.sleep(0.05)  # (a step or two more)
            assert output.events.empty(), "a message after the last one"
            return events, seq
    return asyncio.run(run())


def text(events) -> str:
    return "".join(e.text for e in events if isinstance(e, Delta))


def test_engine_streams_accepted_runs(client, tokenizer, reference):
    plain = StoppingCriteria(NEW, ignore_eos=True)
    off, _ = engine_run(client, tokenizer, plain, None)
    on, _ = engine_run(client, tokenizer, plain, OracleProposer(reference))
    assert tokens(on) == tokens(off) == reference[:NEW] and text(on) == text(off)
    assert len([e for e in on if isinstance(e, Delta) and e.tokens]) < NEW / 3  # one message per step
    usage = on[-1].usage
    assert usage.drafted_tokens > 0 and usage.accepted_tokens == usage.drafted_tokens
    assert usage.completion_tokens == NEW and off[-1].usage.drafted_tokens == 0


def test_engine_stop_string_inside_an_accepted_run(client, tokenizer, reference):
    full = tokenizer.decode(reference[:NEW])
    # a 3-character stop string first found late in the text (after the 10th token's text)
    late = len(tokenizer.decode(reference[:10]))
    at = next(a for a in range(late, len(full) - 3) if full.find(full[a:a + 3]) == a and full[a:a + 3].strip())
    stop = full[at:at + 3]
    stopping = StoppingCriteria(NEW, ignore_eos=True, stop=(stop,))
    off, _ = engine_run(client, tokenizer, stopping, None)
    on, seq = engine_run(client, tokenizer, stopping, OracleProposer(reference))
    assert on[-1].finish_reason is FinishReason.STOP_SEQUENCE and on[-1].stop_reason == stop
    assert text(on) == text(off) == full[:at] and tokens(on) == tokens(off)
    assert on[-1].usage.completion_tokens == off[-1].usage.completion_tokens == len(tokens(on)) < NEW
    # the step that showed the stop string had accepted tokens after it: appended, never streamed
    assert len(seq.output_ids) > len(tokens(on)) and on[-1].usage.accepted_tokens > 0
