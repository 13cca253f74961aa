"""Prefill chunks around image spans written in one chunk (Gemma 3: PromptImage.one_chunk): the planner ends a
chunk before such a span or runs it through the span, past the chunk size but within the step's budget; a span
that does not fit the step waits with the budget kept for it; a span longer than any step is refused at the door.
Spans of other families (Idefics3) are cut anywhere, as before."""
from __future__ import annotations

import pytest

from scheduler.engine.admission import span_too_long
from scheduler.engine.planner import Planner
from scheduler.request import GenerateRequest, StoppingCriteria
from scheduler.sequence import Sequence, Status
from scheduler.vision.chat_images import PromptImage
from scheduler.vision.image_chunks import chunk_tokens, longest_span
from tandem.errors import CapacityExceeded
from tandem.kv_usage import KvUsage

KV = KvUsage(4, 1000, 900)


def _image(offset: int, length: int, one_chunk: bool = True) -> PromptImage:
    return PromptImage(offset, length, "0" * 32, (1, 3, 32, 32), b"", one_chunk)


def _seq(arrival: int, prompt_len: int, images=(), cached: int = 0) -> Sequence:
    seq = Sequence(GenerateRequest(f"r{arrival}", tuple(range(10, 10 + prompt_len)), StoppingCriteria(10),
                                   images=tuple(images)), arrival, [2], 100_000)
    seq.num_cached = cached
    seq.status = Status.RUNNING if cached else Status.WAITING
    seq.cache_id = f"c{arrival}" if cached else ""
    return seq


@pytest.mark.parametrize("start,n,most,want", [
    (0, 8, 100, 8),     # ends before the span [10, 14)
    (0, 12, 100, 10),   # would end inside: ends before it
    (0, 14, 100, 14),   # ends at its end
    (10, 2, 100, 4),    # starts at it: runs through it, past n
    (12, 1, 100, 2),    # starts inside it (a reused prefix): runs to its end
    (10, 2, 3, 0),      # the span needs 4, the step has 3: nothing this step
    (0, 30, 100, 30),   # through both spans
    (15, 7, 100, 5),    # would end inside the second [20, 24): ends before it
])
def test_chunk_tokens(start, n, most, want):
    images = [_image(10, 4), _image(20, 4)]
    assert chunk_tokens(images, start, n, most) == want


def test_spans_of_other_families_are_cut_anywhere():
    assert chunk_tokens([_image(10, 4, one_chunk=False)], 0, 12, 100) == 12
    assert longest_span([_image(10, 4, one_chunk=False)]) == 0 and longest_span([_image(1, 3), _image(8, 6)]) == 6


def test_the_planner_never_ends_a_chunk_inside_a_span():
    seq = _seq(0, 40, [_image(10, 4)])
    planner = Planner(max_batch_tokens=64, max_running=8, prefill_chunk=6)
    chunks = []
    while seq.num_cached < seq.num_tokens:
        plan = planner.plan([seq] if seq.num_cached else [], [] if seq.num_cached else [seq], KV)
        (item,) = plan.items
        chunks.append((item.start, item.count))
        seq.num_cached += item.count
        seq.status, seq.cache_id = Status.RUNNING, "c0"
    assert chunks == [(0, 6), (6, 4), (10, 6), (16, 6), (22, 6), (28, 6), (34, 6)]  # [10, 16) holds [10, 14) whole


def test_a_span_that_does_not_fit_the_step_keeps_the_budget():
    """A running prompt at its span with 3 tokens of budget left waits, and no younger prompt takes them."""
    running = [_seq(a, 3, cached=2) for a in range(5)]  # each writes its last prompt token this step
    at_span = _seq(9, 20, [_image(8, 4)], cached=8)
    newcomer = _seq(10, 5)
    plan = Planner(max_batch_tokens=8, max_running=16, prefill_chunk=4).plan(running + [at_span], [newcomer], KV)
    assert [(i.seq.arrival, i.count) for i in plan.items] == [(a, 1) for a in range(5)]
    assert plan.admitted == [] and "budget" in plan.wait_reason
    plan = Planner(max_batch_tokens=9, max_running=16, prefill_chunk=4).plan(running + [at_span], [], KV)
    assert (plan.items[-1].seq.arrival, plan.items[-1].count) == (9, 4)  # with 4 left: the whole span


def test_a_waiting_prompt_is_admitted_only_with_room_for_its_span():
    seq = _seq(0, 12, [_image(0, 6)])
    plan = Planner(max_batch_tokens=5, max_running=8, prefill_chunk=4).plan([], [seq], KV)
    assert plan.admitted == [] and "image" in plan.wait_reason
    plan = Planner(max_batch_tokens=64, max_running=8, prefill_chunk=4).plan([], [seq], KV)
    assert [(i.start, i.count) for i in plan.items] == [(0, 6)]


def test_a_span_longer_than_any_step_is_refused():
    assert span_too_long(16, 16) is None
    refusal = span_too_long(17, 16)
    assert isinstance(refusal, CapacityExceeded) and "--max-batch-tokens" in str(refusal)
