"""scheduler.engine.planner.Planner.plan over real Sequence objects in hand-set states."""
from __future__ import annotations

import pytest

from scheduler.engine.planner import Planner, StepItem
from tandem.ceil_div import ceil_div
from tandem.kv_usage import KvUsage
from scheduler.request import GenerateRequest, StoppingCriteria
from scheduler.sequence import Sequence, Status

BS = 4  # tokens per KV block in these tests


@pytest.fixture
def mk(tok):
    """mk(arrival, prompt_len, cached=0, outputs=0) -> a Sequence; cached=None means 'decoding' (all but the
    last output written). Running when anything is cached or outputs exist, else waiting."""

    def make(arrival: int, prompt_len: int, cached: int | None = 0, outputs: int = 0,
             status: Status | None = None, adapter: str = "") -> Sequence:
        prompt = tuple(100 + (i % 500) for i in range(prompt_len))
        seq = Sequence(GenerateRequest(f"r{arrival}", prompt, StoppingCriteria(1000), adapter=adapter), arrival, [2],
                       100_000)
        seq.output_ids = [700 + i for i in range(outputs)]
        seq.num_cached = prompt_len + outputs - 1 if cached is None else cached
        running = seq.num_cached > 0 or outputs > 0
        seq.status = status or (Status.RUNNING if running else Status.WAITING)
        seq.cache_id = f"c{arrival}" if seq.num_cached else ""
        return seq

    return make


def kv(free: int, total: int = 1000) -> KvUsage:
    return KvUsage(BS, total, free)


def items(plan) -> list[tuple[int, int, int]]:
    return [(i.seq.arrival, i.start, i.count) for i in plan.items]


def arrivals(seqs) -> list[int]:
    return [s.arrival for s in seqs]


# ------------------------------------------------------------------ decodes


def test_decodes_get_one_token_each(mk):
    running = [mk(0, 10, None, 3), mk(1, 7, None, 1), mk(2, 20, None, 5)]
    assert all(s.is_decoding for s in running)
    plan = Planner(512, 8, 64).plan(running, [], kv(500))
    assert items(plan) == [(0, 12, 1), (1, 7, 1), (2, 24, 1)]
    assert all(i.is_final for i in plan.items)
    assert plan.admitted == [] and plan.preempted == []


def test_decodes_are_capped_by_the_budget(mk):
    running = [mk(a, 8, None, 2) for a in range(5)]
    plan = Planner(3, 8, 64).plan(running, [mk(9, 4)], kv(500))
    assert items(plan) == [(0, 9, 1), (1, 9, 1), (2, 9, 1)]
    assert plan.admitted == []  # no budget left


def test_decode_growth_preempts_the_youngest(mk):
    # Each sequence has 8 tokens cached (2 full blocks): its next token needs a new block.
    running = [mk(0, 6, None, 3), mk(1, 6, None, 3), mk(2, 6, None, 3)]
    assert all(ceil_div(s.num_cached + 1, BS) - ceil_div(s.num_cached, BS) == 1 for s in running)
    plan = Planner(512, 8, 64).plan(running, [], kv(free=1))
    # 3 blocks needed, 1 free; the youngest's 2 blocks make 3 free, enough for the other two
    assert plan.preempted == [running[2]]
    assert items(plan) == [(0, 8, 1), (1, 8, 1)]
    assert arrivals(running) == [0, 1, 2]  # the input list is not modified
    assert running[2].status is Status.RUNNING and running[2].num_cached == 8  # the engine resets it


def test_preemption_repeats_until_growth_fits(mk):
    running = [mk(0, 3, None, 2), mk(1, 3, None, 2), mk(2, 3, None, 2)]  # 4 cached each: 1 block
    plan = Planner(512, 8, 64).plan(running, [], kv(free=0))
    # need 3 > 0; preempt #2 (+1 free, need 2); preempt #1 (+1 free -> 2, need 1)
    assert plan.preempted == [running[2], running[1]]
    assert items(plan) == [(0, 4, 1)]


