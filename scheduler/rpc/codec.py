"""tandem.generate.v1 messages <-> the scheduler's domain objects, with every check a request can fail
before it is queued (each raises the domain error the status table maps to the most specific code)."""
from __future__ import annotations

import dataclasses
import uuid
from collections import OrderedDict
from typing import Mapping

import grpc

from tandem.codec import kv_usage_from_pb, sampling_from_pb, sampling_to_pb, token_logprob_to_pb
from tandem.errors import AdapterNotFound, InvalidRequest, RemoteError, SequenceTooLong, Unsupported
from tandem.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from tandem.common.v1 import common_pb2 as cpb
from tandem.executor.v1 import executor_pb2 as epb
from tandem.generate.v1 import generate_pb2 as pb
from scheduler.structured.grammar import CompiledConstraint, ConstraintKind, ConstraintSpec, GrammarCompiler
from scheduler.executor.info import ExecutorInfo, ExecutorStats
from scheduler.engine.planner import StepItem, StepPlan
from scheduler.engine.sequence import Sequence
from scheduler.engine.step_answer import ItemResult
from tandem.capabilities import PROMPT_LOGPROBS, TOKEN_MASKS
from tandem.kv_usage import KvUsage
from scheduler.request import Delta, FinishReason, GenerateRequest, StoppingCriteria, TokenLogprob
from scheduler.text.chat_input import chat_chars, messages_from_pb, tools_from_pb
from scheduler.text.tokenizer import ModelTokenizer

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_REQUEST_ID_CHARS = 256
MAX_CHAT_MESSAGES = 4096
_STATUS_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}  # ItemStatus.code -> "NOT_FOUND"


def capabilities_needed(request: GenerateRequest) -> frozenset[str]:
    """The GetInfo capabilities an executor must list to run this request right (an executor without
    token_masks would drop allowed_tokens as an unknown field and sample unconstrained)."""
    return frozenset(({TOKEN_MASKS} if request.constraint is not None else set())
                     | ({PROMPT_LOGPROBS} if request.prompt_logprobs is not None else set()))

_FINISH = {FinishReason.LENGTH: pb.FINISH_REASON_LENGTH, FinishReason.STOP: pb.FINISH_REASON_STOP,
           FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE, FinishReason.ABORTED: pb.FINISH_REASON_ABORTED}


def check_input_size(m: pb.GenerateRequest | pb.TokenizeRequest, max_chars: int) -> None:
    """The size limits of a text or chat input, checked before it is tokenized (cheap: lengths only)."""
    kind = m.WhichOneof("input")
    if kind == "text" and len(m.text) > max_chars:
        raise InvalidRequest(f"input text has {len(m.text)} characters; this scheduler takes at most {max_chars} "
                             "(--max-prompt-chars)")
    if kind == "messages":
        messages = m.messages.messages
        if len(messages) > MAX_CHAT_MESSAGES:
            raise InvalidRequest(f"input has {len(messages)} chat messages; at most {MAX_CHAT_MESSAGES}")
        chars = chat_chars(m.messages)
        if chars > max_chars:
            raise InvalidRequest(f"input messages have {chars} characters in all; this scheduler takes at most "
                                 f"{max_chars} (--max-prompt-chars)")


