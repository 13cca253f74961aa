"""Suffix decoding end to end, both servers as real processes on SmolLM2: a scheduler with `--speculative
suffix` drafts a request's answer from the outputs of earlier requests, and its outputs equal those of a
scheduler with speculation off on the same executor (greedy; seeded sampling with logprobs).

A question answered once and then asked again (a retry; and the same question under another system prompt,
whose greedy answer is the same text): the repeat's prompt does not hold the answer, so only the earlier
output can draft it. Its tokens equal speculation-off's, most of them are accepted drafts, the drafts are
counted under method "suffix" in Prometheus, and vLLM's spec_decode counters say the same."""
from __future__ import annotations

import openai
import pytest

from tandem.generate.v1 import generate_pb2 as pb
from tests.e2e.test_prometheus_metrics import delta, scrape
from tests.grpc_harness import start_for, start_scheduler_for
from tests.scheduler_client import Streamed, collect, wait_kv_free

QUESTION = "Write three short sentences about the sea, each starting with 'The sea'."


def ask(system: str | None, max_new: int = 60) -> pb.GenerateRequest:
    messages = ([pb.ChatMessage(role="system", content=system)] if system else []) + [
        pb.ChatMessage(role="user", content=QUESTION)]
    return pb.GenerateRequest(messages=pb.ChatMessages(messages=messages),
                              stopping=pb.StoppingCriteria(max_new_tokens=max_new))


@pytest.fixture(scope="module")
def servers(request, smollm2_dir):
    """(executor, scheduler with --speculative suffix and metrics, scheduler without speculation)."""
    executor = start_for(request, smollm2_dir, "--kv-blocks", "64")
    on = start_scheduler_for(request, executor.address, "--speculative", "suffix", "--metrics-port", "0",
                             "--http-port", "0")
    return executor, on, start_scheduler_for(request, executor.address, "--speculative", "off", "--http-port", "0")


def accepted_share(got: Streamed) -> float:
    return got.usage.accepted_tokens / max(1, got.usage.completion_tokens)


@pytest.mark.slow
def test_a_repeated_answer_is_drafted_from_the_earlier_one(servers):
    executor, on, off = servers
    first = collect(on.stub, ask(None))
    want = collect(off.stub, ask(None))
    assert first.token_ids == want.token_ids and len(want.token_ids) > 20
    before = scrape(on)
    again = collect(on.stub, ask(None))  # a retry: the same request
    after = scrape(on)
    assert (again.token_ids, again.text, again.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert accepted_share(again) > 0.6, (again.usage.accepted_tokens, again.usage.completion_tokens)
    assert accepted_share(again) > accepted_share(first)
    suffix = 'method="suffix"'
    assert delta(after, before, f"tandem:spec_decode_accepted_tokens_by_method_total{{{suffix}}}") \
        >= again.usage.accepted_tokens - 8  # (a few may come from the request's own n-grams)
    assert delta(after, before, "vllm:spec_decode_num_accepted_tokens_total") == again.usage.accepted_tokens
    assert delta(after, before, "vllm:spec_decode_num_draft_tokens_total") == again.usage.drafted_tokens
    assert delta(after, before, 'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"}') > 0
    assert delta(after, before, "tandem:spec_decode_acceptance_length_count") > 0
    assert delta(after, before, "tandem:spec_decode_verify_seconds_total") > 0
    wait_kv_free(executor.stub)


@pytest.mark.slow
def test_another_system_prompt_gets_the_same_answer_with_drafts(servers):
    executor, on, off = servers
    system = "You are a helpful assistant. Keep answers short."
    want = collect(off.stub, ask(system))
    collect(on.stub, ask(None))  # (the earlier answer, under the default system prompt)
    got = collect(on.stub, ask(system))
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    base = collect(off.stub, ask(None))
    common = next((i for i, (x, y) in enumerate(zip(want.token_ids, base.token_ids)) if x != y),
                  min(len(want.token_ids), len(base.token_ids)))
    assert common >= 12  # (greedy: the two system prompts give answers with a long common start) ...
    assert got.usage.accepted_tokens >= common // 2, (common, got.usage.accepted_tokens)  # ... which was drafted
    wait_kv_free(executor.stub)


@pytest.mark.slow
def test_seeded_sampling_and_logprobs_are_unchanged_by_suffix_drafts(servers):
    """A seeded, sampled request asked twice through the OpenAI front (the second drafts from the first's output):
    the same tokens and the same logprobs as with speculation off."""
    executor, on, off = servers
    body = dict(model="", messages=[{"role": "user", "content": QUESTION}], max_tokens=40, temperature=0.7,
                seed=11, logprobs=True, top_logprobs=2)
    clients = {name: openai.OpenAI(base_url=f"{s.process.http_url}/v1", api_key="unused", max_retries=0, timeout=120)
               for name, s in (("on", on), ("off", off))}
    want = clients["off"].chat.completions.create(**body)
    first = clients["on"].chat.completions.create(**body)
    again = clients["on"].chat.completions.create(**body)
    for got in (first, again):
        assert got.choices[0].message.content == want.choices[0].message.content
        got_lp = [(t.token, round(t.logprob, 3), [a.token for a in t.top_logprobs]) for t in got.choices[0].logprobs.content]
        want_lp = [(t.token, round(t.logprob, 3), [a.token for a in t.top_logprobs]) for t in want.choices[0].logprobs.content]
        assert got_lp == want_lp
    assert again.usage.completion_tokens_details.accepted_prediction_tokens > 0.5 * again.usage.completion_tokens
    wait_kv_free(executor.stub)