def test_decodes_within_a_block_need_no_free_block(mk):
    running = [mk(0, 5, None, 1), mk(1, 6, None, 1)]  # 5 and 6 cached: room left in their last block
    plan = Planner(512, 8, 64).plan(running, [], kv(free=0))
    assert plan.preempted == []
    assert items(plan) == [(0, 5, 1), (1, 6, 1)]


def test_prefilling_youngest_is_preempted_for_older_decodes(mk):
    running = [mk(0, 6, None, 3), mk(1, 40, cached=16)]
    plan = Planner(512, 8, 64).plan(running, [], kv(free=0))
    assert plan.preempted == [running[1]]
    assert items(plan) == [(0, 8, 1)]


# ------------------------------------------------------------------ prefill chunks


def test_prefill_chunk_limit_and_final_chunk(mk):
    planner = Planner(512, 8, 32)
    s = mk(0, 100, cached=0, status=Status.RUNNING)
    plan = planner.plan([s], [], kv(500))
    assert items(plan) == [(0, 0, 32)]
    assert not plan.items[0].is_final
    s.num_cached = 64
    plan = planner.plan([s], [], kv(500))
    assert items(plan) == [(0, 64, 32)] and not plan.items[0].is_final
    s.num_cached = 96
    plan = planner.plan([s], [], kv(500))
    assert items(plan) == [(0, 96, 4)] and plan.items[0].is_final


def test_prefill_oldest_first_within_the_budget(mk):
    running = [mk(0, 10, None, 2), mk(1, 50, cached=8), mk(2, 50, cached=4), mk(3, 50, cached=12)]
    plan = Planner(40, 8, 32).plan(running, [], kv(500))
    # 1 decode, then 32 for #1 (chunk), 7 for #2 (budget), nothing for #3
    assert items(plan) == [(0, 11, 1), (1, 8, 32), (2, 4, 7)]
    assert not any(i.is_final for i in plan.items[1:])


def test_prefill_limited_by_free_blocks(mk):
    s = mk(0, 40, cached=6)  # 2 blocks, 2 free slots in the second
    plan = Planner(512, 8, 32).plan([s], [], kv(free=1))
    assert items(plan) == [(0, 6, 6)]  # 2 slots + 1 block of 4
    plan = Planner(512, 8, 32).plan([s], [], kv(free=0))
    assert items(plan) == [(0, 6, 2)]


def test_prefill_with_no_room_gets_no_item(mk):
    s = mk(0, 40, cached=8)  # full blocks, nothing free
    plan = Planner(512, 8, 32).plan([s], [mk(1, 3)], kv(free=0))
    assert plan.items == [] and plan.admitted == [] and plan.preempted == []


def test_is_final_only_when_a_chunk_reaches_the_end(mk):
    s = mk(0, 10, cached=0, outputs=0, status=Status.RUNNING)
    assert StepItem(s, 0, 9).is_final is False
    assert StepItem(s, 0, 10).is_final is True
    assert StepItem(s, 4, 6).is_final is True
    d = mk(1, 10, None, 3)
    assert StepItem(d, 12, 1).is_final is True
    assert StepItem(d, 11, 1).is_final is False


# ------------------------------------------------------------------ admissions


def test_admissions_oldest_first_and_whole_prompt_in_one_chunk(mk):
    waiting = [mk(0, 10), mk(1, 20), mk(2, 5)]
    plan = Planner(512, 8, 64).plan([], waiting, kv(500))
    assert plan.admitted == waiting
    assert items(plan) == [(0, 0, 10), (1, 0, 20), (2, 0, 5)]
    assert all(i.is_final for i in plan.items)


def test_admissions_stop_at_max_running(mk):
    running = [mk(0, 10, None, 1), mk(1, 10, None, 1)]
    waiting = [mk(2, 5), mk(3, 5), mk(4, 5)]
    plan = Planner(512, 3, 64).plan(running, waiting, kv(500))
    assert plan.admitted == [waiting[0]]
    assert items(plan) == [(0, 10, 1), (1, 10, 1), (2, 0, 5)]


