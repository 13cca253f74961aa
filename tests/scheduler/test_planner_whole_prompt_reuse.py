"""Admission of a waiting sequence whose reused prefix is every block of its prompt but the last token
(CreateCache, executor_service/kv/prefix_cache.py): writing that token copies the shared last block, so the
planner counts one block more than the growth, and admits it as a one-token final item."""
from __future__ import annotations

from scheduler.engine.planner import Planner
from scheduler.request import GenerateRequest, StoppingCriteria
from scheduler.sequence import Sequence, Status
from tandem.kv_usage import KvUsage

BS = 4
WATERMARK = 10  # max(1, total // 100) of a 1000-block pool


def waiting(arrival: int, prompt_len: int, cached: int) -> Sequence:
    seq = Sequence(GenerateRequest(f"r{arrival}", tuple(100 + i for i in range(prompt_len)), StoppingCriteria(1000)),
                   arrival, [2], 100_000)
    seq.status = Status.WAITING
    seq.cache_id, seq.num_cached = f"c{arrival}", cached
    return seq


def test_all_but_the_last_token_reused_needs_the_copy_of_the_last_block():
    s = waiting(0, 40, 39)  # 10 blocks held, the 10th one token short
    # 41 tokens -> 11 blocks - 10 held = 1, + 1 for the copy of the shared 10th block
    plan = Planner(512, 8, 64).plan([], [s], KvUsage(BS, 1000, 2 + WATERMARK))
    assert [(i.start, i.count, i.is_final) for i in plan.items] == [(39, 1, True)] and plan.admitted == [s]
    plan = Planner(512, 8, 64).plan([], [waiting(1, 40, 39)], KvUsage(BS, 1000, 1 + WATERMARK))
    assert plan.admitted == [] and plan.head_needs_blocks


def test_many_cached_prompts_are_admitted_in_one_step_one_token_each():
    burst = [waiting(a, 64, 63) for a in range(16)]
    plan = Planner(2048, 64, 512).plan([], burst, KvUsage(BS, 1000, 500))
    assert plan.admitted == burst and [i.count for i in plan.items] == [1] * 16
