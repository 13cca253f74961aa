"""tandem.generate.v1 messages <-> the scheduler's domain objects, with every check a request can fail
before it is queued (each raises the domain error the status table maps to the most specific code). The
executor-facing half (tandem.executor.v1) is scheduler/engine/executor_codec.py."""
from __future__ import annotations

import uuid
from typing import Any, Mapping

from scheduler.executor.info import ExecutorInfo, ExecutorStats
from scheduler.request import Delta, FinishReason, GenerateRequest, StoppingCriteria
from scheduler.structured.grammar import CompiledConstraint, ConstraintKind, ConstraintSpec, GrammarCompiler
from scheduler.text.chat_input import chat_chars, image_sources, messages_from_pb, tools_from_pb
from scheduler.vision.chat_images import ChatImages, PromptImage
from scheduler.text.tokenizer import ModelTokenizer
from tandem.capabilities import TOKEN_MASKS
from tandem.codec import sampling_from_pb, token_logprob_to_pb
from tandem.common.v1 import common_pb2 as cpb
from tandem.errors import AdapterNotFound, InvalidRequest, SequenceTooLong, Unsupported
from tandem.generate.v1 import generate_pb2 as pb
from tandem.sampling_params import MAX_TOP_LOGPROBS, SamplingParams

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_REQUEST_ID_CHARS = 256
MAX_CACHE_SALT_CHARS = 256  # (the executor's limit too: executor_service/request_validation.py)
MAX_CHAT_MESSAGES = 4096
_FINISH = {FinishReason.LENGTH: pb.FINISH_REASON_LENGTH, FinishReason.STOP: pb.FINISH_REASON_STOP,
           FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE, FinishReason.ABORTED: pb.FINISH_REASON_ABORTED}


def check_input_size(m: pb.GenerateRequest | pb.TokenizeRequest, max_chars: int) -> None:
    """The size limits of a text or chat input, checked before it is tokenized (cheap: lengths only)."""
    kind = m.WhichOneof("input")
    if kind == "text" and len(m.text) > max_chars:
        raise InvalidRequest(f"{{field}} has {len(m.text)} characters; this scheduler takes at most {max_chars} "
                             "(--max-prompt-chars)", "text")
    if kind == "messages":
        messages = m.messages.messages
        if len(messages) > MAX_CHAT_MESSAGES:
            raise InvalidRequest(f"{{field}} holds {len(messages)} chat messages; at most {MAX_CHAT_MESSAGES}",
                                 "messages.messages")
        chars = chat_chars(m.messages)
        if chars > max_chars:
            raise InvalidRequest(f"{{field}} have {chars} characters in all; this scheduler takes at most "
                                 f"{max_chars} (--max-prompt-chars)", "messages.messages")


