"""--deterministic in process: the row-invariant forward (models/decode/deterministic.py), the
invariant sampler (models/sampler.py) and the executor over them (executor_service/step/deterministic.py).

Held here, bit for bit (tokens, logprobs, top-5 alternatives): a sequence's run is the same whether its prompt
went whole, in chunks of 1, 3, 16 or 7, alone or beside other items (prompt chunks and decode rows of other
sequences), with drafts (right and wrong) or without, in multi-step bursts or one step per call, on 1 or 2
threads, after its cache was dropped and recomputed (preemption) and on a second executor (failover); greedy
and seeded sampling with top-k/top-p/min-p and penalties. The sampler: a row alone equals the row in any batch
and on any thread count, over a vocabulary that is not a multiple of the vector width. The rope table: a
position's cos/sin do not depend on the call. Prompt logprobs are identical whatever the chunking. What cannot
be invariant is refused at start with the reason.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from executor_service.config import ExecutorConfig
from executor_service.step.decode_choice import flag_refusal
from executor_service.kv.fingerprint import differences
from executor_service.types import CacheRef, DecodeItem, OutputOptions, UnifiedItem
from models.decode.deterministic import ROPE_BLOCK, RopeTable
from models.decode.native import machine_refusal
from models.sampler import Sampler, SamplingRow
from tandem.sampling_params import SamplingParams
from tests.executor_driver import make_executor, raising

pytestmark = pytest.mark.skipif(machine_refusal() is not None, reason=f"native kernel: {machine_refusal()}")

TOP5 = OutputOptions(top_logprobs=5)
STEPS = 12
GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=1.0, top_k=40, top_p=0.9, min_p=0.01, seed=1234, repetition_penalty=1.1,
                        frequency_penalty=0.2)


def prompt_of(length: int, seed: int, vocab: int = 256) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


PROMPTS = [prompt_of(n, s) for n, s in ((5, 1), (23, 2), (41, 3), (17, 4))]


def _tokens(out) -> list[tuple]:
    return [(t.token_id, t.logprob, tuple(t.top_logprobs)) for t in out.tokens]


def run(ex, prompt: list[int], params: SamplingParams, chunk: int | None = None, others: int = 0,
        drafts: bool = False, burst: int = 1) -> list[tuple]:
    """The prompt (whole or in chunks), then decode steps to STEPS tokens. others: that many other sequences
    ride every call (new prompt chunks and decodes of their own); drafts: each decode step carries the next
    two tokens of a first run as drafts (the second one wrong every other step); burst: steps per Decode."""
    cache, length, got, rivals = None, 0, [], []
    chunk = chunk or len(prompt)

    def call(item: UnifiedItem):
        nonlocal rivals
        extra = [UnifiedItem((rival_tokens[-1],), c, n, True, params, TOP5) for c, n in rivals]
        fresh = [UnifiedItem(tuple(prompt_of(3 + 5 * k, 100 + len(got) + k)), sampling=params, output=TOP5)
                 for k in range(others - len(rivals))]
        res = raising(ex.unified_decode([item, *extra, *fresh]))
        for r in res[1 + len(extra):]:
            rivals.append((r.cache.cache_id, r.cache.seq_len))
        rivals = [(r.cache.cache_id, r.cache.seq_len) for r in res[1:1 + len(extra)]] + rivals[len(extra):]
        return res[0]

    rival_tokens = [7]
    for pos in range(0, len(prompt), chunk):
        final = pos + chunk >= len(prompt)
        r = call(UnifiedItem(tuple(prompt[pos:pos + chunk]), cache, length, final, params, TOP5))
        cache, length = r.cache.cache_id, r.cache.seq_len
    got.extend(_tokens(r.output))
    reference = REFERENCE.get((tuple(prompt), params.seed)) if drafts else None
    while len(got) < STEPS:
        if burst > 1:
            (d,) = raising(ex.decode([DecodeItem(CacheRef(cache, length), got[-1][0], params, TOP5)],
                                     num_steps=min(burst, STEPS - len(got))))
            got.extend(_tokens(d.output))
            length = d.cache.seq_len
            continue
        draft = ()
        if reference is not None and len(got) + 2 < len(reference):
            draft = (reference[len(got)][0], (reference[len(got) + 1][0] + len(got) % 2) % 400)
        r = call(UnifiedItem((got[-1][0],), cache, length, True, params, TOP5, draft_token_ids=draft))
        cache, length = r.cache.cache_id, r.cache.seq_len
        got.extend(_tokens(r.output))
    ex.release_cache([cache] + [c for c, _ in rivals])
    return got[:STEPS]


REFERENCE: dict[tuple, list[tuple]] = {}


@pytest.fixture(scope="module")
def det(model_dir):
    return make_executor(model_dir, kv_blocks=256, deterministic=True)


@pytest.fixture(scope="module")
def refs(det) -> dict[tuple[int, str], list[tuple]]:
    out = {}
    for n, p in enumerate(PROMPTS):
        for name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
            out[n, name] = run(det, p, params)
            REFERENCE[tuple(p), params.seed] = out[n, name]
    return out


CASES = {
    "chunks of 1": dict(chunk=1), "chunks of 3": dict(chunk=3), "chunks of 16": dict(chunk=16),
    "beside 3 others": dict(others=3), "chunks of 7 beside 2 others": dict(chunk=7, others=2),
    "drafts": dict(drafts=True), "bursts of 5": dict(burst=5),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", ["greedy", "seeded"])
def test_a_run_is_bitwise_the_same_however_it_is_batched_or_chunked(det, refs, case, name):
    params = GREEDY if name == "greedy" else SEEDED
    for n, p in enumerate(PROMPTS):
        assert run(det, p, params, **CASES[case]) == refs[n, name], (case, n)


def test_threads_do_not_change_a_bit(det, refs):
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for n in (1, 2):
                assert run(det, PROMPTS[n], SEEDED, chunk=5, others=1) == refs[n, "seeded"], threads
    finally:
        torch.set_num_threads(before)


def test_preempted_and_recomputed_continues_identically(det, refs):
    """The scheduler's recompute: the cache dropped after some tokens, prompt + generated tokens prefilled
    again (here in chunks of 6), sampling continues at the same positions with the same seed."""
    p, ref = PROMPTS[2], refs[2, "seeded"]
    seq = p + [t for t, _, _ in ref[:5]]
    cache, length = None, 0
    for pos in range(0, len(seq), 6):
        (r,) = raising(det.unified_decode([UnifiedItem(tuple(seq[pos:pos + 6]), cache, length,
                                                       pos + 6 >= len(seq), SEEDED, TOP5, prompt_len=len(p))]))
        cache, length = r.cache.cache_id, r.cache.seq_len
    got = _tokens(r.output)
    while len(got) < STEPS - 5:
        (r,) = raising(det.unified_decode([UnifiedItem((got[-1][0],), cache, length, True, SEEDED, TOP5)]))
        cache, length = r.cache.cache_id, r.cache.seq_len
        got.extend(_tokens(r.output))
    det.release_cache([cache])
    assert got == ref[5:]


def test_a_second_executor_gives_the_same_bits(model_dir, refs):
    other = make_executor(model_dir, kv_blocks=64, deterministic=True, prefix_caching=False)
    for n in (0, 3):
        assert run(other, PROMPTS[n], SEEDED, chunk=4) == refs[n, "seeded"]


def test_prompt_logprobs_do_not_depend_on_chunking(det):
    p = PROMPTS[2]

    def scored(chunk: int) -> list[tuple]:
        cache, length, out = None, 0, []
        for pos in range(0, len(p), chunk):
            (r,) = raising(det.unified_decode([UnifiedItem(tuple(p[pos:pos + chunk]), cache, length,
                                                           pos + chunk >= len(p), GREEDY, TOP5, prompt_logprobs=3)]))
            cache, length = r.cache.cache_id, r.cache.seq_len
            out += [(t.token_id, t.logprob, t.rank, tuple(t.top_logprobs)) for t in r.prompt_logprobs]
        det.release_cache([cache])
        return out

    whole = scored(len(p))
    assert len(whole) == len(p) - 1
    assert scored(5) == whole and scored(16) == whole


def test_sampler_row_alone_equals_the_row_in_any_batch_and_thread_count():
    vocab = 1003  # not a multiple of any vector width: the tails must not move with the batch
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, vocab, generator=gen) * 3
    logits[:, 17] = logits[:, 18]  # a tie
    params = [GREEDY, SEEDED, SamplingParams(temperature=0.7, top_p=0.5, seed=9), SamplingParams(temperature=1.0, seed=3)]
    rows = [SamplingRow(params[r % 4], list(range(r, r + 6)), 2, 40 + r, 5) for r in range(9)]
    sampler = Sampler(vocab, invariant=True)
    before = torch.get_num_threads()
    try:
        alone = [sampler.sample(logits[r:r + 1], rows[r:r + 1]).to_lists()[0] for r in range(9)]
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for order in (list(range(9)), [8, 3, 0, 5, 1, 7, 2, 6, 4]):
                got = sampler.sample(logits[order], [rows[r] for r in order]).to_lists()
                assert [alone[r] for r in order] == got, (threads, order)
    finally:
        torch.set_num_threads(before)
    assert before == torch.get_num_threads()


def test_logits_of_chosen_rows_are_the_bits_of_every_rows(det):
    """A prompt chunk's LM head for the rows it needs only (head_rows): those rows' logits are the same bits
    as when every row's are computed; a bad list is refused before anything runs."""
    step = det.stack.decode_step
    free = det.stack.kv.allocator.allocate(2)
    try:
        ids = prompt_of(20, 9)  # one sequence of 20 rows in blocks `free`
        full = step.run(ids, [free] * 20, list(range(20)))  # [20, vocab]
        some = step.run(ids, [free] * 20, list(range(20)), [0, 7, 19])  # the same K/V written again
        assert some.shape == (3, full.shape[1]) and torch.equal(some, full[[0, 7, 19]])
        assert step.run(ids, [free] * 20, list(range(20)), []).shape == (0, full.shape[1])
        for bad in ([3, 2], [20], [-1]):
            with pytest.raises(ValueError, match="head_rows must be ascending row indices below 20"):
                step.run(ids, [free] * 20, list(range(20)), bad)
    finally:
        det.stack.kv.allocator.free(free)


