"""vLLM's engine protocol (vllm.grpc.engine, as SGLang's gateway smg speaks it) <-> Tandem's own messages.

A Generate request becomes the tandem.generate.v1 GenerateRequest that GenerateService takes, so from there
codec.request_from_pb validates and tokenizes exactly as for any gRPC client, and both services generate the
same tokens for the same request. Fields that would change the result and that Tandem does not do are refused
here with INVALID_ARGUMENT naming the field (never dropped); fields that only shape text smg never reads from
us (we return token ids, smg detokenizes) are ignored, each with the reason beside it.

Answers follow vLLM's own servicer (vllm/entrypoints/grpc_server.py, which smg is built against): streamed,
one GenerateStreamChunk per delta, then one GenerateComplete with the finish reason, the matched stop and
the last delta again (vLLM's DELTA mode: smg accumulates the chunks); not streamed, one GenerateComplete with
every token.
"""
from __future__ import annotations

from datetime import datetime, timezone

from scheduler.executor.info import ExecutorInfo, ExecutorStats
from scheduler.request import Delta, FinishReason, TokenLogprob
from tandem.common.v1 import common_pb2 as cpb
from tandem.errors import InvalidRequest
from tandem.generate.v1 import generate_pb2 as pb
from tandem.sampling_params import MAX_TOP_LOGPROBS
from tandem.vendor.smg import vllm_engine_pb2 as vpb

SERVER_TYPE = "tandem"  # GetServerInfo.server_type (vLLM answers "vllm-grpc")
MODEL_PATH_SCHEME = "tandem://"  # GetModelInfo.model_path: tandem://<served name>
MAX_N = 16  # choices one Generate call may ask for (each is a request of its own on the scheduler)
_FINISH = {FinishReason.LENGTH: "length", FinishReason.STOP: "stop", FinishReason.STOP_SEQUENCE: "stop",
           FinishReason.ABORTED: "abort"}  # vLLM's finish_reason strings


def _refuse(field: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"{field}: {why}")


def check_supported(m: vpb.GenerateRequest) -> None:
    """Refuses what Tandem does not do and what would change the result if it were dropped."""
    if m.HasField("mm_inputs") or len(m.extra_mm_inputs) or m.HasField("media_refs"):
        field = "mm_inputs" if m.HasField("mm_inputs") else "extra_mm_inputs" if len(m.extra_mm_inputs) \
            else "media_refs"
        raise _refuse(field, "multimodal input is not supported: Tandem serves text-only models")
    if m.HasField("kv_transfer_params") or m.HasField("kv_transfer_params_json"):
        field = "kv_transfer_params" if m.HasField("kv_transfer_params") else "kv_transfer_params_json"
        raise _refuse(field, "prefill/decode disaggregation (KV transfer between workers) is not supported; "
                             "route to Tandem as a regular worker")
    if m.HasField("data_parallel_rank") and m.data_parallel_rank != 0:
        raise _refuse("data_parallel_rank", f"this worker has one data-parallel rank (0), got {m.data_parallel_rank}")
    s = m.sampling_params
    if s.HasField("prompt_logprobs") and not 0 <= s.prompt_logprobs <= MAX_TOP_LOGPROBS:
        raise _refuse("sampling_params.prompt_logprobs", f"must be 0..{MAX_TOP_LOGPROBS} alternatives per prompt "
                                                         f"token (-1 is not served), got {s.prompt_logprobs}")
    if s.HasField("truncate_prompt_tokens"):
        raise _refuse("sampling_params.truncate_prompt_tokens", "prompt truncation is not supported; send a prompt "
                                                                "that fits the model")
    if s.WhichOneof("constraint") == "structural_tag":
        raise _refuse("sampling_params.structural_tag", "structural tags are not supported; use json_schema, "
                                                        "regex, grammar, json_object or choice")
    if s.HasField("logprobs") and not 0 <= s.logprobs <= MAX_TOP_LOGPROBS:
        raise _refuse("sampling_params.logprobs", f"must be 0..{MAX_TOP_LOGPROBS} alternatives per token "
                                                  f"(-1, the whole vocabulary, is not served), got {s.logprobs}")
    if s.n > MAX_N:
        raise _refuse("sampling_params.n", f"at most {MAX_N} choices per request, got {s.n}")


def choices_of(m: vpb.GenerateRequest) -> int:
    """How many choices the request asks for (vLLM's unset n is 1)."""
    return m.sampling_params.n or 1


