"""The translation between vLLM's engine protocol (as smg speaks it) and Tandem's own messages, in process: what
is refused names its field, every sampling and stopping field lands where GenerateService reads it, answers
have vLLM's shape (chunks, then one complete message), loads add up, and the tokenizer bundle holds the right
files. The same protocol through real processes and the real smg: tests/e2e/test_smg_grpc.py."""
from __future__ import annotations

import hashlib
import io
import zipfile

import pytest

from scheduler.text import tokenizer_bundle
from scheduler.compat import vllm_engine_codec as vcodec
from scheduler.executor.info import ExecutorStats
from scheduler.request import Delta, FinishReason, TokenLogprob, Usage
from tandem.errors import CheckpointError, InvalidRequest, Unsupported
from tandem.vendor.smg import vllm_engine_pb2 as vpb


def _request(**sampling) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(request_id="r", tokenized=vpb.TokenizedInput(input_ids=[3, 4, 5]),
                               sampling_params=vpb.SamplingParams(**sampling))


@pytest.mark.parametrize("request_, field", [
    (_request(prompt_logprobs=-1), "sampling_params.prompt_logprobs"),
    (_request(truncate_prompt_tokens=-1), "sampling_params.truncate_prompt_tokens"),
    (_request(structural_tag="{}"), "sampling_params.structural_tag"),
    (_request(logprobs=-1), "sampling_params.logprobs"),
    (_request(logprobs=21), "sampling_params.logprobs"),
    (_request(n=vcodec.MAX_N + 1), "sampling_params.n"),
    (vpb.GenerateRequest(mm_inputs=vpb.MultimodalInputs(mm_hashes=["h"])), "mm_inputs"),
    (vpb.GenerateRequest(extra_mm_inputs=[vpb.MultimodalInputs()]), "extra_mm_inputs"),
    (vpb.GenerateRequest(media_refs=vpb.MediaRefs(items=[vpb.MediaRef(url="data:,")])), "media_refs"),
    (vpb.GenerateRequest(kv_transfer_params=vpb.KvTransferParams(remote_host="h")), "kv_transfer_params"),
    (vpb.GenerateRequest(kv_transfer_params_json="{}"), "kv_transfer_params_json"),
    (vpb.GenerateRequest(data_parallel_rank=1), "data_parallel_rank"),
], ids=["prompt_logprobs-all", "truncate", "structural_tag", "logprobs-all", "logprobs-21", "n", "mm_inputs",
        "extra_mm_inputs", "media_refs", "kv_transfer_params", "kv_transfer_params_json", "dp_rank"])
def test_what_would_change_the_result_is_refused_naming_the_field(request_, field):
    with pytest.raises(InvalidRequest, match=f"^{field}: "):
        vcodec.check_supported(request_)


def test_harmless_fields_pass():
    request = _request(skip_special_tokens=True, spaces_between_special_tokens=True, n=1, logprobs=0)
    request.data_parallel_rank = 0  # the one rank there is
    request.tokenized.original_text = "the router's text of the same ids"
    vcodec.check_supported(request)
    assert list(vcodec.generate_request_to_pb(request).token_ids.ids) == [3, 4, 5]


@pytest.mark.parametrize("field, value", [("logit_bias", {-1: 1.0}), ("max_tokens", 0)])
def test_values_the_mapping_cannot_carry_are_refused(field, value):
    with pytest.raises(InvalidRequest, match=f"sampling_params.{field}"):
        vcodec.generate_request_to_pb(_request(**{field: value}))


def test_unset_sampling_fields_mean_what_they_mean_to_vllm():
    m = vcodec.generate_request_to_pb(_request())
    assert m.sampling.temperature == 1.0  # vLLM samples unless told otherwise
    assert not m.sampling.HasField("top_p") and not m.sampling.HasField("seed")
    assert (m.sampling.top_k, m.sampling.repetition_penalty) == (0, 0.0)  # off, as vLLM's 0 / unset 1
    assert m.stopping.max_new_tokens == 0  # the scheduler's default (and the model's room) decides
    assert m.top_logprobs == 0 and m.keep_special_tokens  # skip_special_tokens unset = False: keep them
    assert not m.HasField("constraint")


