"""scheduler.rpc.codec: tandem.generate.v1 requests -> domain objects, with the checks and their domain errors."""
from __future__ import annotations

import math

import pytest

from tandem.errors import AdapterNotFound, InvalidRequest, SequenceTooLong
from tandem.sampling_params import SamplingParams
from tandem.common.v1 import common_pb2 as cpb
from tandem.executor.v1 import executor_pb2 as epb
from tandem.generate.v1 import generate_pb2 as pb
from scheduler.engine.executor_codec import item_results_from_pb
from scheduler.rpc.codec import (MAX_CHAT_MESSAGES, MAX_REQUEST_ID_CHARS, MAX_STOP_CHARS, MAX_STOP_STRINGS,
                             MAX_TOP_LOGPROBS, check_input_size, delta_to_pb, request_from_pb,
                             sampling_params_from_pb)
from tandem.codec import sampling_to_pb
from scheduler.request import Delta, FinishReason, StoppingCriteria, TokenLogprob, Usage
from scheduler.text.tokenizer import ChatMessage

MAX_SEQ_LEN = 64
DEFAULT_MAX_NEW = 16


@pytest.fixture(scope="module")
def info(tok) -> epb.GetInfoResponse:
    return epb.GetInfoResponse(model_id="SmolLM2-135M-Instruct", architecture="LlamaForCausalLM",
                               vocab_size=tok.vocab_size, max_seq_len=MAX_SEQ_LEN, eos_token_ids=[2],
                               adapters=["lora-a", "lora-b"], dtype="float32", device="cpu")


@pytest.fixture
def parse(tok, info):
    def run(default_max_new: int = DEFAULT_MAX_NEW, **fields):
        fields.setdefault("token_ids", pb.TokenIds(ids=[1, 2, 3]))
        if "text" in fields or "messages" in fields:
            del fields["token_ids"]
        return request_from_pb(pb.GenerateRequest(**fields), tok, info, default_max_new)

    return run


def ids(n: int, start: int = 10) -> pb.TokenIds:
    return pb.TokenIds(ids=list(range(start, start + n)))


# ------------------------------------------------------------------ inputs


def test_text_input_is_tokenized(parse, tok):
    req = parse(text="Hello world")
    assert list(req.prompt_ids) == tok.encode("Hello world")


def test_messages_input_uses_the_chat_template(parse, tok):
    msgs = [("system", "Be brief."), ("user", "Hi")]
    req = parse(messages=pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in msgs]))
    assert list(req.prompt_ids) == tok.encode_chat([ChatMessage(r, c) for r, c in msgs])


def test_token_ids_input_is_used_as_is(parse, tok):
    req = parse(token_ids=pb.TokenIds(ids=[5, 0, tok.vocab_size - 1]))
    assert req.prompt_ids == (5, 0, tok.vocab_size - 1)


def test_no_input(tok, info):
    with pytest.raises(InvalidRequest, match="no input"):
        request_from_pb(pb.GenerateRequest(request_id="x"), tok, info, DEFAULT_MAX_NEW)


@pytest.mark.parametrize("fields", [
    {"text": ""},
    {"token_ids": pb.TokenIds()},
    {"messages": pb.ChatMessages()},
], ids=["empty-text", "empty-token-ids", "empty-messages"])
def test_empty_inputs(parse, fields):
    with pytest.raises(InvalidRequest, match="empty"):
        parse(**fields)


def test_token_id_out_of_vocab(parse, tok):
    with pytest.raises(InvalidRequest, match="out of range"):
        parse(token_ids=pb.TokenIds(ids=[1, tok.vocab_size, 3]))


# ------------------------------------------------------------------ sampling