def generate_request_to_pb(m: vpb.GenerateRequest) -> pb.GenerateRequest:
    """The GenerateService request this one means (after check_supported)."""
    s = m.sampling_params
    out = pb.GenerateRequest(request_id=m.request_id, sampling=_sampling(s), stopping=_stopping(s),
                             top_logprobs=max(s.logprobs, 0) if s.HasField("logprobs") else 0,
                             # vLLM's default keeps special tokens out of text; ours is the same switch
                             keep_special_tokens=not s.skip_special_tokens)
    # spaces_between_special_tokens shapes detokenized text only, which smg does itself from our token ids.
    if s.HasField("prompt_logprobs"):
        out.prompt_logprobs = s.prompt_logprobs
    if m.WhichOneof("input") == "tokenized":
        # original_text is the router's text of the same prompt, "for reference": the ids are what runs
        out.token_ids.ids.extend(m.tokenized.input_ids)
    elif m.WhichOneof("input") == "text":
        out.text = m.text
    kind = s.WhichOneof("constraint")
    if kind == "choice":
        out.constraint.choice.choices.extend(s.choice.choices)
    elif kind == "json_object":
        out.constraint.json_object.SetInParent()
    elif kind is not None:  # json_schema, regex, grammar: the same names and meaning
        setattr(out.constraint, kind, getattr(s, kind))
    return out


def _sampling(s: vpb.SamplingParams) -> cpb.SamplingParams:
    # vLLM's defaults for unset fields: temperature 1 (sampling), top_p 0 = 1 = off, repetition_penalty 0 = 1 =
    # off, top_k 0 = off: the same "off" values as ours.
    out = cpb.SamplingParams(temperature=s.temperature if s.HasField("temperature") else 1.0, top_k=s.top_k,
                             min_p=s.min_p, repetition_penalty=s.repetition_penalty,
                             presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty)
    if s.top_p and s.top_p != 1.0:
        out.top_p = s.top_p
    if s.HasField("seed"):
        out.seed = s.seed % 2**64  # the wire's int32; a negative seed is still one fixed seed
    for token_id, bias in s.logit_bias.items():
        if token_id < 0:
            raise _refuse("sampling_params.logit_bias", f"token ids are >= 0, got {token_id}")
        out.logit_bias[token_id] = bias
    return out


def _stopping(s: vpb.SamplingParams) -> pb.StoppingCriteria:
    if s.HasField("max_tokens") and s.max_tokens == 0:
        raise _refuse("sampling_params.max_tokens", "must be >= 1 when set (unset: the scheduler's default)")
    return pb.StoppingCriteria(max_new_tokens=s.max_tokens if s.HasField("max_tokens") else 0,
                               min_new_tokens=s.min_tokens, stop=list(s.stop), stop_token_ids=list(s.stop_token_ids),
                               ignore_eos=s.ignore_eos, include_stop_str_in_output=s.include_stop_str_in_output)


def output_logprobs(tokens: list[TokenLogprob], top: int) -> vpb.OutputLogProbs:
    out = vpb.OutputLogProbs(token_logprobs=[t.logprob for t in tokens], token_ids=[t.token_id for t in tokens])
    if top:
        for t in tokens:
            out.top_logprobs.add(token_ids=[tid for tid, _ in t.top[:top]], values=[v for _, v in t.top[:top]])
    return out


def input_logprobs(prompt_ids: tuple[int, ...], scored: tuple[TokenLogprob, ...], top: int) -> vpb.InputLogProbs:
    """vLLM's prompt logprobs: one entry per prompt token, the first without a value (nothing comes before it)."""
    out = vpb.InputLogProbs(token_ids=prompt_ids)
    out.token_logprobs.add()
    out.top_logprobs.add()
    for t in scored:
        out.token_logprobs.add(value=t.logprob)
        out.top_logprobs.add(token_ids=[tid for tid, _ in t.top[:top]], values=[v for _, v in t.top[:top]])
    return out


