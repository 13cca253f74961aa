"""scheduler.engine.prefix_wait: which shared prompt prefix a waiting request waits for, over real Sequences."""
from __future__ import annotations

from scheduler.engine.prefix_wait import awaited_prefix, shared_prefix
from scheduler.request import GenerateRequest, StoppingCriteria
from scheduler.sequence import Sequence

BS = 4
SYSTEM = tuple(range(100, 112))  # 3 blocks of 4


def seq(n: int, prompt: tuple[int, ...], cached: int = 0, adapter: str = "") -> Sequence:
    s = Sequence(GenerateRequest(f"r{n}", prompt, StoppingCriteria(8), adapter=adapter), n, [2], 1000)
    s.num_cached = cached
    s.cache_id = f"c{n}" if cached else ""
    return s


def test_a_prompt_being_written_is_waited_for_and_one_written_is_reusable():
    writer = seq(0, SYSTEM + (1, 2), cached=4)  # 1 of its 3 shared blocks written so far
    reader = seq(1, SYSTEM + (7, 8, 9))
    assert shared_prefix(reader, [writer], BS).written == 4
    assert awaited_prefix(reader, [writer], BS) == 12  # the whole system prompt: wait for it
    writer.num_cached = 12
    assert awaited_prefix(reader, [writer], BS) == 0 and shared_prefix(reader, [writer], BS).written == 12


def test_nothing_is_awaited_across_adapters_or_without_a_whole_shared_block():
    writer = seq(0, SYSTEM + (1,))
    assert awaited_prefix(seq(1, SYSTEM + (1,), adapter="a"), [writer], BS) == 0
    assert awaited_prefix(seq(2, SYSTEM[:3] + (9, 9, 9)), [writer], BS) == 0  # differs inside the first block
    assert awaited_prefix(seq(3, SYSTEM[:4] + (9,)), [writer], BS) == 4  # one whole block, then its own


def test_the_last_token_is_never_awaited_and_a_held_prefix_counts():
    writer = seq(0, SYSTEM + (1,))
    assert awaited_prefix(seq(1, SYSTEM), [writer], BS) == 8  # 12 tokens: the last block is computed anyway
    assert awaited_prefix(seq(2, SYSTEM + (5,), cached=12), [writer], BS) == 0  # its cache holds it all


def test_the_longest_shared_run_over_several_writers_wins():
    short, long = seq(0, SYSTEM[:4] + (50, 51, 52, 53)), seq(1, SYSTEM + (3,), cached=8)
    reader = seq(2, SYSTEM + (4, 5))
    shared = shared_prefix(reader, [short, long], BS)
    assert (shared.written, shared.writing) == (8, 12)