@pytest.mark.parametrize("sampling", [
    cpb.SamplingParams(temperature=-1),
    cpb.SamplingParams(temperature=math.nan),
    cpb.SamplingParams(temperature=math.inf),
    cpb.SamplingParams(top_p=0.0),  # explicit 0
    cpb.SamplingParams(top_p=1.5),
    cpb.SamplingParams(top_p=-0.1),
    cpb.SamplingParams(min_p=1.5),
    cpb.SamplingParams(repetition_penalty=-1),
    cpb.SamplingParams(presence_penalty=2.5),
    cpb.SamplingParams(frequency_penalty=-3),
    cpb.SamplingParams(logit_bias={49152: 1.0}),
    cpb.SamplingParams(logit_bias={5: 101.0}),
    cpb.SamplingParams(logit_bias={5: math.nan}),
], ids=lambda m: str(m).replace("\n", " ").strip())
def test_bad_sampling_is_invalid(parse, sampling):
    with pytest.raises(InvalidRequest, match="sampling"):
        parse(sampling=sampling)


@pytest.mark.parametrize("sampling", [
    cpb.SamplingParams(),
    cpb.SamplingParams(top_p=1.0),
    cpb.SamplingParams(top_p=1e-3, temperature=2.0, top_k=5),
    cpb.SamplingParams(seed=0),
    cpb.SamplingParams(seed=2**64 - 1),
    cpb.SamplingParams(logit_bias={0: -100.0, 49151: 100.0}),
    cpb.SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=1.0, min_p=1.0),
], ids=lambda m: str(m).replace("\n", " ").strip() or "unset")
def test_good_sampling_is_accepted(parse, sampling):
    parse(sampling=sampling)


def test_sampling_defaults_are_greedy(parse):
    assert parse().sampling == SamplingParams()
    assert parse().sampling.is_greedy


def _full_sampling() -> cpb.SamplingParams:
    return cpb.SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                             presence_penalty=0.5, frequency_penalty=-0.25, seed=1234567890123,
                             logit_bias={7: 2.5, 300: -100.0, 49151: 0.125})


def test_both_services_take_one_sampling_message():
    # One SamplingParams (tandem.common.v1) for Generate and every executor call: nothing to keep in sync.
    want = cpb.SamplingParams.DESCRIPTOR
    assert pb.GenerateRequest.DESCRIPTOR.fields_by_name["sampling"].message_type is want
    for msg in (epb.UnifiedItem, epb.DecodeItem, epb.PrefillRequest):
        assert msg.DESCRIPTOR.fields_by_name["sampling"].message_type is want
    logprob = pb.GenerateResponse.DESCRIPTOR.fields_by_name["logprobs"].message_type
    assert logprob is epb.SequenceOutput.DESCRIPTOR.fields_by_name["tokens"].message_type


def test_sampling_from_pb_fields(tok):
    m = _full_sampling()
    p = sampling_params_from_pb(m, tok.vocab_size)
    assert p.temperature == pytest.approx(0.7) and p.top_k == 40 and p.top_p == pytest.approx(0.9)
    assert p.min_p == pytest.approx(0.05) and p.repetition_penalty == pytest.approx(1.1)
    assert p.presence_penalty == 0.5 and p.frequency_penalty == -0.25
    assert p.seed == 1234567890123
    assert p.logit_bias == {7: 2.5, 300: -100.0, 49151: 0.125}
    unset = sampling_params_from_pb(cpb.SamplingParams(), tok.vocab_size)
    assert unset.top_p == 0.0 and unset.seed is None


@pytest.mark.parametrize("m", [
    _full_sampling(),
    cpb.SamplingParams(),
    cpb.SamplingParams(top_p=1.0, seed=0),
    cpb.SamplingParams(temperature=1.3, logit_bias={1: 1.0}),
], ids=["full", "unset", "top_p-1-seed-0", "temp-bias"])
def test_sampling_round_trips_to_the_executor(tok, m):
    e = sampling_to_pb(sampling_params_from_pb(m, tok.vocab_size))
    assert e == m
    assert e.HasField("top_p") == m.HasField("top_p")
    assert e.HasField("seed") == m.HasField("seed")


# ------------------------------------------------------------------ request fields


def test_top_logprobs_limit(parse):
    assert parse(top_logprobs=MAX_TOP_LOGPROBS).top_logprobs == MAX_TOP_LOGPROBS
    with pytest.raises(InvalidRequest, match="top_logprobs"):
        parse(top_logprobs=MAX_TOP_LOGPROBS + 1)


