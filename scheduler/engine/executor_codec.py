"""tandem.executor.v1 messages <-> the scheduler's engine: the step plans it sends (UnifiedDecode items, decode
bursts, CreateCache items) and the answers it reads (item results, created caches, GetInfo), with the sampling each
request runs under on the executor. The client-facing half (tandem.generate.v1) is scheduler/rpc/codec.py."""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Mapping

import grpc
import numpy as np

from scheduler.engine.planner import StepItem, StepPlan
from scheduler.engine.step_answer import ItemResult
from scheduler.sequence import Sequence
from scheduler.executor.info import ExecutorInfo, PoolingFacts
from scheduler.request import GenerateRequest, PoolingSpec, TokenLogprob
from tandem.capabilities import POOLING, PROMPT_LOGPROBS, TOKEN_MASKS, VISION
from tandem.codec import kv_usage_from_pb, sampling_to_pb
from tandem.common.v1 import common_pb2 as cpb
from tandem.errors import RemoteError
from tandem.executor.v1 import executor_pb2 as epb
from tandem.kv_usage import KvUsage
from tandem.sampling_params import SamplingParams


_STATUS_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}  # ItemStatus.code -> "NOT_FOUND"


def capabilities_needed(request: GenerateRequest) -> frozenset[str]:
    """The GetInfo capabilities an executor must list to run this request right (an executor without
    token_masks would drop allowed_tokens as an unknown field and sample unconstrained)."""
    return frozenset(({TOKEN_MASKS} if request.constraint is not None else set())
                     | ({PROMPT_LOGPROBS} if request.prompt_logprobs is not None else set())
                     | ({POOLING} if request.pooling is not None else set())
                     | ({VISION} if request.images else set()))


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
                           model_draft_tokens=item.model_drafts,
                           prompt_logprobs=seq.prompt_logprobs_wanted,
                           # (every chunk: mean pooling sums each chunk's positions)
                           pooling=_pooling_pb(req.pooling) if req.pooling is not None else None,
                           # the images whose placeholder span this chunk covers (each chunk of a span)
                           images=_images_pb(req.images, item.start, item.start + item.count) if req.images else None)


def _images_pb(images, start: int, end: int, pixels: bool = True) -> list[epb.ImageInput]:
    """The images whose span overlaps positions [start, end), pixels and all (pixels: False for CreateCache,
    which reads the hash and span only)."""
    return [epb.ImageInput(content_hash=im.content_hash, dtype="float32", shape=im.shape,
                           pixel_values=im.pixels if pixels else b"", offset=im.offset, length=im.length)
            for im in images if im.offset < end and im.offset + im.length > start]


_POOLING_TASKS = {"embed": epb.POOLING_TASK_EMBED, "classify": epb.POOLING_TASK_CLASSIFY,
                  "token_logits": epb.POOLING_TASK_TOKEN_LOGITS}
_POOLING_TYPES = {"last": epb.POOLING_TYPE_LAST, "mean": epb.POOLING_TYPE_MEAN}
_POOLING_NAMES = {v: k for k, v in _POOLING_TYPES.items()}


def _pooling_pb(p: PoolingSpec) -> epb.PoolingOptions:
    return epb.PoolingOptions(task=_POOLING_TASKS[p.task], type=_POOLING_TYPES[p.type], normalize=p.normalize,
                              token_ids=p.token_ids)


def _sampling_to_send(seq, registered: bool) -> cpb.SamplingParams | None:
    p = seq.sampling_to_send(registered)
    return None if p is None else _sampling_pb(p)


def create_cache_items(seqs) -> list[epb.CreateCacheItem]:
    """CreateCache items looking up each sequence's tokens in the executor's prefix cache."""
    return [epb.CreateCacheItem(token_ids=s.token_slice(0, s.num_tokens), adapter=s.request.adapter,
                                cache_salt=s.request.cache_salt, prompt_logprobs=s.prompt_logprobs_wanted,
                                images=_images_pb(s.request.images, 0, s.num_tokens, pixels=False))
            for s in seqs]


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
                        max_adapters_on_device=m.max_adapters_on_device, role=m.role or "both",
                        kv_fingerprint=m.kv_fingerprint,
                        hidden_size=m.hidden_size, pooling=_pooling_facts(m) if POOLING in m.capabilities else None)


def _pooling_facts(m: epb.GetInfoResponse) -> PoolingFacts:
    p = m.pooling
    return PoolingFacts(_POOLING_NAMES.get(p.default_type), p.source, p.num_labels, p.lm_head, p.matryoshka,
                        tuple(p.matryoshka_dimensions))


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
        pooled = (tuple(np.frombuffer(r.pooled.data, dtype="<f4", count=r.pooled.dim).tolist())
                  if isinstance(r, epb.UnifiedResult) and r.HasField("pooled") else None)
        results.append(ItemResult(r.cache.cache_id, r.cache.seq_len, tokens,
                                  # (a Decode burst's DecodeResult has none)
                                  prompt_logprobs=_token_logprobs(getattr(r, "prompt_logprobs", ())),
                                  burst_drafts=drafted, pooled=pooled,
                                  model_drafted=getattr(r, "model_draft_tokens", 0)))
    return results
