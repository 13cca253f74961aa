"""Bounded attention work per call: a bucket whose padded workspace (rows x queries x longest
context) is over --max-attention-elements is split into sub-buckets of similar context lengths, and the
answers do not change: a batch mixing one long context with many short items gives the same logits as each
item run alone. On each device (tests/devices.py): float32 on the CPU to 1e-5, bfloat16 on CUDA within its tolerance
(tests/device_tolerances.py: a split bucket is another shape, so other kernels and another rounding)."""
from __future__ import annotations

import random

import pytest

import models.attention.paged as attention
from executor_service.types import UnifiedItem
from models.attention.paged import ItemLayout, attention_elements, split_bucket
from tests.device_tolerances import assert_greedy_token, assert_logits_close
from tests.executor_driver import LOGITS, make_executor
from tests.hf_reference import rel_err


def layouts(shapes: list[tuple[int, int]]) -> list[ItemLayout]:
    """(past, n_new) per item; block ids are irrelevant to the split."""
    return [ItemLayout(list(range(32)), past, n) for past, n in shapes]


def test_split_bucket_keeps_each_part_under_the_bound():
    rng = random.Random(0)
    for _ in range(200):
        items = layouts([(rng.choice([0, 3, 40, 250]), rng.choice([1, 1, 2, 9])) for _ in range(rng.randrange(1, 30))])
        idx = list(range(len(items)))
        limit = rng.choice([1, 50, 400, 5000])
        parts = split_bucket(items, idx, limit)
        assert sorted(i for p in parts for i in p) == idx  # every item exactly once
        for p in parts:
            assert len(p) == 1 or attention_elements([items[i] for i in p]) <= limit
    small = layouts([(3, 1)] * 4)
    assert split_bucket(small, [0, 1, 2, 3], None) == [[0, 1, 2, 3]]  # no bound
    assert split_bucket(small, [0, 1, 2, 3], 16) == [[0, 1, 2, 3]]  # within it: unchanged, in packed order
    # One long context among short ones: it goes alone, the short ones together.
    mixed = layouts([(3, 1), (250, 1), (4, 1), (2, 1)])
    assert split_bucket(mixed, [0, 1, 2, 3], 300) == [[1], [2, 0, 3]]


def histories(ex) -> list[str]:
    """Caches with one long context and many short ones; the same ids order on every executor."""
    ids = [ex.prefill([3 + i % 200 for i in range(200)]).cache.cache_id]
    ids += [ex.prefill([10 + k, 11, 12, 13]).cache.cache_id for k in range(8)]
    return ids


def batch(ids: list[str]) -> list[UnifiedItem]:
    return ([UnifiedItem((5,), ids[0], 200, output=LOGITS)]  # a decode at a 201-token context
            + [UnifiedItem((6 + k,), ids[1 + k], 4, output=LOGITS) for k in range(6)]  # decodes at 5
            + [UnifiedItem((7, 8, 9, 10, 11, 12), ids[7], 4, output=LOGITS),  # chunks beside them
               UnifiedItem((13, 14, 15), ids[8], 4, output=LOGITS),
               UnifiedItem(tuple(range(30, 42)), output=LOGITS)])  # a new prompt


@pytest.mark.parametrize("bound", [400, 1])
def test_split_batch_gives_the_logits_of_each_item_alone(model_dir, monkeypatch, bound, device):
    parts_seen: list[int] = []
    real = attention.split_bucket

    def spy(items, idx, limit):
        parts = real(items, idx, limit)
        parts_seen.append(len(parts))
        return parts

    monkeypatch.setattr(attention, "split_bucket", spy)
    # the split is the gathered backend's (CUDA's `auto` would pick flex, which reads the pool in place)
    ex = make_executor(model_dir, kv_blocks=64, max_attention_elements=bound, device=device,
                       attention_backend="gathered")
    results = ex.unified_decode(batch(histories(ex)))
    assert max(parts_seen) > 1  # the batch was split
    # Each item alone, on an executor that never splits, with the same history.
    alone = make_executor(model_dir, kv_blocks=64, max_attention_elements=0, device=device,
                          attention_backend="gathered")
    ids = histories(alone)
    for item, got in zip(batch(ids), results):
        (want,) = alone.unified_decode([item])
        if device.exact:
            assert rel_err(got.output.logits[0], want.output.logits[0]) < 1e-5
            assert got.output.tokens[0].token_id == want.output.tokens[0].token_id
        else:
            assert_logits_close(got.output.logits[0], want.output.logits[0], device.dtype, "split vs alone")
            assert_greedy_token(got.output.tokens[0].token_id, want.output.logits[0], device.dtype, "split vs alone")
