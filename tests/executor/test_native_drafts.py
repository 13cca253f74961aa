"""Drafts verified inside the native decode step: an item with k draft tokens is k + 1 rows of its
sequence in one native call (models/native/decode_step.cpp: every row's K/V written before any row attends),
so a drafted step, alone or within a multi-step burst, never falls back to the eager forward.

Held here, in process: every drafted call after the prompt runs natively (the step's call count); each row
equals the native step that one token per call would run, bit for bit (token, logprob, top logprobs), with
drafts right, half right and wrong, crossing block boundaries, on Llama, Qwen2's biases, Qwen3's q/k norms
and a bfloat16 model; a call of several drafting items of different lengths beside a plain one equals each
alone; the eager step (`--decode-kernel torch`) gives the same tokens within 1e-4 in logprob; a burst with
ngram drafts runs one native forward per step. The real SmolLM2 (slow): the same against the eager step.
"""
from __future__ import annotations

import itertools

import pytest

from executor_service.step.ngram_drafts import NgramDrafts
from executor_service.types import CacheRef, DecodeItem, OutputOptions, UnifiedItem
from models.decode.native import machine_refusal
from tests.executor.test_burst_drafts import LOOPING, looping
from tests.executor.test_speculative_verify import (PROMPTS, SCHEDULES, Run, oracle_drafts, plain_run,
                                                    prompt_of)
from tests.executor_driver import make_executor, raising

pytestmark = pytest.mark.skipif(machine_refusal() is not None, reason=f"native kernel: {machine_refusal()}")

STEPS = 40
TOPS = OutputOptions(top_logprobs=3)
LOGPROB_TOL = 1e-4


def drafted_run(ex, prompt: list[int], ref: Run, schedule: list[tuple[str, int]],
                output: OutputOptions = TOPS) -> tuple[Run, int, int]:
    """The prompt as a new cache, then one call per step with oracle drafts from ref. -> (the run, calls
    after the prompt's, native steps those calls ran)."""
    vocab = ex.model_config.vocab_size
    run, cache_id, length, calls = Run(), None, 0, 0
    native_before = ex.decode_step.calls if ex.decode_step else 0
    for kind, k in itertools.cycle(schedule):
        m = len(run.tokens)
        room = len(ref.tokens) - m - 1
        drafts, want = oracle_drafts(kind, min(k, room), ref.tokens, m, vocab) if room and cache_id else ((), 0)
        tokens = tuple(prompt) if cache_id is None else (run.tokens[-1],)
        calls += cache_id is not None
        (r,) = raising(ex.unified_decode([UnifiedItem(tokens, cache_id, length, output=output,
                                                      draft_token_ids=drafts)]))
        assert len(r.output.tokens) == want + 1, (kind, k, m)
        cache_id, length = r.cache.cache_id, r.cache.seq_len
        run.take(r.output.tokens)
        run.drafted, run.accepted = run.drafted + len(drafts), run.accepted + want
        if len(run.tokens) >= len(ref.tokens):
            break
    ex.release_cache([cache_id])
    return run, calls, (ex.decode_step.calls if ex.decode_step else 0) - native_before


def assert_bitwise(got: Run, ref: Run) -> None:
    assert got.tokens == ref.tokens
    assert got.logprobs == ref.logprobs  # exactly: a drafted row is computed as its own step would be
    assert got.tops == ref.tops


@pytest.fixture(scope="module")
def native(model_dir):
    return make_executor(model_dir, kv_blocks=64, decode_kernel="native")


@pytest.fixture(scope="module")
def refs(native) -> dict[int, Run]:
    return {n: plain_run(native, p, STEPS, output=TOPS) for n, p in enumerate(PROMPTS)}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_drafted_steps_run_natively_bit_for_bit(native, refs, schedule):
    for n, prompt in enumerate(PROMPTS):
        got, calls, native_steps = drafted_run(native, prompt, refs[n], SCHEDULES[schedule])
        assert native_steps == calls, "a drafted call ran the eager forward"
        assert got.drafted > 0
        assert_bitwise(got, refs[n])
    assert native.kv_usage().free_blocks == native.kv_usage().total_blocks