def test_every_sampling_and_stopping_field_lands_where_generate_service_reads_it():
    m = vcodec.generate_request_to_pb(_request(
        temperature=0.5, top_p=0.9, top_k=7, min_p=0.1, frequency_penalty=0.3, presence_penalty=-0.2,
        repetition_penalty=1.2, max_tokens=9, min_tokens=2, stop=["\n\n"], stop_token_ids=[2, 9], ignore_eos=True,
        include_stop_str_in_output=True, logprobs=3, seed=-1, logit_bias={5: -100.0}, skip_special_tokens=True,
        regex="[a-z]+"))
    s, stop = m.sampling, m.stopping
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == pytest.approx((0.5, 0.9, 7, 0.1))
    assert (s.frequency_penalty, s.presence_penalty, s.repetition_penalty) == pytest.approx((0.3, -0.2, 1.2))
    assert s.seed == 2**64 - 1 and dict(s.logit_bias) == {5: -100.0}
    assert (stop.max_new_tokens, stop.min_new_tokens, list(stop.stop), list(stop.stop_token_ids)) == \
        (9, 2, ["\n\n"], [2, 9])
    assert stop.ignore_eos and stop.include_stop_str_in_output
    assert m.top_logprobs == 3 and not m.keep_special_tokens and m.constraint.regex == "[a-z]+"
    assert not m.HasField("prompt_logprobs")
    assert vcodec.generate_request_to_pb(_request(prompt_logprobs=0)).prompt_logprobs == 0


@pytest.mark.parametrize("constraint, kind", [
    ({"json_schema": '{"type": "object"}'}, "json_schema"), ({"grammar": 'root ::= "a"'}, "grammar"),
    ({"json_object": True}, "json_object"), ({"choice": vpb.ChoiceConstraint(choices=["yes", "no"])}, "choice"),
])
def test_constraints_map_one_to_one(constraint, kind):
    m = vcodec.generate_request_to_pb(_request(**constraint))
    assert m.constraint.WhichOneof("kind") == kind
    if kind == "choice":
        assert list(m.constraint.choice.choices) == ["yes", "no"]


def test_text_input_is_taken_as_text():
    m = vcodec.generate_request_to_pb(vpb.GenerateRequest(text="hello"))
    assert m.WhichOneof("input") == "text" and m.text == "hello"


def _tokens(*ids: int) -> list[TokenLogprob]:
    return [TokenLogprob(i, -0.5 * i, ((i, -0.5 * i), (i + 1, -9.0), (i + 2, -10.0))) for i in ids]


def test_a_streamed_answer_is_chunks_then_the_complete_message_with_the_last_delta():
    answer = vcodec.Answer(index=0, prompt_ids=(1, 2, 3), logprobs=2, stream=True)
    first = answer.messages(Delta(text="ab", tokens=_tokens(7, 8)), cached_tokens=2)
    assert [m.WhichOneof("response") for m in first] == ["chunk"]
    chunk = first[0].chunk
    assert (list(chunk.token_ids), chunk.prompt_tokens, chunk.completion_tokens, chunk.cached_tokens) == \
        ([7, 8], 3, 2, 2)
    assert list(chunk.output_logprobs.token_ids) == [7, 8]
    assert [list(t.token_ids) for t in chunk.output_logprobs.top_logprobs] == [[7, 8], [8, 9]]
    last = answer.messages(Delta(tokens=_tokens(2), finish_reason=FinishReason.STOP, stop_reason="2",
                                 usage=Usage(3, 3, cached_tokens=2)), cached_tokens=2)
    assert [m.WhichOneof("response") for m in last] == ["chunk", "complete"]
    complete = last[1].complete
    assert (list(complete.output_ids), complete.finish_reason, complete.completion_tokens) == ([2], "stop", 3)
    assert complete.WhichOneof("matched_stop") == "matched_token_id" and complete.matched_token_id == 2