def test_admissions_stop_at_the_budget(mk):
    waiting = [mk(0, 30), mk(1, 30), mk(2, 30)]
    plan = Planner(50, 8, 64).plan([], waiting, kv(500))
    # #0 takes 30, #1 gets the 20 left (a partial first chunk), #2 waits: no budget
    assert plan.admitted == waiting[:2]
    assert items(plan) == [(0, 0, 30), (1, 0, 20)]
    assert plan.items[0].is_final and not plan.items[1].is_final


def test_admissions_respect_prefill_chunk(mk):
    plan = Planner(512, 8, 16).plan([], [mk(0, 40)], kv(500))
    assert items(plan) == [(0, 0, 16)]


def test_admission_needs_whole_prompt_plus_one_in_free_blocks(mk):
    # total 100 blocks -> watermark 1. Prompt 35 (+1) needs 9 blocks.
    planner = Planner(512, 8, 16)
    assert planner.plan([], [mk(0, 35)], kv(free=10, total=100)).admitted != []  # 9 <= 10 - 1
    assert planner.plan([], [mk(0, 35)], kv(free=9, total=100)).admitted == []  # 9 > 9 - 1
    # a prompt of 36 (+1 = 37 tokens) needs 10 blocks
    assert planner.plan([], [mk(0, 36)], kv(free=10, total=100)).admitted == []


def test_watermark_scales_with_the_pool(mk):
    planner = Planner(512, 8, 64)
    # total 1000 -> watermark 10; prompt 7 (+1) needs 2 blocks
    assert planner.plan([], [mk(0, 7)], kv(free=12, total=1000)).admitted != []
    assert planner.plan([], [mk(0, 7)], kv(free=11, total=1000)).admitted == []


def test_head_of_queue_is_not_skipped(mk):
    waiting = [mk(0, 200), mk(1, 3)]  # the head needs 51 blocks; the small one would fit
    plan = Planner(512, 8, 64).plan([], waiting, kv(free=20, total=100))
    assert plan.admitted == [] and plan.items == []


def test_running_prompts_reserve_their_blocks(mk):
    # A running prompt of 64 with 0 cached gets a 16-token chunk (4 blocks) and still needs
    # ceil_div(65) - 4 = 13 more: those are reserved.
    running = [mk(0, 64, cached=0, status=Status.RUNNING)]
    planner = Planner(512, 8, 16)
    # free 30 - 4 (chunk) = 26 left; reserved 13; watermark 1 -> 12 available for a prompt of 40 (11 blocks)
    plan = planner.plan(running, [mk(1, 40)], kv(free=30, total=100))
    assert arrivals(plan.admitted) == [1]
    plan = planner.plan(running, [mk(1, 44)], kv(free=30, total=100))  # 45 tokens: 12 blocks
    assert arrivals(plan.admitted) == [1]
    plan = planner.plan(running, [mk(1, 48)], kv(free=30, total=100))  # 49 tokens: 13 blocks
    assert plan.admitted == []
    assert items(plan) == [(0, 0, 16)]


def test_earlier_admissions_reserve_for_later_ones(mk):
    # Two prompts of 40 with chunk 16: the first takes 4 blocks now and reserves 11 - 4 = 7 more.
    planner = Planner(512, 8, 16)
    waiting = [mk(0, 40), mk(1, 40)]
    plan = planner.plan([], waiting, kv(free=23, total=100))  # 23 - 4 - 7 - 1 = 11 >= 11
    assert arrivals(plan.admitted) == [0, 1]
    plan = planner.plan([], waiting, kv(free=22, total=100))
    assert arrivals(plan.admitted) == [0]


def test_no_admission_when_budget_is_spent_by_running(mk):
    running = [mk(0, 100, cached=0, status=Status.RUNNING)]
    plan = Planner(32, 8, 32).plan(running, [mk(1, 4)], kv(500))
    assert items(plan) == [(0, 0, 32)]
    assert plan.admitted == []


# ------------------------------------------------------------------ preempted sequences come back