def prompt_ids_from_pb(m: pb.GenerateRequest | pb.TokenizeRequest, tok: ModelTokenizer, vocab_size: int) -> list[int]:
    kind = m.WhichOneof("input")
    if kind is None:
        raise InvalidRequest("the request has no input: set one of text, token_ids or messages")
    if kind == "text":
        if not m.text:
            raise InvalidRequest("input text is empty")
        ids = tok.encode(m.text)
    elif kind == "token_ids":
        ids = list(m.token_ids.ids)
        bad = next((i for i in ids if i >= vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is out of range: the vocabulary has {vocab_size} tokens")
    else:
        if not m.messages.messages:
            raise InvalidRequest("input messages is empty: give at least one {role, content}")
        ids = tok.encode_chat(messages_from_pb(m.messages.messages), tools_from_pb(m.messages.tools))
    if not ids:
        raise InvalidRequest(f"input {kind} is empty (it tokenizes to no tokens)")
    return ids


def sampling_params_from_pb(m: cpb.SamplingParams, vocab_size: int) -> SamplingParams:
    params = sampling_from_pb(m)  # the same tandem.common.v1 message and codec as the executor's
    params.validate(vocab_size)
    return params


def executor_sampling(request: GenerateRequest, eos_token_ids) -> tuple[SamplingParams, SamplingParams]:
    """The request's sampling for the executor, built once: (normal, before min_new_tokens)."""
    sampling = request.sampling
    stop = request.stopping
    if not stop.min_new_tokens:
        return sampling, sampling
    eos = () if stop.ignore_eos else eos_token_ids
    return sampling, with_banned_tokens(sampling, set(eos) | stop.stop_token_ids)


def with_banned_tokens(p: SamplingParams, token_ids) -> SamplingParams:
    """p, never sampling token_ids (the lowest bias the contract allows), for the steps before
    min_new_tokens — as transformers' MinNewTokensLengthLogitsProcessor masks EOS. Logprobs stay raw."""
    return dataclasses.replace(p, logit_bias={**p.logit_bias, **{t: -100.0 for t in token_ids}})


class _SamplingMessages:
    """The contract's message of each SamplingParams a step sends, built once per object (a large logit_bias
    is costly to copy into a message every step). Keyed by identity; each entry holds its object, so an id is
    never reused while its entry lives; the oldest entries go past `size`."""

    def __init__(self, size: int = 8192) -> None:
        self._size = size
        self._built: OrderedDict[int, tuple[SamplingParams, cpb.SamplingParams]] = OrderedDict()

    def __call__(self, p: SamplingParams) -> cpb.SamplingParams:
        entry = self._built.get(id(p))
        if entry is not None and entry[0] is p:
            self._built.move_to_end(id(p))
            return entry[1]
        m = sampling_to_pb(p)
        self._built[id(p)] = (p, m)
        if len(self._built) > self._size:
            self._built.popitem(last=False)
        return m


_sampling_pb = _SamplingMessages()


def step_to_pb(plan: StepPlan, registered_sampling: bool = False) -> list[epb.UnifiedItem]:
    """The UnifiedDecode items of a planned step. registered_sampling: the executor registers sampling with
    the cache (capability "registered_sampling"), so an item sends it only when the cache has none yet or it
    changes; otherwise every final item carries it. Prompt chunks that sample nothing never carry it."""
    return [_item_to_pb(item, registered_sampling) for item in plan.items]


def _item_to_pb(item: StepItem, registered_sampling: bool) -> epb.UnifiedItem:
    seq, req = item.seq, item.seq.request
    final = item.is_final
    return epb.UnifiedItem(cache_id=seq.cache_id, token_ids=seq.token_slice(item.start, item.start + item.count),
                           pos_offset=item.start, is_final_chunk=final,
                           sampling=_sampling_to_send(seq, registered_sampling) if final else None,
                           output=_output_options(req.top_logprobs), adapter=req.adapter,
                           # read by the executor at the first final chunk only
                           prompt_len=len(req.prompt_ids) if final else None, draft_token_ids=item.drafts,
                           prompt_logprobs=seq.prompt_logprobs_wanted)


def _sampling_to_send(seq, registered: bool) -> cpb.SamplingParams | None:
    p = seq.sampling_to_send(registered)
    return None if p is None else _sampling_pb(p)


def create_cache_items(seqs) -> list[epb.CreateCacheItem]:
    """CreateCache items looking up each sequence's tokens in the executor's prefix cache."""
    return [epb.CreateCacheItem(token_ids=s.token_slice(0, s.num_tokens), adapter=s.request.adapter,
                                prompt_logprobs=s.prompt_logprobs_wanted) for s in seqs]


def burst_to_pb(plan: StepPlan, drafting: Mapping[Sequence, tuple[int, int, int]] | None = None
                ) -> list[epb.DecodeItem]:
    """The Decode items of a multi-step burst (scheduler/engine/decode_bursts.py): each sequence's last token at its
    cache's length, its sampling (always sent: an unset DecodeItem.sampling means greedy, not the registered
    one), and the token ids that stop it on the executor. drafting: the sequences the executor drafts for
    within the burst, with (max draft tokens, n-gram min, n-gram max); they also get max_tokens (the tokens
    they have left), since a step may then return several."""
    items = []
    for item in plan.items:
        seq, req = item.seq, item.seq.request
        items.append(epb.DecodeItem(cache=epb.CacheRef(cache_id=seq.cache_id, seq_len=seq.num_cached),
                                    token_id=seq.output_ids[-1], sampling=_sampling_pb(seq.sampling_for_next_token()),
                                    output=_output_options(req.top_logprobs), adapter=req.adapter,
                                    stop_token_ids=sorted(seq.eos_token_ids | req.stopping.stop_token_ids)))
        settings = drafting.get(seq) if drafting else None
        if settings is not None:
            items[-1].ngram_drafts.CopyFrom(epb.NgramDrafts(max_draft_tokens=settings[0], ngram_min=settings[1],
                                                            ngram_max=settings[2]))
            items[-1].max_tokens = seq.tokens_left
    return items


_OUTPUT_OPTIONS: dict[int, epb.OutputOptions] = {}  # by top_logprobs: built once, never mutated


def _output_options(top_logprobs: int) -> epb.OutputOptions:
    opts = _OUTPUT_OPTIONS.get(top_logprobs)
    if opts is None:
        opts = _OUTPUT_OPTIONS[top_logprobs] = epb.OutputOptions(mode=epb.OUTPUT_MODE_TOKENS, top_logprobs=top_logprobs)
    return opts


def executor_info_from_pb(m: epb.GetInfoResponse) -> ExecutorInfo:
    return ExecutorInfo(model_id=m.model_id, architecture=m.architecture, vocab_size=m.vocab_size,
                        max_seq_len=m.max_seq_len, eos_token_ids=tuple(m.eos_token_ids), kv=kv_usage_from_pb(m.kv),
                        capabilities=frozenset(m.capabilities), adapters=tuple(sorted(m.adapters)),
                        model_dir=m.model_dir, dtype=m.dtype, device=m.device, instance_id=m.instance_id,
                        session_ttl_ms=m.session_ttl_ms, max_batch_tokens=m.max_batch_tokens,
                        max_adapters_on_device=m.max_adapters_on_device, role=m.role or "both")


def created_caches_from_pb(resp: epb.CreateCacheResponse
                           ) -> tuple[list[tuple[str, int, tuple[TokenLogprob, ...]] | None], KvUsage]:
    """Per CreateCache item: (cache id, tokens it holds, their prompt logprobs when asked), or None where the
    item failed; and the KV usage."""
    return ([None if r.status.code else (r.cache.cache_id, r.cache.seq_len, _token_logprobs(r.prompt_logprobs))
             for r in resp.results], kv_usage_from_pb(resp.kv))


def _token_logprobs(msgs) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(t.token_id, t.logprob, tuple((a.token_id, a.logprob) for a in t.top_logprobs),
                              t.rank if t.HasField("rank") else None) for t in msgs)


def item_results_from_pb(resp: epb.UnifiedDecodeResponse | epb.DecodeResponse) -> list[ItemResult]:
    """Per item: its cache and tokens (one; with drafts, the accepted ones first), or the error it failed with
    alone (an unset status is OK: an executor without per-item statuses fails the whole call instead)."""
    results = []
    for r in resp.results:
        if r.status.code:
            name = _STATUS_NAMES.get(r.status.code, "UNKNOWN")
            results.append(ItemResult(r.cache.cache_id, r.cache.seq_len, (),
                                      RemoteError(name, f"executor: {r.status.message or name}")))
            continue
        tokens = _token_logprobs(r.output.tokens) if r.HasField("output") else ()
        drafted = ((r.draft_steps, r.draft_tokens, r.accepted_draft_tokens) if isinstance(r, epb.DecodeResult)
                   else (0, 0, 0))
        results.append(ItemResult(r.cache.cache_id, r.cache.seq_len, tokens,
                                  # (a Decode burst's DecodeResult has none)
                                  prompt_logprobs=_token_logprobs(getattr(r, "prompt_logprobs", ())),
                                  burst_drafts=drafted))
    return results


def stopping_from_pb(m: pb.StoppingCriteria, prompt_len: int, max_seq_len: int, default_max_new: int,
                     vocab_size: int) -> StoppingCriteria:
    if prompt_len >= max_seq_len:
        raise SequenceTooLong(f"the prompt has {prompt_len} tokens; the model accepts at most {max_seq_len} in "
                              "all (prompt + output), so nothing can be generated")
    room = max_seq_len - prompt_len
    if m.max_new_tokens:
        if m.max_new_tokens > room:
            raise SequenceTooLong(f"prompt ({prompt_len} tokens) + max_new_tokens ({m.max_new_tokens}) exceeds the "
                                  f"model's maximum length {max_seq_len}; lower max_new_tokens to <= {room}")
        max_new = m.max_new_tokens
    else:
        max_new = min(default_max_new, room)
    if m.min_new_tokens > max_new:
        raise InvalidRequest(f"stopping.min_new_tokens ({m.min_new_tokens}) exceeds max_new_tokens ({max_new})")
    if len(m.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(m.stop)}")
    for s in m.stop:
        if not s or len(s) > MAX_STOP_CHARS:
            raise InvalidRequest(f"stop strings must have 1..{MAX_STOP_CHARS} characters, got {s!r:.80}")
    bad = next((t for t in m.stop_token_ids if t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"stop token id {bad} is out of range: the vocabulary has {vocab_size} tokens")
    return StoppingCriteria(max_new, m.min_new_tokens, tuple(m.stop), frozenset(m.stop_token_ids), m.ignore_eos,
                            m.include_stop_str_in_output)


def constraint_from_pb(m: pb.Constraint) -> ConstraintSpec:
    kind = m.WhichOneof("kind")
    if kind is None:
        raise InvalidRequest("constraint is set but empty: set one of json_schema, json_object, regex, choice or "
                             "grammar")
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
                    default_max_new: int, grammars: GrammarCompiler | None = None) -> GenerateRequest:
    """The validated, tokenized request (run off the event loop: tokenizing and compiling a constraint take
    time). grammars: the fleet's (None: a constraint is refused)."""
    if len(m.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id has {len(m.request_id)} characters; at most {MAX_REQUEST_ID_CHARS}")
    if m.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"top_logprobs must be 0..{MAX_TOP_LOGPROBS}, got {m.top_logprobs}")
    if m.HasField("prompt_logprobs") and m.prompt_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"prompt_logprobs must be 0..{MAX_TOP_LOGPROBS}, got {m.prompt_logprobs}")
    if m.adapter and m.adapter not in info.adapters:
        raise AdapterNotFound(f"unknown adapter {m.adapter!r}; loaded: {sorted(info.adapters) or 'none'}")
    sampling = sampling_params_from_pb(m.sampling, info.vocab_size)
    prompt = prompt_ids_from_pb(m, tok, info.vocab_size)
    stopping = stopping_from_pb(m.stopping, len(prompt), info.max_seq_len, default_max_new, info.vocab_size)
    return GenerateRequest(m.request_id or uuid.uuid4().hex, tuple(prompt), stopping, sampling, m.adapter,
                           m.top_logprobs, m.keep_special_tokens, compile_constraint(m, info, grammars),
                           m.prompt_logprobs if m.HasField("prompt_logprobs") else None)


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
