"""Speculation inside multi-step decode with real processes: one executor (tiny Llama), a
scheduler with `--speculative ngram` and bursts and one with bursts only; the same requests through both end with identical tokens, text, logprobs and finish reasons:
greedy loops that n-gram lookup predicts (most drafts accepted), seeded sampling, penalties, a stop token,
a stop string, max_new_tokens, and a constrained-free batch of several at once. The speculating side really
ran bursts with drafts: Decode calls carried several tokens per step (usage counts drafted and accepted
tokens, the executor counts fewer forwards than tokens). SmolLM2 (slow): a copy-heavy chat prompt, most
drafts accepted inside bursts, identical output."""
from __future__ import annotations

import concurrent.futures as cf

import pytest

from tandem.common.v1 import common_pb2 as cpb
from tandem.executor.v1 import executor_pb2 as epb
from tandem.generate.v1 import generate_pb2 as pb
from tests.e2e.test_scheduler_speculative import PASSAGE, copy_request
from tests.grpc_harness import start_for, start_scheduler_for
from tests.scheduler_client import Streamed, collect, ids_request, wait_kv_free

SPEC = ("--speculative", "ngram", "--ngram-min", "1", "--num-speculative-tokens", "6")
BURSTS = ("--decode-burst-ms", "60000", "--max-decode-steps", "16")
# Three tokens the tiny model then picks among in loops, which n-gram lookup predicts.
LOOPING = {5: 8.0, 9: 8.0, 13: 8.0}


@pytest.fixture(scope="module")
def executor(request, model_dir):
    return start_for(request, model_dir, "--kv-blocks", "400")


@pytest.fixture(scope="module")
def spec(request, executor):
    return start_scheduler_for(request, executor.address, *BURSTS, *SPEC)


@pytest.fixture(scope="module")
def plain(request, executor):
    return start_scheduler_for(request, executor.address, *BURSTS, "--speculative", "off")


def looping_prompt(seed: int) -> list[int]:
    pattern = [(seed * 37 + 11 * k) % 390 + 3 for k in range(3 + seed % 4)]
    return [1] + (pattern * 20)[:8 + 9 * seed]


def requests() -> list[pb.GenerateRequest]:
    long = pb.StoppingCriteria(max_new_tokens=70, ignore_eos=True)
    return [
        ids_request(looping_prompt(0), 70, stopping=long, top_logprobs=2,
                    sampling=cpb.SamplingParams(logit_bias=LOOPING)),
        ids_request(looping_prompt(1), 50, stopping=pb.StoppingCriteria(max_new_tokens=50, ignore_eos=True),
                    sampling=cpb.SamplingParams(logit_bias=LOOPING, temperature=0.7, top_k=5, seed=3)),
        ids_request(looping_prompt(2), 60, stopping=long,
                    sampling=cpb.SamplingParams(logit_bias=LOOPING, presence_penalty=0.2, frequency_penalty=0.1)),
        ids_request(looping_prompt(3), 70, stopping=pb.StoppingCriteria(max_new_tokens=70, stop_token_ids=[13],
                                                                         ignore_eos=True),
                    sampling=cpb.SamplingParams(logit_bias={5: 8.0, 9: 8.0, 13: 5.0})),
        ids_request(looping_prompt(4), 37, stopping=pb.StoppingCriteria(max_new_tokens=37, ignore_eos=True),
                    sampling=cpb.SamplingParams(logit_bias=LOOPING)),
        ids_request(looping_prompt(5), 60, sampling=cpb.SamplingParams(temperature=0.9, seed=8)),
    ]


def same(a: Streamed, b: Streamed) -> None:
    assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
    assert [x.logprob for x in a.logprobs] == pytest.approx([x.logprob for x in b.logprobs], abs=1e-3)


def forwards(executor) -> int:
    return executor.stub.GetMetrics(epb.GetMetricsRequest()).forward_passes


def test_one_at_a_time_identical_and_drafted_within_bursts(executor, spec, plain):
    drafted = accepted = tokens = 0
    for req in requests():
        want = collect(plain.stub, req)
        before = forwards(executor)
        got = collect(spec.stub, req)
        used = forwards(executor) - before
        same(got, want)
        drafted, accepted = drafted + got.usage.drafted_tokens, accepted + got.usage.accepted_tokens
        tokens += len(got.token_ids)
        if got.usage.accepted_tokens > 5:
            assert used < len(got.token_ids)  # accepted drafts saved forwards
            assert max(len(m.token_ids) for m in got.messages) > 16  # a burst's message beat 16 steps
    assert drafted > 20 and accepted > drafted / 2, (drafted, accepted)
    wait_kv_free(executor.stub)


def test_stop_string_inside_a_drafted_burst(executor, spec, plain):
    """A stop string the looping output reaches late (the 6 characters that first occur latest): the text ends
    there on both sides."""
    base = requests()[1]  # (seeded sampling among the looping tokens: a varied text)
    text = collect(plain.stub, base).text
    stop = max((text[i:i + 6] for i in range(len(text) - 6)), key=text.find)
    req = ids_request(list(base.token_ids.ids), 50, sampling=base.sampling,
                      stopping=pb.StoppingCriteria(max_new_tokens=50, stop=[stop], ignore_eos=True))
    want, got = collect(plain.stub, req), collect(spec.stub, req)
    assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
    assert want.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE and text.find(stop) > 10
    wait_kv_free(executor.stub)


def test_concurrent_requests_identical(executor, spec, plain):
    reqs = requests()
    with cf.ThreadPoolExecutor(len(reqs)) as pool:
        want = list(pool.map(lambda r: collect(plain.stub, r), reqs))
    with cf.ThreadPoolExecutor(len(reqs)) as pool:
        got = list(pool.map(lambda r: collect(spec.stub, r), reqs))
    for g, w in zip(got, want):
        same(g, w)
    wait_kv_free(executor.stub)


# ------------------------------------------------------------------ SmolLM2: a copy-heavy prompt

@pytest.fixture(scope="module")
def smol(request, smollm2_dir):
    """(executor, scheduler with bursts and speculation, scheduler with bursts only)."""
    executor = start_for(request, smollm2_dir, "--kv-blocks", "64")
    return (executor, start_scheduler_for(request, executor.address, *BURSTS, "--speculative", "ngram"),
            start_scheduler_for(request, executor.address, *BURSTS))


@pytest.mark.slow
def test_smollm2_copy_drafted_within_bursts(smol):
    """The copy is drafted and mostly accepted inside bursts, in fewer forwards than tokens, with the output
    of plain bursts; a stop token inside the copy ends both at the same token."""
    executor, on, off = smol
    want = collect(off.stub, copy_request())
    before = forwards(executor)
    got = collect(on.stub, copy_request())
    used = forwards(executor) - before
    assert PASSAGE[:40] in want.text  # the model really copies
    same(got, want)
    assert got.usage.drafted_tokens > 10 and got.usage.accepted_tokens > 0.8 * got.usage.drafted_tokens
    assert used < len(got.token_ids) / 2, (used, len(got.token_ids))
    stop = want.token_ids[len(want.token_ids) // 2]
    req = copy_request(stop_token_ids=[stop])
    want, got = collect(off.stub, req), collect(on.stub, req)
    same(got, want)
    assert got.token_ids[-1] == stop
    wait_kv_free(executor.stub)
