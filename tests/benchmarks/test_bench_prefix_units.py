"""The prefix-caching benchmark's pieces without servers: conversations re-send exactly the earlier turns and the
streamed answers, a failed turn ends its conversation, the prefix-cache counts and hit rate, and the on/off
comparisons against the issue's targets."""
from __future__ import annotations

import asyncio

import numpy as np

from benchmarks.prefix_client import SKIPPED, TimedRun, TurnRecord, run_conversations
from benchmarks.prefix_report import compare, prefix_stats, summarize_run
from benchmarks.prefix_workloads import Shape, kv_pool_blocks, make_prompts, question_prompts
from benchmarks.request_metrics import Record
from tandem.generate.v1 import generate_pb2 as gpb

SHAPE = Shape(system_tokens=20, questions=3, question_tokens=5, conversations=3, turns=4, output_len=3)


class FakeStub:
    """Generate answers each prompt with output_len tokens derived from its length; records the prompts it got.
    `fail`: request ids answered with an error status instead."""

    def __init__(self, fail: set[str] = frozenset()) -> None:
        self.prompts: dict[str, list[int]] = {}
        self.fail = fail

    def Generate(self, req: gpb.GenerateRequest, timeout: float):  # noqa: N802 - the gRPC method's name
        self.prompts[req.request_id] = list(req.token_ids.ids)
        n = req.stopping.max_new_tokens
        fail = req.request_id in self.fail

        async def stream():
            if fail:
                import grpc
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "executor gone")
            await asyncio.sleep(0)
            base = 1000 + len(req.token_ids.ids)
            for i in range(n):
                yield gpb.GenerateResponse(token_ids=[base + i])
            yield gpb.GenerateResponse(finish_reason=gpb.FINISH_REASON_LENGTH, usage=gpb.Usage(
                prompt_tokens=len(req.token_ids.ids), completion_tokens=n, cached_tokens=16))
        return stream()


def test_prompts_share_the_system_prompt_and_differ_after_it():
    prompts = make_prompts(SHAPE, np.arange(3, 50), seed=0, warmup=2)
    qs = question_prompts(prompts)
    assert len(qs) == SHAPE.questions and all(q[:20] == prompts.system for q in qs)
    assert len({tuple(q[20:]) for q in qs}) == SHAPE.questions
    assert [len(w) for w in prompts.warmup] == [25, 25] and prompts.warmup[0][:20] != prompts.system
    assert len(prompts.users) == SHAPE.conversations and all(len(u) == SHAPE.turns for u in prompts.users)
    assert sum(len(q) for q in qs) == SHAPE.prompt_tokens_sent("system-prompt")


def test_each_turn_resends_the_conversation_with_the_streamed_answers():
    prompts = make_prompts(SHAPE, np.arange(3, 50), seed=0, warmup=0)
    stub = FakeStub()
    records = asyncio.run(run_conversations(stub, prompts.system, prompts.users, SHAPE.output_len, 2, 10.0))
    assert [(r.conversation, r.turn) for r in records] == [(c, t) for c in range(3) for t in range(1, 5)]
    for c in range(SHAPE.conversations):
        expected = list(prompts.system)
        for t in range(SHAPE.turns):
            rec = records[c * SHAPE.turns + t]
            expected = expected + prompts.users[c][t]
            assert stub.prompts[f"bench-mt{c}-{rec.index}"] == expected
            assert rec.prompt_len == len(expected) == SHAPE.turn_prompt_len(t + 1)
            expected = expected + rec.output_ids  # the answer as streamed, then the next user message
    assert sum(r.prompt_len for r in records) == SHAPE.prompt_tokens_sent("multi-turn")


def test_a_failed_turn_ends_its_conversation_only():
    prompts = make_prompts(SHAPE, np.arange(3, 50), seed=0, warmup=0)
    stub = FakeStub(fail={"bench-mt1-5"})  # conversation 1, turn 2
    records = asyncio.run(run_conversations(stub, prompts.system, prompts.users, SHAPE.output_len, 2, 10.0))
    assert records[5].error.startswith("UNAVAILABLE")
    assert [r.error for r in records[6:8]] == [SKIPPED, SKIPPED] and not records[6].start
    assert all(r.error is None for r in records[:5] + records[8:])


def snapshot(processed: int, prefix: dict | None) -> dict:
    return {"ops": {}, "rpcs": {}, "forward_passes": 0, "tokens_processed": processed, "tokens_sampled": 0, "kv": {},
            "prefix_cache": prefix}