def prompt_ids_from_pb(m: pb.GenerateRequest | pb.TokenizeRequest, tok: ModelTokenizer, vocab_size: int,
                       template_variables: Mapping[str, Any] | None = None) -> list[int]:
    """template_variables: more variables for the chat template (the HTTP front's chat_template_kwargs)."""
    kind = m.WhichOneof("input")
    if kind is None:
        raise InvalidRequest("the request has no input: set one of text, token_ids or messages", "input")
    if kind == "text":
        if not m.text:
            raise InvalidRequest("{field} is empty", "text")
        ids = tok.encode(m.text)
    elif kind == "token_ids":
        ids = list(m.token_ids.ids)
        bad = next((i for i in ids if i >= vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"{{field}} holds token id {bad}, out of range: the vocabulary has {vocab_size} "
                                 "tokens", "token_ids")
    else:
        if not m.messages.messages:
            raise InvalidRequest("{field} is empty: give at least one message with a role and content",
                                 "messages.messages")
        if image_sources(m.messages.messages):
            raise InvalidRequest("{field}: this call takes no images (only GenerateRequest's messages do)",
                                 "messages.messages")
        ids = tok.encode_chat(messages_from_pb(m.messages.messages), tools_from_pb(m.messages.tools),
                              template_variables)
    if not ids:
        raise InvalidRequest("{field} is empty (it tokenizes to no tokens)", "messages.messages" if kind == "messages"
                             else kind)
    return ids


def prompt_from_pb(m: pb.GenerateRequest, tok: ModelTokenizer, vocab_size: int,
                   template_variables: Mapping[str, Any] | None = None, images: ChatImages | None = None,
                   image_field: str = "parts[{j}].image") -> tuple[list[int], tuple[PromptImage, ...]]:
    """The prompt's ids and its images (chat messages with image parts: loaded, processed and placed here; run
    off the event loop). images: the model's image handling (None: a text-only model, images refused)."""
    sources = image_sources(m.messages.messages, image_field) if m.WhichOneof("input") == "messages" else []
    if not sources:
        return prompt_ids_from_pb(m, tok, vocab_size, template_variables), ()
    loaded = []
    for where, param, src in sources:
        try:
            if images is None:
                raise InvalidRequest(f"{where}: this model takes no images (it is not a vision-language model served "
                                     "here: docs/models.md)")
            if len(sources) > images.policy.max_images:
                raise InvalidRequest(f"{where}: {len(sources)} images in one request; at most "
                                     f"{images.policy.max_images} (--max-images-per-request)")
            kind = src.WhichOneof("source")
            if kind is None:
                raise InvalidRequest(f"{where}: set one of data, path or url")
            loaded.append(images.load_image(where, **{kind: getattr(src, kind)}))
        except InvalidRequest as exc:
            exc.param = param  # (the HTTP front's error body names it)
            raise
    ids, placed = images.encode_chat(tok, messages_from_pb(m.messages.messages), loaded,
                                     tools_from_pb(m.messages.tools), template_variables)
    return ids, placed




def sampling_params_from_pb(m: cpb.SamplingParams, vocab_size: int) -> SamplingParams:
    params = sampling_from_pb(m)  # the same tandem.common.v1 message and codec as the executor's
    params.validate(vocab_size)
    return params


def stopping_from_pb(m: pb.StoppingCriteria, prompt_len: int, max_seq_len: int, default_max_new: int,
                     vocab_size: int) -> StoppingCriteria:
    if prompt_len >= max_seq_len:
        raise SequenceTooLong(f"the prompt has {prompt_len} tokens; the model accepts at most {max_seq_len} in "
                              "all (prompt + output), so nothing can be generated: shorten {field}", "input")
    room = max_seq_len - prompt_len
    if m.max_new_tokens:
        if m.max_new_tokens > room:
            raise SequenceTooLong(f"prompt ({prompt_len} tokens) + {{field}} ({m.max_new_tokens}) exceeds the "
                                  f"model's maximum length {max_seq_len}; lower {{field}} to <= {room}",
                                  "stopping.max_new_tokens")
        max_new = m.max_new_tokens
    else:
        max_new = min(default_max_new, room)
    if m.min_new_tokens > max_new:
        raise InvalidRequest(f"{{field}} ({m.min_new_tokens}) exceeds the most tokens the request may generate "
                             f"({max_new})", "stopping.min_new_tokens")
    if len(m.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"{{field}} holds {len(m.stop)} strings; at most {MAX_STOP_STRINGS}", "stopping.stop")
    for i, s in enumerate(m.stop):
        if not s or len(s) > MAX_STOP_CHARS:
            raise InvalidRequest(f"{{field}} has {len(s)} characters; stop strings have 1..{MAX_STOP_CHARS}",
                                 f"stopping.stop[{i}]")
    bad = next((t for t in m.stop_token_ids if t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"{{field}} holds token id {bad}, out of range: the vocabulary has {vocab_size} "
                             "tokens", "stopping.stop_token_ids")
    return StoppingCriteria(max_new, m.min_new_tokens, tuple(m.stop), frozenset(m.stop_token_ids), m.ignore_eos,
                            m.include_stop_str_in_output)


def constraint_from_pb(m: pb.Constraint) -> ConstraintSpec:
    kind = m.WhichOneof("kind")
    if kind is None:
        raise InvalidRequest("{field} is set but empty: set one of json_schema, json_object, regex, choice or "
                             "grammar", "constraint")
    if kind == "choice":
        return ConstraintSpec(ConstraintKind.CHOICE, choices=tuple(m.choice.choices))
    if kind == "json_object":
        return ConstraintSpec(ConstraintKind.JSON_OBJECT)
    return ConstraintSpec(ConstraintKind(kind), getattr(m, kind))


def compile_constraint(m: pb.GenerateRequest, info: ExecutorInfo,
                       grammars: GrammarCompiler | None) -> CompiledConstraint | None:
    """The request's constraint compiled (None when it has none); last of the checks: it costs the most."""
    if not m.HasField("constraint"):
        return None
    spec = constraint_from_pb(m.constraint)
    if TOKEN_MASKS not in info.capabilities or grammars is None:
        raise Unsupported("constrained generation needs an executor that applies token masks (GetInfo capability "
                          f"{TOKEN_MASKS!r}); this one does not: upgrade it or send the request without a constraint")
    return grammars.compile(spec)


def request_from_pb(m: pb.GenerateRequest, tok: ModelTokenizer, info: ExecutorInfo,
                    default_max_new: int, grammars: GrammarCompiler | None = None,
                    template_variables: Mapping[str, Any] | None = None, images: ChatImages | None = None,
                    image_field: str = "parts[{j}].image") -> GenerateRequest:
    """The validated, tokenized request (run off the event loop: tokenizing and compiling a constraint take
    time). grammars: the fleet's (None: a constraint is refused). template_variables: see prompt_ids_from_pb."""
    if len(m.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequest(f"{{field}} has {len(m.cache_salt)} characters; at most {MAX_CACHE_SALT_CHARS}",
                             "cache_salt")
    if len(m.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"{{field}} has {len(m.request_id)} characters; at most {MAX_REQUEST_ID_CHARS}",
                             "request_id")
    if m.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"{{field}} must be 0..{MAX_TOP_LOGPROBS}, got {m.top_logprobs}", "top_logprobs")
    if m.HasField("prompt_logprobs") and m.prompt_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"{{field}} must be 0..{MAX_TOP_LOGPROBS}, got {m.prompt_logprobs}", "prompt_logprobs")
    if m.adapter and m.adapter not in info.adapters:
        raise AdapterNotFound(f"unknown adapter {m.adapter!r}; loaded: {sorted(info.adapters) or 'none'}")
    sampling = sampling_params_from_pb(m.sampling, info.vocab_size)
    prompt, prompt_images = prompt_from_pb(m, tok, info.vocab_size, template_variables, images, image_field)
    stopping = stopping_from_pb(m.stopping, len(prompt), info.max_seq_len, default_max_new, info.vocab_size)
    return GenerateRequest(m.request_id or uuid.uuid4().hex, tuple(prompt), stopping, sampling, m.adapter,
                           m.top_logprobs, m.keep_special_tokens, compile_constraint(m, info, grammars),
                           m.prompt_logprobs if m.HasField("prompt_logprobs") else None, cache_salt=m.cache_salt,
                           images=prompt_images)


def delta_to_pb(request_id: str, d: Delta) -> pb.GenerateResponse:
    out = pb.GenerateResponse(request_id=request_id, text=d.text, token_ids=[t.token_id for t in d.tokens],
                              stop_reason=d.stop_reason)
    for t in d.tokens:
        lp = out.logprobs.add(token_id=t.token_id, logprob=t.logprob)
        for tid, v in t.top:
            lp.top_logprobs.add(token_id=tid, logprob=v)
    for t in d.prompt_logprobs or ():
        out.prompt_logprobs.append(token_logprob_to_pb(t.token_id, t.logprob, t.top, t.rank))
    if d.finish_reason is not None:
        out.finish_reason = _FINISH[d.finish_reason]
    if d.usage is not None:
        out.usage.CopyFrom(pb.Usage(prompt_tokens=d.usage.prompt_tokens, completion_tokens=d.usage.completion_tokens,
                                    cached_tokens=d.usage.cached_tokens, preemptions=d.usage.preemptions,
                                    drafted_tokens=d.usage.drafted_tokens, accepted_tokens=d.usage.accepted_tokens))
    return out


_EXECUTOR_STATES = {"serving": pb.ExecutorStatus.STATE_SERVING, "unreachable": pb.ExecutorStatus.STATE_UNREACHABLE,
                    "refused": pb.ExecutorStatus.STATE_REFUSED}


def model_info_to_pb(info: ExecutorInfo, tok: ModelTokenizer, planner_budget: int, cfg,
                     executors: list[ExecutorStats]) -> pb.GetModelInfoResponse:
    return pb.GetModelInfoResponse(
        model_id=info.model_id, architecture=info.architecture, vocab_size=info.vocab_size,
        max_seq_len=info.max_seq_len, eos_token_ids=list(info.eos_token_ids), adapters=list(info.adapters),
        dtype=info.dtype, device=info.device, has_chat_template=tok.chat_template is not None,
        max_batch_tokens=planner_budget, max_running=cfg.max_running, prefill_chunk=cfg.prefill_chunk,
        default_max_new_tokens=cfg.default_max_new_tokens, kv_block_size=info.kv.block_size,
        kv_total_blocks=info.kv.total_blocks, executor=",".join(v.address for v in executors),
        executors=[pb.ExecutorStatus(
            address=v.address, state=_EXECUTOR_STATES[v.state], reason=v.reason, running=v.running,
            waiting=v.waiting, kv_free_blocks=v.kv_free_blocks, kv_cached_blocks=v.kv_cached_blocks,
            kv_total_blocks=v.kv_total_blocks, device=v.device, instance_id=v.instance_id) for v in executors])
