"""Speculative decoding end to end, both servers as real processes: schedulers with
`--speculative ngram` and with it off give the same outputs.

Tiny Llama: one executor shared by a speculating scheduler (--ngram-min 1, so its rarely repeating output
still drafts) and one that does not, both cutting prompts into small chunks: 12 concurrent requests (long
prompts prefilled in chunks beside drafting decodes, some held back from drafting by min_new_tokens,
seeded sampling) end with identical tokens and finish reasons; then preemption under a small KV pool.
SmolLM2 (slow): a copy-heavy chat prompt where most drafts are accepted: identical tokens, a stop token, a
stop string and max_new_tokens ending inside accepted runs, the HTTP front's usage and the Prometheus
counters."""
from __future__ import annotations

import concurrent.futures as cf
import itertools
import random

import openai
import pytest

from scheduler.text.tokenizer import ModelTokenizer
from tandem.common.v1 import common_pb2 as cpb
from tandem.generate.v1 import generate_pb2 as pb
from tests.e2e.test_prometheus_metrics import scrape
from tests.grpc_harness import start_for, start_scheduler_for
from tests.scheduler_client import Streamed, collect, ids_request, wait_kv_free

SPEC = ("--speculative", "ngram", "--ngram-min", "1", "--num-speculative-tokens", "6",
        "--speculative-max-batch", "16")
CHUNKED = ("--prefill-chunk", "16", "--max-batch-tokens", "96")


@pytest.fixture(scope="module")
def executor(request, model_dir):
    return start_for(request, model_dir, "--kv-blocks", "256")


@pytest.fixture(scope="module")
def spec(request, executor):
    return start_scheduler_for(request, executor.address, *CHUNKED, *SPEC)


@pytest.fixture(scope="module")
def off(request, executor):
    return start_scheduler_for(request, executor.address, *CHUNKED, "--speculative", "off")


def prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts of 4 to 80 tokens; half repeat a short pattern, which the model's output may pick up."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2:
            pattern = [rng.randrange(3, 400) for _ in range(rng.randrange(2, 6))]
            out.append([1] + (pattern * 40)[:rng.randrange(8, 80)])
        else:
            out.append([1] + [rng.randrange(3, 400) for _ in range(rng.randrange(4, 80))])
    return out


def run_all(stub, requests: list[pb.GenerateRequest]) -> list[Streamed]:
    with cf.ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda r: collect(stub, r), requests))


def mixed_requests() -> list[pb.GenerateRequest]:
    reqs = []
    for i, p in enumerate(prompts(12, seed=1)):
        stop = pb.StoppingCriteria(max_new_tokens=24 + i, ignore_eos=True,
                                   min_new_tokens=24 + i if i % 4 == 0 else 0)  # never drafts
        sampling = cpb.SamplingParams(temperature=0.8, top_k=20, seed=100 + i) if i % 3 == 2 else None
        reqs.append(ids_request(p, 24 + i, stopping=stop, sampling=sampling))
    return reqs


def test_concurrent_requests_equal_with_and_without_drafts(executor, spec, off):
    reqs = mixed_requests()
    assert any(len(r.token_ids.ids) > 16 for r in reqs)  # chunked prefill beside drafting decodes
    got, want = run_all(spec.stub, reqs), run_all(off.stub, reqs)
    for n, (r, g, w) in enumerate(zip(reqs, got, want)):
        assert g.token_ids == w.token_ids, f"request {n}"
        assert (g.text, g.finish_reason, g.usage.completion_tokens) == (w.text, w.finish_reason,
                                                                        w.usage.completion_tokens)
        assert w.usage.drafted_tokens == w.usage.accepted_tokens == 0
        assert g.usage.accepted_tokens <= g.usage.drafted_tokens
        if r.stopping.min_new_tokens:  # held back until min_new_tokens = max_new_tokens: never drafts
            assert g.usage.drafted_tokens == 0
    drafting = [g for r, g in zip(reqs, got) if not r.stopping.min_new_tokens]
    assert sum(g.usage.drafted_tokens > 0 for g in drafting) >= len(drafting) // 2
    assert max(g.usage.accepted_tokens for g in got) >= 5  # a request whose output copies its prompt's pattern
    wait_kv_free(executor.stub)


@pytest.fixture(scope="module")
def small_kv(request, model_dir):
    executor = start_for(request, model_dir, "--kv-blocks", "12")  # x 16 tokens: 192 for everyone
    return executor, start_scheduler_for(request, executor.address, *SPEC)


def test_preemption_mid_run_changes_no_output(small_kv, off):
    executor, squeezed = small_kv
    ps = prompts(8, seed=7)
    ps = [p[:40] for p in ps]  # each fits alone (<= 40 + 40 tokens); all together far from it
    stop = pb.StoppingCriteria(max_new_tokens=40, ignore_eos=True)
    reqs = [ids_request(p, 40, stopping=stop) for p in ps]
    reqs[1] = ids_request(ps[1], 40, stopping=stop, sampling=cpb.SamplingParams(temperature=0.9, seed=5,
                                                                                  presence_penalty=0.5))
    got, want = run_all(squeezed.stub, reqs), [collect(off.stub, r) for r in reqs]
    assert sum(g.usage.preemptions for g in got) > 0, "the pool was meant to be too small for all at once"
    assert sum(g.usage.drafted_tokens for g in got) > 0
    for n, (g, w) in enumerate(zip(got, want)):
        assert (g.token_ids, g.text) == (w.token_ids, w.text), f"request {n}"
    wait_kv_free(executor.stub)