def test_preempted_sequence_is_readmitted_with_all_its_tokens(mk):
    s = mk(0, 10, None, 5)
    s.reset_cache()
    assert (s.status, s.num_cached, s.cache_id, s.preemptions) == (Status.WAITING, 0, "", 1)
    plan = Planner(512, 8, 64).plan([], [s], kv(500))
    assert plan.admitted == [s]
    (item,) = plan.items
    assert (item.start, item.count, item.is_final) == (0, 15, True)
    assert s.token_slice(item.start, item.start + item.count) == list(s.request.prompt_ids) + s.output_ids


def test_preempted_sequence_recomputes_in_chunks(mk):
    s = mk(0, 10, None, 5)
    s.reset_cache()
    planner = Planner(512, 8, 8)
    plan = planner.plan([], [s], kv(500))
    assert items(plan) == [(0, 0, 8)] and not plan.items[0].is_final
    assert s.token_slice(0, 8) == list(s.request.prompt_ids[:8])
    # admitted and the first chunk written: the rest (prompt tail + all outputs) follows as prefill
    s.status, s.num_cached = Status.RUNNING, 8
    assert not s.is_decoding
    plan = planner.plan([s], [], kv(500))
    assert items(plan) == [(0, 8, 7)] and plan.items[0].is_final
    assert s.token_slice(8, 15) == list(s.request.prompt_ids[8:]) + s.output_ids
    # after the final chunk the executor samples: the sequence decodes again
    s.num_cached = 15
    s.append(800)
    assert s.is_decoding
    assert items(planner.plan([s], [], kv(500))) == [(0, 15, 1)]


def test_readmission_needs_room_for_prompt_and_outputs(mk):
    s = mk(0, 10, None, 10)  # 20 tokens (+1) -> 6 blocks
    s.reset_cache()
    planner = Planner(512, 8, 64)
    assert planner.plan([], [s], kv(free=6, total=100)).admitted == []  # 6 > 6 - 1
    assert planner.plan([], [s], kv(free=7, total=100)).admitted == [s]


# ------------------------------------------------------------------ adapter slots (max_adapters_on_device)


def test_admission_keeps_running_adapters_within_the_slots(mk):
    running = [mk(0, 8, None, 2, adapter="x"), mk(1, 8, None, 2, adapter="y")]
    waiting = [mk(2, 4, adapter="x"), mk(3, 4), mk(4, 4, adapter="z"), mk(5, 4, adapter="x")]
    plan = Planner(512, 8, 64, max_adapters=2).plan(running, waiting, kv(500))
    # x (running already) and the base model (no slot) are admitted; z would be a third adapter: it waits, and
    # nothing behind it is admitted, not even another x (no skipping the head)
    assert arrivals(plan.admitted) == [2, 3]
    assert "adapter 'z'" in plan.wait_reason and "2 adapter slots" in plan.wait_reason
    assert {i.seq.request.adapter for i in plan.items} == {"x", "y", ""}


def test_a_waiting_adapter_gets_the_slot_its_predecessor_frees(mk):
    planner = Planner(512, 8, 64, max_adapters=2)
    x, y = mk(0, 8, None, 2, adapter="x"), mk(1, 8, None, 2, adapter="y")
    z = mk(2, 4, adapter="z")
    assert planner.plan([x, y], [z], kv(500)).admitted == []
    plan = planner.plan([x], [z], kv(500))  # y finished: its slot is free
    assert plan.admitted == [z] and plan.wait_reason == ""
    assert {i.seq.request.adapter for i in plan.items} == {"x", "z"}


def test_admissions_of_one_step_count_against_the_slots(mk):
    waiting = [mk(0, 4, adapter="a"), mk(1, 4, adapter="b"), mk(2, 4, adapter="a"), mk(3, 4, adapter="c")]
    plan = Planner(512, 8, 64, max_adapters=2).plan([], waiting, kv(500))
    assert arrivals(plan.admitted) == [0, 1, 2]
    assert len({i.seq.request.adapter for i in plan.items}) == 2


def test_no_adapter_limit_when_the_executor_reports_none(mk):
    waiting = [mk(a, 4, adapter=f"a{a}") for a in range(6)]
    plan = Planner(512, 8, 64, max_adapters=0).plan([], waiting, kv(500))
    assert arrivals(plan.admitted) == list(range(6)) and plan.wait_reason == ""