def test_request_id(parse):
    assert parse(request_id="abc").request_id == "abc"
    assert parse(request_id="x" * MAX_REQUEST_ID_CHARS).request_id == "x" * MAX_REQUEST_ID_CHARS
    with pytest.raises(InvalidRequest, match="request_id"):
        parse(request_id="x" * (MAX_REQUEST_ID_CHARS + 1))
    a, b = parse().request_id, parse().request_id  # unset: made up, unique
    assert a and b and a != b


def test_adapters(parse):
    assert parse(adapter="lora-b").adapter == "lora-b"
    assert parse().adapter == ""
    with pytest.raises(AdapterNotFound, match="nope"):
        parse(adapter="nope")


def test_keep_special_tokens(parse):
    assert parse().keep_special_tokens is False
    assert parse(keep_special_tokens=True).keep_special_tokens is True


# ------------------------------------------------------------------ stopping


def test_stopping_fields(parse):
    req = parse(stopping=pb.StoppingCriteria(max_new_tokens=20, min_new_tokens=2, stop=["###", "\n\n"],
                                             stop_token_ids=[2, 7], ignore_eos=True,
                                             include_stop_str_in_output=True))
    assert req.stopping == StoppingCriteria(20, 2, ("###", "\n\n"), frozenset({2, 7}), True, True)


def test_default_max_new_tokens(parse):
    assert parse(token_ids=ids(10)).stopping.max_new_tokens == DEFAULT_MAX_NEW
    # shortened to the room the prompt leaves
    assert parse(token_ids=ids(MAX_SEQ_LEN - 4)).stopping.max_new_tokens == 4
    assert parse(token_ids=ids(MAX_SEQ_LEN - 1)).stopping.max_new_tokens == 1
    assert parse(token_ids=ids(10), default_max_new=1000).stopping.max_new_tokens == MAX_SEQ_LEN - 10


def test_prompt_too_long(parse):
    with pytest.raises(SequenceTooLong):
        parse(token_ids=ids(MAX_SEQ_LEN))
    with pytest.raises(SequenceTooLong):
        parse(token_ids=ids(MAX_SEQ_LEN + 5))


def test_prompt_plus_explicit_max_new_too_long(parse):
    ok = parse(token_ids=ids(10), stopping=pb.StoppingCriteria(max_new_tokens=MAX_SEQ_LEN - 10))
    assert ok.stopping.max_new_tokens == MAX_SEQ_LEN - 10
    with pytest.raises(SequenceTooLong, match="max_new_tokens"):
        parse(token_ids=ids(10), stopping=pb.StoppingCriteria(max_new_tokens=MAX_SEQ_LEN - 9))


def test_min_new_tokens_above_max_new(parse):
    assert parse(stopping=pb.StoppingCriteria(max_new_tokens=5, min_new_tokens=5)).stopping.min_new_tokens == 5
    with pytest.raises(InvalidRequest, match="min_new_tokens"):
        parse(stopping=pb.StoppingCriteria(max_new_tokens=5, min_new_tokens=6))
    with pytest.raises(InvalidRequest, match="min_new_tokens"):  # against the default max_new_tokens
        parse(stopping=pb.StoppingCriteria(min_new_tokens=DEFAULT_MAX_NEW + 1))


def test_stop_strings_limits(parse):
    parse(stopping=pb.StoppingCriteria(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)]))
    parse(stopping=pb.StoppingCriteria(stop=["x" * MAX_STOP_CHARS]))
    with pytest.raises(InvalidRequest, match=r"^stopping.stop holds 17 strings") as e:
        parse(stopping=pb.StoppingCriteria(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]))
    assert e.value.field == "stopping.stop"
    with pytest.raises(InvalidRequest, match=r"^stopping.stop\[0\] has .* stop strings have 1\.\.") as e:
        parse(stopping=pb.StoppingCriteria(stop=["x" * (MAX_STOP_CHARS + 1)]))
    assert e.value.in_terms("stop.0").startswith("stop.0 has")  # the HTTP front's name for it
    with pytest.raises(InvalidRequest, match=r"^stopping.stop\[1\] has 0 characters"):
        parse(stopping=pb.StoppingCriteria(stop=["ok", ""]))