class Answer:
    """One choice's stream in vLLM's shape: chunks while it runs, the complete message at its end."""

    def __init__(self, index: int, prompt_ids: tuple[int, ...], logprobs: int | None, stream: bool,
                 prompt_logprobs: int | None = None) -> None:
        """logprobs, prompt_logprobs: alternatives per token the request asked for; None: it asked for none."""
        self.index = index
        self._prompt_ids = prompt_ids
        self._prompt_tokens = len(prompt_ids)
        self._logprobs = logprobs
        self._prompt_logprobs = prompt_logprobs
        self._stream = stream
        self._tokens: list[TokenLogprob] = []  # not streamed: every token, for the one complete message
        self._input: vpb.InputLogProbs | None = None  # the prompt's logprobs, once they came
        self._input_sent = False  # (streamed: on the first chunk only)

    def messages(self, d: Delta, cached_tokens: int) -> list[vpb.GenerateResponse]:
        """What one delta of this choice sends. cached_tokens: its prompt tokens the prefix cache served."""
        out = []
        if d.prompt_logprobs is not None and self._prompt_logprobs is not None:
            self._input = input_logprobs(self._prompt_ids, d.prompt_logprobs, self._prompt_logprobs)
        if self._stream and d.tokens:
            chunk = vpb.GenerateStreamChunk(token_ids=[t.token_id for t in d.tokens], index=self.index,
                                            prompt_tokens=self._prompt_tokens, completion_tokens=len(d.tokens),
                                            cached_tokens=cached_tokens)
            if self._logprobs is not None:
                chunk.output_logprobs.CopyFrom(output_logprobs(d.tokens, self._logprobs))
            if self._input is not None and not self._input_sent:
                chunk.input_logprobs.CopyFrom(self._input)
                self._input_sent = True
            out.append(vpb.GenerateResponse(chunk=chunk))
        if not self._stream:
            self._tokens += d.tokens
        if d.finish_reason is not None:
            out.append(vpb.GenerateResponse(complete=self._complete(d)))
        return out

    def _complete(self, d: Delta) -> vpb.GenerateComplete:
        tokens = d.tokens if self._stream else self._tokens  # streamed: the last delta, as vLLM sends it
        usage = d.usage
        out = vpb.GenerateComplete(output_ids=[t.token_id for t in tokens], finish_reason=_FINISH[d.finish_reason],
                                   prompt_tokens=self._prompt_tokens, index=self.index,
                                   completion_tokens=usage.completion_tokens if usage else len(tokens),
                                   cached_tokens=usage.cached_tokens if usage else 0,
                                   spec_accepted_tokens=usage.accepted_tokens if usage else 0,
                                   spec_draft_tokens=usage.drafted_tokens if usage else 0)
        if self._logprobs is not None and tokens:
            out.output_logprobs.CopyFrom(output_logprobs(tokens, self._logprobs))
        if self._input is not None:  # (vLLM's complete message carries them, streamed or not)
            out.input_logprobs.CopyFrom(self._input)
        if d.finish_reason is FinishReason.STOP and d.stop_reason.isdigit():
            out.matched_token_id = int(d.stop_reason)  # an EOS or stop token id
        elif d.finish_reason is FinishReason.STOP_SEQUENCE:
            out.matched_stop_str = d.stop_reason
        return out


def model_info_to_pb(info: ExecutorInfo, served_name: str) -> vpb.GetModelInfoResponse:
    # model_path names no host path (the executor's directory is never shown to clients), nor anything a router
    # could load a tokenizer from (smg reads it as a local path or a Hugging Face id, where a served name might
    # find another model's): so smg loads the tokenizer from its own --model-path, or from GetTokenizer.
    return vpb.GetModelInfoResponse(
        model_path=f"{MODEL_PATH_SCHEME}{served_name}", served_model_name=served_name,
        is_generation=info.pooling is None or info.pooling.lm_head,  # (a sequence classifier generates nothing)
        supports_vision=False, max_context_length=info.max_seq_len, max_req_input_len=info.max_seq_len,
        vocab_size=info.vocab_size, architectures=[info.architecture] if info.architecture else [],
        eos_token_ids=list(info.eos_token_ids))


def server_info_to_pb(info: ExecutorInfo, executors: list[ExecutorStats], uptime_s: float,
                      last_receive: float) -> vpb.GetServerInfoResponse:
    return vpb.GetServerInfoResponse(
        active_requests=sum(v.running + v.waiting for v in executors), is_paused=False,
        last_receive_timestamp=last_receive, uptime_seconds=uptime_s, server_type=SERVER_TYPE,
        data_parallel_size=1, block_size=info.kv.block_size, model_dtype=info.dtype)


def loads_to_pb(executors: list[ExecutorStats], max_running: int, version: str) -> vpb.GetLoadsResponse:
    """The whole scheduler as one data-parallel rank: its executors' requests summed, and the KV usage of all
    of them together (the way scheduler/metrics.py reads the same stats)."""
    serving = [v for v in executors if v.state == "serving"]
    running = sum(v.running for v in serving)
    waiting = sum(v.waiting for v in executors)  # a request queued on a lost executor still waits here
    total = sum(v.kv_total_blocks for v in serving)
    used = sum(v.kv_total_blocks - v.kv_free_blocks for v in serving)
    load = vpb.SchedulerLoad(dp_rank=0, num_running_reqs=running, num_waiting_reqs=waiting,
                             num_total_reqs=running + waiting, token_usage=used / total if total else 0.0,
                             max_running_requests=max_running * max(len(serving), 1))
    return vpb.GetLoadsResponse(timestamp=datetime.now(timezone.utc).isoformat(), version=version, dp_rank_count=1,
                                loads=[load])