# ------------------------------------------------------------------ why the head waits


def test_the_wait_reason_names_kv_held_elsewhere(mk):
    running = [mk(0, 7, None, 2)]  # 8 cached: 2 blocks of ours
    plan = Planner(512, 8, 64).plan(running, [mk(1, 20)], KvUsage(BS, 64, 3))
    assert plan.admitted == []
    assert plan.wait_reason == ("it needs 6 KV blocks but only 1 can be given to it: of the executor's 64 blocks "
                                "3 are free, 2 are held by this scheduler's 1 running requests and 59 elsewhere "
                                "(other clients of the executor)")


def test_the_wait_reason_names_max_running(mk):
    plan = Planner(512, 1, 64).plan([mk(0, 7, None, 2)], [mk(1, 4)], kv(500))
    assert plan.admitted == [] and "--max-running" in plan.wait_reason


# ------------------------------------------------------------------ reused prefixes (prefix caching)


def test_a_waiting_sequence_with_a_reused_prefix_starts_after_it_and_needs_only_the_rest(mk):
    s = mk(0, 40, status=Status.WAITING)
    s.cache_id, s.num_cached = "c0", 32  # CreateCache reused 8 blocks of 4 tokens
    plan = Planner(512, 8, 64).plan([], [s], kv(free=3 + 10))  # the rest: 41 tokens -> 11 blocks - 8 held = 3
    assert items(plan) == [(0, 32, 8)] and plan.admitted == [s]
    whole = mk(1, 40, status=Status.WAITING)
    plan = Planner(512, 8, 64).plan([], [whole], kv(free=3 + 10))
    assert plan.admitted == [] and plan.head_needs_blocks  # without the prefix it needs 11 blocks


def test_head_waiting_for_blocks_is_flagged_but_not_for_a_slot(mk):
    running = [mk(0, 8, None, 1)]
    plan = Planner(512, 1, 64).plan(running, [mk(1, 8)], kv(500))
    assert plan.wait_reason and not plan.head_needs_blocks


def test_prefixes_held_for_waiting_sequences_go_before_any_running_sequence_is_preempted(mk):
    running = [mk(0, 6, None, 3), mk(1, 6, None, 3)]  # 8 cached each: the next token needs a new block
    held = mk(2, 40, status=Status.WAITING)
    held.cache_id, held.num_cached = "c2", 32  # a reused prefix pinned by CreateCache
    plan = Planner(512, 8, 64).plan(running, [held], kv(free=0))
    # Only the release: blocks shared with running caches would free nothing, so the next plan counts again.
    assert plan.unpinned == [held] and plan.preempted == [] and plan.items == []


def test_a_plan_that_preempts_admits_nothing(mk):
    running = [mk(0, 6, None, 3), mk(1, 6, None, 3), mk(2, 6, None, 3)]
    small = mk(3, 2)  # would fit the victim's blocks, which are meant for the running decodes
    plan = Planner(512, 8, 64).plan(running, [small], kv(free=1))
    assert plan.preempted == [running[2]] and plan.admitted == []
    assert items(plan) == [(0, 8, 1), (1, 8, 1)] and "preempted" in plan.wait_reason


def test_with_prefix_reuse_a_prompt_another_admission_is_writing_waits_for_it(mk):
    first, second = mk(0, 40), mk(1, 40)  # the same 40-token prompt (mk's prompts depend on the length only)
    planner = Planner(512, 8, 64)
    planner.reuse_prefixes = True
    plan = planner.plan([], [first, second], kv(500))
    assert plan.admitted == [] and plan.head_needs_lookup  # admitted only once looked up in the prefix cache
    first.prefix_looked_up = second.prefix_looked_up = 0  # looked up: nothing cached
    plan = planner.plan([], [first, second], kv(500))
    assert plan.admitted == [first] and "writing the first 36 tokens" in plan.wait_reason
    planner.reuse_prefixes = False  # without prefix caching there is nothing to wait for
    assert Planner(512, 8, 64).plan([], [first, second], kv(500)).admitted == [first, second]