def test_prompt_logprobs_go_on_the_first_chunk_and_the_complete_message_the_first_token_without_a_value():
    answer = vcodec.Answer(index=0, prompt_ids=(1, 2, 3), logprobs=None, stream=True, prompt_logprobs=1)
    scored = tuple(_tokens(2, 3))  # positions 1 and 2, each scored from the one before
    (first,) = answer.messages(Delta(tokens=_tokens(9), prompt_logprobs=scored), cached_tokens=0)
    given = first.chunk.input_logprobs
    assert list(given.token_ids) == [1, 2, 3]
    assert [v.HasField("value") for v in given.token_logprobs] == [False, True, True]
    assert [v.value for v in given.token_logprobs[1:]] == [-1.0, -1.5]
    assert [list(t.token_ids) for t in given.top_logprobs] == [[], [2], [3]]
    (second, last) = answer.messages(Delta(tokens=_tokens(8), finish_reason=FinishReason.LENGTH, usage=Usage(3, 2)),
                                     cached_tokens=0)
    assert not second.chunk.HasField("input_logprobs")
    assert last.complete.input_logprobs == given


def test_a_stop_string_is_reported_as_matched_stop_str():
    answer = vcodec.Answer(index=1, prompt_ids=(1, 2, 3), logprobs=None, stream=True)
    (complete,) = answer.messages(Delta(finish_reason=FinishReason.STOP_SEQUENCE, stop_reason="\n\n",
                                        usage=Usage(3, 4)), cached_tokens=0)
    c = complete.complete
    assert (c.finish_reason, c.matched_stop_str, c.index) == ("stop", "\n\n", 1)
    assert not c.HasField("output_logprobs")


def test_an_answer_not_streamed_is_one_complete_message_with_every_token():
    answer = vcodec.Answer(index=0, prompt_ids=(1, 2, 3), logprobs=0, stream=False)
    assert answer.messages(Delta(tokens=_tokens(4)), cached_tokens=0) == []
    (only,) = answer.messages(Delta(tokens=_tokens(5), finish_reason=FinishReason.LENGTH, usage=Usage(3, 2)), 0)
    c = only.complete
    assert (list(c.output_ids), c.finish_reason, list(c.output_logprobs.token_ids)) == ([4, 5], "length", [4, 5])
    assert len(c.output_logprobs.top_logprobs) == 0  # logprobs=0: the sampled token's alone, as vLLM's
    assert c.WhichOneof("matched_stop") is None


def test_aborted_is_vllms_abort():
    (m,) = vcodec.Answer(0, (1,), None, True).messages(Delta(finish_reason=FinishReason.ABORTED, usage=Usage(1, 0)), 0)
    assert m.complete.finish_reason == "abort"


def _stats(address: str, state: str, running: int, waiting: int, free: int, total: int) -> ExecutorStats:
    return ExecutorStats(address, state, "", running, waiting, free, 0, total, "cpu", "i")


def test_loads_are_the_whole_scheduler_as_one_rank():
    loads = vcodec.loads_to_pb([_stats("a", "serving", 2, 1, 30, 100), _stats("b", "serving", 1, 0, 90, 100),
                                _stats("c", "unreachable", 0, 3, 0, 0)], max_running=64, version="v")
    (load,) = loads.loads
    assert (loads.dp_rank_count, load.num_running_reqs, load.num_waiting_reqs, load.num_total_reqs) == (1, 3, 4, 7)
    assert load.token_usage == pytest.approx(80 / 200) and load.max_running_requests == 128


def test_the_tokenizer_bundle_holds_the_tokenizer_files_and_the_schedulers_chat_template(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": {}}')
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "chat_template.jinja").write_text("the directory's")
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 64)
    plain = tokenizer_bundle.build(tmp_path)
    assert plain.sha256 == hashlib.sha256(plain.data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(plain.data)) as zf:
        assert sorted(zf.namelist()) == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    override = tokenizer_bundle.build(tmp_path, chat_template="the scheduler's")
    with zipfile.ZipFile(io.BytesIO(override.data)) as zf:
        assert zf.read("chat_template.jinja") == b"the scheduler's"
    assert b"".join(override.chunks()) == override.data


def test_the_tokenizer_bundle_refuses_a_gguf_file_and_an_empty_directory(tmp_path):
    with pytest.raises(Unsupported, match="GGUF"):
        tokenizer_bundle.build(tmp_path / "model.gguf")
    with pytest.raises(CheckpointError, match="no tokenizer files"):
        tokenizer_bundle.build(tmp_path)