@pytest.mark.parametrize("arch,dtype", [("qwen2", "float32"), ("qwen3", "float32"), ("llama", "bfloat16")])
def test_other_architectures_and_bfloat16(tiny_checkpoint, arch, dtype):
    ex = make_executor(tiny_checkpoint(arch), kv_blocks=64, decode_kernel="native", dtype=dtype)
    prompt = prompt_of(21, 5)
    ref = plain_run(ex, prompt, 30, output=TOPS)
    got, calls, native_steps = drafted_run(ex, prompt, ref, SCHEDULES["mixed"])
    assert native_steps == calls
    assert_bitwise(got, ref)


def test_several_drafting_items_in_one_call_each_as_alone(native, refs):
    """Three items in one native call: drafts of 6 (all right) and of 3 (one right), and none."""
    vocab = native.model_config.vocab_size
    starts = [raising(native.unified_decode([UnifiedItem(tuple(p), output=TOPS)]))[0] for p in PROMPTS]
    plan = [("right", 6), ("half", 3), ("right", 0)]
    items, wants = [], []
    for n, (r, (kind, k)) in enumerate(zip(starts, plan)):
        assert r.output.tokens[0].token_id == refs[n].tokens[0]
        drafts, want = oracle_drafts(kind, k, refs[n].tokens, 1, vocab)
        items.append(UnifiedItem((refs[n].tokens[0],), r.cache.cache_id, r.cache.seq_len, output=TOPS,
                                 draft_token_ids=drafts))
        wants.append(want)
    before = native.decode_step.calls
    out = raising(native.unified_decode(items))
    assert native.decode_step.calls == before + 1
    for n, (r, want) in enumerate(zip(out, wants)):
        got = Run()
        got.take(r.output.tokens)
        ref = refs[n]
        assert got.tokens == ref.tokens[1:want + 2]
        assert got.logprobs == ref.logprobs[1:want + 2] and got.tops == ref.tops[1:want + 2]
    native.release_cache([r.cache.cache_id for r in starts])


def test_the_eager_step_gives_the_same_tokens(model_dir, native, refs):
    eager = make_executor(model_dir, kv_blocks=64, decode_kernel="torch")
    for n, prompt in enumerate(PROMPTS[:2]):
        want, _, _ = drafted_run(eager, prompt, refs[n], SCHEDULES["mixed"])
        got, _, _ = drafted_run(native, prompt, refs[n], SCHEDULES["mixed"])
        assert got.tokens == want.tokens
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < LOGPROB_TOL
        for g, w in zip(got.tops, want.tops):
            assert [t for t, _ in g] == [t for t, _ in w]


def test_a_burst_with_ngram_drafts_runs_one_native_forward_per_step(native):
    """Decode num_steps 24 with ngram_drafts on a looping prompt: the executor's drafts are accepted, and
    every forward of the burst (tokens - accepted drafts) is a native step; the tokens are the plain burst's."""
    prompt = looping(30, 1)
    outs = []
    for drafts in (None, NgramDrafts(max_draft_tokens=4, ngram_min=1, ngram_max=3)):
        (r,) = raising(native.unified_decode([UnifiedItem(tuple(prompt), sampling=LOOPING)]))
        first = r.output.tokens[0].token_id
        before = native.decode_step.calls
        (res,) = raising(native.decode([DecodeItem(CacheRef(r.cache.cache_id, len(prompt)), first, LOOPING,
                                                   ngram_drafts=drafts)], 24))
        tokens = [t.token_id for t in res.output.tokens]
        assert native.decode_step.calls - before == len(tokens) - res.accepted_draft_tokens
        outs.append((tokens, res))
        native.release_cache([r.cache.cache_id])
    (plain, _), (spec, res) = outs
    assert res.draft_steps > 0 and res.accepted_draft_tokens > 0
    assert spec == plain


@pytest.mark.slow
def test_smollm2_native_drafts_match_the_eager_step(smollm2_dir):
    prompt = [1] + prompt_of(40, 9)
    native = make_executor(smollm2_dir, kv_blocks=32, decode_kernel="native")
    ref = plain_run(native, prompt, 24, output=TOPS)
    got, calls, native_steps = drafted_run(native, prompt, ref, SCHEDULES["mixed"])
    assert native_steps == calls
    assert_bitwise(got, ref)
    del native
    eager = make_executor(smollm2_dir, kv_blocks=32, decode_kernel="torch")
    want, _, _ = drafted_run(eager, prompt, ref, SCHEDULES["mixed"])
    assert got.tokens == want.tokens
    assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < LOGPROB_TOL
