"""The lazily allocated KV pool through the attention path: never-written slots read as exact zeros, and
blocks freed by one sequence and reused by another give the results of a fresh pool.

Both drive mixed batches (tests/executor_driver.mixed_batch_run): prompts of different lengths, chunked
prefill beside decodes, so attention reads each row's blocks padded to the batch's longest context. A
short row then reads slots nothing wrote (the tail of its last block, and the padding), masked by -inf.
Masking only hides a slot's value if it is finite: 0 x NaN is NaN. So those slots must hold exact zeros
(or any finite value, as a reused block's stale tokens are).
"""
from __future__ import annotations

import random

import torch

from tests.executor_driver import make_executor, mixed_batch_run

# Lengths not a multiple of the block size (16), so last blocks have unwritten tails.
PROMPTS = [[random.Random(n).randrange(3, 400) for _ in range(length)] for n, length in enumerate((5, 37, 21))]
STEPS = 4
CHUNK = 8


def _run(ex) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    return mixed_batch_run(ex, PROMPTS, STEPS, chunk=CHUNK)


def _assert_same(a, b) -> None:
    (tokens_a, logits_a), (tokens_b, logits_b) = a, b
    assert tokens_a == tokens_b
    for seq_a, seq_b in zip(logits_a, logits_b):
        assert len(seq_a) == len(seq_b) == STEPS
        for x, y in zip(seq_a, seq_b):
            assert torch.equal(x, y)  # same kernels, same inputs: bit-identical


def test_never_written_pool_reads_as_zeros_through_attention(model_dir):
    lazy = make_executor(model_dir, kv_blocks=16)  # the pool as the executor allocates it: untouched pages
    assert torch.count_nonzero(lazy.kv.k) == 0 and torch.count_nonzero(lazy.kv.v) == 0

    filled = make_executor(model_dir, kv_blocks=16)  # the old allocation: every byte written with zeros
    filled.kv.k = torch.zeros(filled.kv.k.shape, dtype=filled.kv.k.dtype)
    filled.kv.v = torch.zeros(filled.kv.v.shape, dtype=filled.kv.v.dtype)
    _assert_same(_run(lazy), _run(filled))

    # The check has teeth: the same run over a pool whose unwritten slots hold NaN is poisoned, so the
    # attention path above did read never-written slots.
    poisoned = make_executor(model_dir, kv_blocks=16)
    poisoned.kv.k.fill_(float("nan"))
    poisoned.kv.v.fill_(float("nan"))
    _, logits = _run(poisoned)
    assert any(not torch.isfinite(x).all() for seq in logits for x in seq)


def test_blocks_freed_and_reused_by_another_sequence_give_fresh_results(model_dir):
    fresh = make_executor(model_dir, kv_blocks=8)
    want = _run(fresh)

    reused = make_executor(model_dir, kv_blocks=8)
    # Fill every block of the pool with another sequence's keys and values, then free them all.
    filler = [random.Random(99).randrange(3, 400) for _ in range(8 * 16 - STEPS)]
    first = reused.prefill(filler)
    assert reused.kv_usage().free_blocks == 0
    reused.release_cache([first.cache.cache_id])
    assert reused.kv_usage().free_blocks == 8
    assert reused.kv.k[0].reshape(8, -1).ne(0).any(-1).all()  # every block holds the filler's stale keys

    _assert_same(_run(reused), want)  # every block the run gets held the filler's tokens
    assert reused.kv_usage().free_blocks == 8  # and the run released them all again