def record(prompt_len: int, cached: int, out: int = 3) -> Record:
    r = Record(0, prompt_len, start=1.0, end=2.0, messages=[(1.5, out)], output_ids=[7] * out,
               finish_reason="FINISH_REASON_LENGTH")
    r.usage = {"prompt_tokens": prompt_len, "completion_tokens": out, "cached_tokens": cached, "preemptions": 0}
    return r


def test_prefix_stats_from_usage_and_from_the_executor_counters():
    recs = [record(100, 0), record(100, 96), record(50, 48)]
    p = prefix_stats(recs, snapshot(10, None), snapshot(10 + 106 + 3 * 2, None))
    assert (p["prompt_tokens_sent"], p["cached_tokens"], p["prompt_tokens_computed"]) == (250, 144, 106)
    assert p["computed_fraction"] == 106 / 250 and p["hit_rate"] == p["usage_hit_rate"] == 144 / 250
    assert p["hit_rate_source"] == "usage" and p["executor_prefix_cache"] is None
    assert p["executor_prompt_tokens_processed"] == 106

    assert p["executor_prefix_caching"] is None

    before = {"enabled": True, "query_tokens": 500, "hit_tokens": 100, "evicted_blocks": 1, "indexed_blocks": 3}
    after = {"enabled": True, "query_tokens": 750, "hit_tokens": 250, "evicted_blocks": 1, "indexed_blocks": 9}
    p = prefix_stats(recs, snapshot(0, before), snapshot(0, after))
    assert p["executor_prefix_cache"] == {"enabled": True, "query_tokens": 250, "hit_tokens": 150,
                                          "evicted_blocks": 0, "indexed_blocks": 6}
    assert p["hit_rate"] == p["executor_hit_rate"] == 150 / 250 and p["hit_rate_source"] == "executor"
    assert p["executor_prefix_caching"] is True


def side(ttft_s: float, duration: float, cached: int, turns: bool = False) -> dict:
    recs = []
    for i in range(4):
        r = TurnRecord(i, 100, conversation=0, turn=i + 1) if turns else Record(i, 100)
        r.start, r.end, r.messages, r.output_ids = 0.0, duration, [(ttft_s, 3)], [1, 2, 3]
        r.finish_reason = "FINISH_REASON_LENGTH"
        r.usage = {"prompt_tokens": 100, "completion_tokens": 3, "cached_tokens": cached, "preemptions": 0}
        recs.append(r)
    run = TimedRun(recs, {"wall_s": duration, "cpu_s": {}, "cores": {}, "other_cores": None},
                   snapshot(0, None), snapshot(0, None), 0.0, duration, {})
    return summarize_run("multi-turn" if turns else "system-prompt", "x", run, 3)


def test_comparisons_judge_each_target_and_need_both_modes():
    runs = {"system-prompt": {"off": side(0.8, 10.0, 0), "on": side(0.1, 4.0, 96)},
            "multi-turn": {"off": side(0.6, 10.0, 0, turns=True), "on": side(0.3, 10.0, 80, turns=True)}}
    rows = {(c["workload"], c["metric"]): c for c in compare(runs)}
    ttft = rows[("system-prompt", "mean TTFT ms")]
    assert abs(ttft["result"] - 8.0) < 1e-9 and ttft["met"] is True
    rate = rows[("system-prompt", "request throughput req/s")]
    assert abs(rate["result"] - 2.5) < 1e-9 and rate["met"] is True
    computed = rows[("multi-turn", "prompt tokens computed / sent")]
    assert computed["result"] == 0.2 and computed["off"] == 1.0 and computed["met"] is True
    late = rows[("multi-turn", "mean TTFT ms, turns >= 3")]
    assert abs(late["result"] - 2.0) < 1e-9 and late["met"] is False  # 2x < the 3x target
    assert runs["multi-turn"]["on"]["ttft_late_turns_ms"]["n"] == 2  # turns 3 and 4

    only_on = compare({"system-prompt": {"on": runs["system-prompt"]["on"]}})
    assert len(only_on) == 2 and all(c["result"] is None and c["met"] is None for c in only_on)


def test_kv_pool_holds_the_whole_workload_and_the_requests_in_flight():
    # system-prompt: 2 blocks of system prompt + 3 x (1 block of question + answer, + 1 for the boundary) + 2 x 2
    assert kv_pool_blocks(SHAPE, "system-prompt", 2, 16) == 2 + 3 * 2 + 2 * 2 + 16
    # multi-turn: the last turn is 20 + 4*5 + 3*3 = 49 prompt + 3 out = 52 tokens = 4 blocks
    assert kv_pool_blocks(SHAPE, "multi-turn", 2, 16) == 3 * 4 + 2 * 4 + 16