# ------------------------------------------------------------------ SmolLM2: a copy-heavy prompt

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He polished the great lens, "
           "trimmed the wick, and wrote the weather in a leather logbook. Ships passed far out at sea, and none "
           "of them ever knew his name.")


def copy_request(max_new: int = 80, **stopping) -> pb.GenerateRequest:
    messages = pb.ChatMessages(messages=[pb.ChatMessage(
        role="user", content=f"Repeat the following text exactly, with no other words:\n\n{PASSAGE}")])
    return pb.GenerateRequest(messages=messages, stopping=pb.StoppingCriteria(max_new_tokens=max_new, **stopping))


@pytest.fixture(scope="module")
def smol(request, smollm2_dir):
    """(executor, speculating scheduler with the HTTP front and metrics, scheduler without)."""
    executor = start_for(request, smollm2_dir, "--kv-blocks", "64")
    on = start_scheduler_for(request, executor.address, *SPEC[:2], "--http-port", "0", "--metrics-port", "0")
    return executor, on, start_scheduler_for(request, executor.address, "--speculative", "off")


@pytest.fixture(scope="module")
def copied(smol) -> Streamed:
    """The copy request's answer without speculation."""
    return collect(smol[2].stub, copy_request())


@pytest.fixture(scope="module")
def copied_on(smol) -> tuple[Streamed, dict[str, float], dict[str, float]]:
    """The copy request's answer with speculation, and the speculating scheduler's metrics before and after."""
    before = scrape(smol[1])
    got = collect(smol[1].stub, copy_request())
    return got, before, scrape(smol[1])


@pytest.mark.slow
def test_copying_accepts_most_drafts_with_identical_tokens(smol, copied, copied_on):
    executor, on, _ = smol
    got, before, after = copied_on
    assert PASSAGE[:40] in copied.text  # the model really copies
    assert (got.token_ids, got.text, got.finish_reason) == (copied.token_ids, copied.text, copied.finish_reason)
    drafted, accepted = got.usage.drafted_tokens, got.usage.accepted_tokens
    assert drafted > 10 and accepted > 0.8 * drafted, (drafted, accepted)
    assert after["tandem:spec_decode_num_draft_tokens_total"] - before["tandem:spec_decode_num_draft_tokens_total"] \
        == drafted
    assert after["tandem:spec_decode_num_accepted_tokens_total"] \
        - before["tandem:spec_decode_num_accepted_tokens_total"] == accepted
    wait_kv_free(executor.stub)


def stopped_inside_a_run(got: Streamed) -> bool:
    """Whether the request ended before the last token of its last step: one stream message per step carries
    that step's tokens (accepted drafts + 1), and usage counts every draft accepted, streamed or not."""
    streamed_drafts = sum(len(m.token_ids) - 1 for m in got.messages if m.token_ids)
    return got.usage.accepted_tokens > streamed_drafts


@pytest.mark.slow
def test_stops_inside_accepted_runs(smol, copied, copied_on, smollm2_dir):
    """A stop token, a stop string and max_new_tokens each ending the copy inside a step's accepted run: the
    result is the one without drafts (tokens, text, finish reason)."""
    executor, on, off = smol
    ids = copied.token_ids
    # where the speculative run's steps end (the count of tokens after each message)
    ends = set(itertools.accumulate(len(m.token_ids) for m in copied_on[0].messages))
    inside = [i for i in range(len(ids) // 3, len(ids) - 1) if i + 1 not in ends]  # accepted drafts, not last
    assert len(inside) > len(ids) // 3
    k = next(i for i in inside if ids[i] not in ids[:i])  # a token first seen there
    tok = ModelTokenizer(smollm2_dir)
    j = next(i for i in inside[1:] if tok.decode(ids[:i + 1]).find(tok.decode(ids[i - 1:i + 1]).strip()) >=
             len(tok.decode(ids[:i - 1])))  # a stop string ending with token i, not seen before
    stop = tok.decode(ids[j - 1:j + 1]).strip()
    cases = [dict(stop_token_ids=[ids[k]]), dict(stop=[stop], include_stop_str_in_output=True)]
    for stopping in cases:
        got, want = collect(on.stub, copy_request(**stopping)), collect(off.stub, copy_request(**stopping))
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids, want.text, want.finish_reason, want.stop_reason), stopping
        assert got.usage.completion_tokens == want.usage.completion_tokens
        assert stopped_inside_a_run(got), stopping
        if "stop_token_ids" in stopping:
            assert got.token_ids == ids[:k + 1]
    for max_new in inside[len(inside) // 2:len(inside) // 2 + 1]:  # where an unlimited step would have gone on
        got, want = collect(on.stub, copy_request(max_new)), collect(off.stub, copy_request(max_new))
        assert got.token_ids == want.token_ids == ids[:max_new] and got.text == want.text
        assert got.finish_reason == want.finish_reason == pb.FINISH_REASON_LENGTH
        assert got.usage.accepted_tokens > 0
    wait_kv_free(executor.stub)


@pytest.mark.slow
def test_http_usage_reports_accepted_predictions(smol, copied):
    _, on, _ = smol
    client = openai.OpenAI(base_url=f"{on.process.http_url}/v1", api_key="unused", max_retries=0, timeout=120)
    content = f"Repeat the following text exactly, with no other words:\n\n{PASSAGE}"
    got = client.chat.completions.create(model="", messages=[{"role": "user", "content": content}], max_tokens=80,
                                         temperature=0)
    assert got.choices[0].message.content == copied.text
    details = got.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0.8 * (details.accepted_prediction_tokens
                                                       + details.rejected_prediction_tokens)
    assert details.accepted_prediction_tokens < got.usage.completion_tokens