def test_rope_table_is_the_same_whatever_the_call(det):
    table = RopeTable(det.model)
    positions = np.array([0, 5, ROPE_BLOCK - 1, ROPE_BLOCK, 3 * ROPE_BLOCK + 7], dtype=np.int64)
    cos, sin = table.cos_sin(positions)
    for i, p in enumerate(positions):
        c1, s1 = RopeTable(det.model).cos_sin(np.array([p], dtype=np.int64))
        assert torch.equal(c1[0], cos[i]) and torch.equal(s1[0], sin[i])
    ref_cos, _ = det.model.rotary.cos_sin(torch.from_numpy(positions), torch.float32)
    assert torch.allclose(cos, ref_cos, atol=1e-6)  # the model's own rotary, to float rounding


@pytest.mark.parametrize("flags, words", [
    (dict(compile=True), "--compile"),
    (dict(decode_kernel="torch"), "--decode-kernel torch"),
    (dict(adapter_root="/tmp"), "LoRA"),
    (dict(tensor_parallel_size=2), "--tensor-parallel-size"),  # (the CLI refuses it before starting ranks)
])
def test_refused_combinations_say_what_to_change(model_dir, flags, words):
    config = ExecutorConfig(model_dir, device="cpu", deterministic=True, **flags)
    assert words in (flag_refusal(config) or "")
    assert flag_refusal(ExecutorConfig(model_dir, device="cpu", deterministic=True)) is None
    if "tensor_parallel_size" not in flags:
        with pytest.raises(ValueError, match="--deterministic"):
            make_executor(model_dir, kv_blocks=16, deterministic=True, **flags)


def test_a_moe_model_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="--deterministic: .*MoE"):
        make_executor(tiny_checkpoint("qwen3_moe"), kv_blocks=16, deterministic=True)


def test_get_info_reports_it(det, model_dir):
    info = det.info()
    assert info.deterministic and "deterministic" in info.capabilities
    plain = make_executor(model_dir, kv_blocks=16)
    assert not plain.info().deterministic and "deterministic" not in plain.info().capabilities
    # KV moves (ExportKv/ImportKv, the disk tier) only between pools of equal fingerprints: never between a
    # deterministic pool and another, whose K/V are other bits
    assert "kernels=deterministic" in info.kv_fingerprint
    assert "kernels" in differences(info.kv_fingerprint, plain.info().kv_fingerprint)