def test_stop_token_id_out_of_vocab(parse, tok):
    parse(stopping=pb.StoppingCriteria(stop_token_ids=[tok.vocab_size - 1]))
    with pytest.raises(InvalidRequest, match="stopping.stop_token_ids holds token id"):
        parse(stopping=pb.StoppingCriteria(stop_token_ids=[2, tok.vocab_size]))


# ------------------------------------------------------------------ responses


def test_delta_to_pb():
    d = Delta("hi", [TokenLogprob(5, -0.25, ((5, -0.25), (9, -2.0))), TokenLogprob(2, -0.5)],
              FinishReason.STOP, "2", Usage(7, 2, 0, 1))
    m = delta_to_pb("req", d)
    assert (m.request_id, m.text, list(m.token_ids), m.stop_reason) == ("req", "hi", [5, 2], "2")
    assert m.finish_reason == pb.FINISH_REASON_STOP
    assert [(lp.token_id, lp.logprob) for lp in m.logprobs] == [(5, -0.25), (2, -0.5)]
    assert [(t.token_id, t.logprob) for t in m.logprobs[0].top_logprobs] == [(5, -0.25), (9, -2.0)]
    assert list(m.logprobs[1].top_logprobs) == []
    assert (m.usage.prompt_tokens, m.usage.completion_tokens, m.usage.preemptions) == (7, 2, 1)
    mid = delta_to_pb("req", Delta("x", [TokenLogprob(5, -1.0)]))
    assert mid.finish_reason == pb.FINISH_REASON_UNSPECIFIED and not mid.HasField("usage")


def test_input_size_limits_are_checked_before_tokenizing():
    check_input_size(pb.GenerateRequest(text="x" * 100), max_chars=100)
    with pytest.raises(InvalidRequest, match="101 characters; this scheduler takes at most 100"):
        check_input_size(pb.GenerateRequest(text="x" * 101), max_chars=100)
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="y" * 50)] * 2)  # 2 x (4 + 50)
    check_input_size(pb.TokenizeRequest(messages=chat), max_chars=108)
    with pytest.raises(InvalidRequest, match="108 characters in all"):
        check_input_size(pb.TokenizeRequest(messages=chat), max_chars=107)
    many = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="")] * (MAX_CHAT_MESSAGES + 1))
    with pytest.raises(InvalidRequest, match=f"at most {MAX_CHAT_MESSAGES}"):
        check_input_size(pb.GenerateRequest(messages=many), max_chars=10**9)
    check_input_size(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 1000)), max_chars=10)  # not text


def test_item_results_carry_per_item_statuses():
    resp = epb.UnifiedDecodeResponse(results=[
        epb.UnifiedResult(cache=epb.CacheRef(cache_id="a" * 32, seq_len=5),
                          output=epb.SequenceOutput(tokens=[cpb.TokenLogprob(token_id=7, logprob=-0.5)])),
        epb.UnifiedResult(cache=epb.CacheRef(cache_id="b" * 32, seq_len=3),
                          status=epb.ItemStatus(code=5, message="unknown adapter 'x'")),
        epb.UnifiedResult(cache=epb.CacheRef(cache_id="c" * 32, seq_len=9), status=epb.ItemStatus(code=0))])
    ok, failed, unset_ok = item_results_from_pb(resp)
    assert ok.error is None and [t.token_id for t in ok.tokens] == [7]
    assert failed.tokens == () and failed.error.status_name == "NOT_FOUND"
    assert "unknown adapter 'x'" in str(failed.error)
    assert unset_ok.error is None and unset_ok.tokens == () and unset_ok.seq_len == 9


def test_cache_salt(parse):
    assert parse().cache_salt == "" and parse(cache_salt="tenant-a").cache_salt == "tenant-a"
    assert parse(cache_salt="s" * 256).cache_salt == "s" * 256
    with pytest.raises(InvalidRequest, match="cache_salt"):
        parse(cache_salt="s" * 257)
