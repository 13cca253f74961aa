"""Conversions between tandem.executor.v1 messages and the executor's domain objects."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, Sequence, TypeVar

import numpy as np
import torch

from executor_service.kv.events.hub import BlocksStored, KvEvent
from executor_service.metrics.op_stats import LatencySummary, MetricsSnapshot
from executor_service.kv.prefix_cache import PrefixCacheStats
from executor_service.vision.embedding_cache import VisionStats
from executor_service.request_validation import check_release_with_step, name_item, renumber_item
from executor_service.step.ngram_drafts import NgramDrafts
from executor_service.rpc.pooling_codec import pooled_to_pb, pooling_from_pb, pooling_info_to_pb
from executor_service.rpc.vision_codec import images_from_pb, vision_info_to_pb, vision_stats_to_pb
from executor_service.types import (AdapterInfo, CacheRef, CreateCacheItem, CreateCacheResult, DecodeItem,
                                    DecodeResult, ExecutorInfo, KvPoolSizing, OutputMode, OutputOptions, SequenceOutput,
                                    SessionLease, SessionListing, StepResults, TokenOutput, UnifiedItem,
                                    UnifiedResult)
from tandem.codec import kv_usage_to_pb, sampling_from_pb, token_logprob_to_pb  # noqa: F401  (re-exported)
from tandem.errors import InvalidRequest, TandemError
from tandem.executor.v1 import executor_pb2 as pb
from tandem.kv_usage import KvUsage
from tandem.status_map import status_for

T = TypeVar("T")
R = TypeVar("R", UnifiedResult, DecodeResult)
M = TypeVar("M")

_MODES = {
    pb.OUTPUT_MODE_UNSPECIFIED: OutputMode.TOKENS,
    pb.OUTPUT_MODE_TOKENS: OutputMode.TOKENS,
    pb.OUTPUT_MODE_LOGITS: OutputMode.LOGITS,
    pb.OUTPUT_MODE_TOKENS_AND_LOGITS: OutputMode.TOKENS_AND_LOGITS,
}
_LOGITS_DTYPES = {pb.LOGITS_DTYPE_UNSPECIFIED, pb.LOGITS_DTYPE_FLOAT32, pb.LOGITS_DTYPE_BFLOAT16,
                  pb.LOGITS_DTYPE_FLOAT16}


def output_from_pb(m: pb.OutputOptions) -> tuple[OutputOptions, int]:
    """Returns the domain options and the wire dtype for logits."""
    if m.mode not in _MODES:
        raise InvalidRequest(f"{{field}} {m.mode} is not a known OutputMode", "output.mode")
    if m.logits_dtype not in _LOGITS_DTYPES:
        raise InvalidRequest(f"{{field}} {m.logits_dtype} is not a known LogitsDtype", "output.logits_dtype")
    return OutputOptions(_MODES[m.mode], m.top_logprobs), m.logits_dtype or pb.LOGITS_DTYPE_FLOAT32


def encode_logits(rows: torch.Tensor, dtype: int) -> pb.Logits:
    """rows: [n, vocab] float32 on CPU -> packed little-endian bytes (n rows concatenated)."""
    if dtype == pb.LOGITS_DTYPE_BFLOAT16:
        data = rows.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()
    elif dtype == pb.LOGITS_DTYPE_FLOAT16:
        data = rows.to(torch.float16).numpy().astype("<f2").tobytes()
    else:
        dtype = pb.LOGITS_DTYPE_FLOAT32
        data = rows.numpy().astype("<f4", copy=False).tobytes()
    return pb.Logits(data=data, dtype=dtype, vocab_size=rows.shape[-1])


def decode_logits(m: pb.Logits) -> np.ndarray:
    """The inverse of encode_logits, for clients and tests: [n, vocab] float32."""
    if m.dtype == pb.LOGITS_DTYPE_BFLOAT16:
        raw = np.frombuffer(m.data, dtype="<u2").astype(np.uint32) << 16
        values = raw.view(np.float32)
    elif m.dtype == pb.LOGITS_DTYPE_FLOAT16:
        values = np.frombuffer(m.data, dtype="<f2").astype(np.float32)
    else:
        values = np.frombuffer(m.data, dtype="<f4")
    return values.reshape(-1, m.vocab_size)


def sequence_output_to_pb(out: SequenceOutput, logits_dtype: int) -> pb.SequenceOutput:
    msg = pb.SequenceOutput(tokens=[token_logprob_to_pb(t.token_id, t.logprob, t.top_logprobs) for t in out.tokens])
    if out.logits is not None:
        msg.logits.CopyFrom(encode_logits(out.logits, logits_dtype))
    return msg


def prompt_logprobs_to_pb(tokens: list[TokenOutput]) -> list:
    return [token_logprob_to_pb(t.token_id, t.logprob, t.top_logprobs, t.rank) for t in tokens]


def cache_to_pb(c: CacheRef) -> pb.CacheRef:
    return pb.CacheRef(cache_id=c.cache_id, seq_len=c.seq_len)


def item_status_to_pb(error: TandemError | None) -> pb.ItemStatus:
    """OK (code 0) for None, else the code the call would have had for this error alone, and its message."""
    if error is None:
        return pb.ItemStatus()
    return pb.ItemStatus(code=status_for(error).value[0], message=str(error))


@dataclass
class ParsedItems(Generic[M, T]):
    """The items of a batch request: those that convert, and per request item its wire dtype for logits and
    the error it failed to convert with (a bad enum or sampling value is that item's own failure)."""

    messages: Sequence[M]
    items: list[T]
    dtypes: list[int]
    errors: list[TandemError | None]

    def run(self, call: Callable[[list[T]], StepResults[R]], failed: Callable[[M, TandemError], R],
            release_only: Callable[[], int]) -> StepResults[R]:
        """call(the converted items), then one result per request item in order: failed(message, error) for
        those that did not convert. When none converted, call is not made (unless the request had no items:
        the call's own error then): release_only() is, the step's release alone (it returns the count)."""
        if self.items or not self.messages:
            ran = call(self.items)
            released = ran.released
        else:
            ran, released = StepResults(), release_only()
        results = iter(ran)
        out: StepResults[R] = StepResults(released=released, draft_model_seconds=ran.draft_model_seconds)
        for n, (m, e) in enumerate(zip(self.messages, self.errors)):
            if e is not None:
                out.append(failed(m, e))
                continue
            r = next(results)
            if r.error is not None:  # the executor numbered the converted items only: name the request's
                renumber_item(r.error, n)
            out.append(r)
        return out


def items_from_pb(messages: Sequence[M], convert: Callable[[M], tuple[T, int]]) -> ParsedItems[M, T]:
    parsed: ParsedItems[M, T] = ParsedItems(messages, [], [], [])
    for n, m in enumerate(messages):
        try:
            item, dtype = convert(m)
        except TandemError as exc:
            name_item(exc, n)
            parsed.dtypes.append(pb.LOGITS_DTYPE_FLOAT32)
            parsed.errors.append(exc)
            continue
        parsed.items.append(item)
        parsed.dtypes.append(dtype)
        parsed.errors.append(None)
    return parsed


def release_ids_from_pb(ids: Sequence[str]) -> list[str]:
    """A step request's release_cache_ids (InvalidRequest over MAX_RELEASE_WITH_STEP, before any is released)."""
    check_release_with_step(ids)
    return list(ids)


def run_unified(messages: Sequence[pb.UnifiedItem],
                unified_decode: Callable[[list[UnifiedItem]], StepResults[UnifiedResult]],
                cache_ref: Callable[[str], CacheRef],
                release_only: Callable[[], int] = lambda: 0) -> tuple[StepResults[UnifiedResult], list[int]]:
    """A UnifiedDecode's items -> the executor call -> one result per item (those that did not convert carry
    their error and their cache as it is), with each item's logits dtype. release_only: frees the request's
    release ids when no item converted (the executor is then not called), returning how many."""
    parsed = items_from_pb(messages, unified_item_from_pb)
    return (parsed.run(unified_decode, lambda m, e: UnifiedResult(cache_ref(m.cache_id), None, e), release_only),
            parsed.dtypes)


def run_decode(messages: Sequence[pb.DecodeItem], decode: Callable[[list[DecodeItem]], StepResults[DecodeResult]],
               cache_ref: Callable[[str], CacheRef],
               release_only: Callable[[], int] = lambda: 0) -> tuple[StepResults[DecodeResult], list[int]]:
    """As run_unified, for a Decode's items."""
    def failed(m: pb.DecodeItem, error: TandemError) -> DecodeResult:
        return DecodeResult(cache_ref(m.cache.cache_id), SequenceOutput(), error)

    parsed = items_from_pb(messages, decode_item_from_pb)
    return parsed.run(decode, failed, release_only), parsed.dtypes


def unified_item_from_pb(m: pb.UnifiedItem) -> tuple[UnifiedItem, int]:
    """sampling unset -> None: the parameters registered with the cache (greedy for a new one)."""
    output, dtype = output_from_pb(m.output)
    return UnifiedItem(tuple(m.token_ids), m.cache_id or None, m.pos_offset, m.is_final_chunk,
                       sampling_from_pb(m.sampling) if m.HasField("sampling") else None, output, m.adapter,
                       m.prompt_len if m.HasField("prompt_len") else None, tuple(m.draft_token_ids),
                       allowed_tokens=m.allowed_tokens or None,
                       prompt_logprobs=m.prompt_logprobs if m.HasField("prompt_logprobs") else None,
                       pooling=pooling_from_pb(m), model_draft_tokens=m.model_draft_tokens,
                       images=images_from_pb(m.images)), dtype


def unified_response_to_pb(results: StepResults[UnifiedResult], logits_dtypes: list[int],
                           kv: KvUsage) -> pb.UnifiedDecodeResponse:
    out = pb.UnifiedDecodeResponse(kv=kv_usage_to_pb(kv), released=results.released,
                                   draft_model_ms=results.draft_model_seconds * 1e3)
    for r, dtype in zip(results, logits_dtypes):
        res = out.results.add(cache=cache_to_pb(r.cache), status=item_status_to_pb(r.error),
                              prompt_logprobs=prompt_logprobs_to_pb(r.prompt_logprobs),
                              model_draft_tokens=r.model_draft_tokens)
        if r.output is not None:
            res.output.CopyFrom(sequence_output_to_pb(r.output, dtype))
        if r.pooled is not None:
            res.pooled.CopyFrom(pooled_to_pb(r.pooled))
    return out


def decode_response_to_pb(results: StepResults[DecodeResult], logits_dtypes: list[int],
                          kv: KvUsage) -> pb.DecodeResponse:
    return pb.DecodeResponse(
        results=[pb.DecodeResult(cache=cache_to_pb(r.cache), output=sequence_output_to_pb(r.output, d),
                                 status=item_status_to_pb(r.error), draft_steps=r.draft_steps,
                                 draft_tokens=r.draft_tokens, accepted_draft_tokens=r.accepted_draft_tokens)
                 for r, d in zip(results, logits_dtypes)], kv=kv_usage_to_pb(kv), released=results.released)


def release_response_to_pb(released: int, unknown: list[str], kv: KvUsage) -> pb.ReleaseCacheResponse:
    return pb.ReleaseCacheResponse(released=released, unknown_cache_ids=unknown, kv=kv_usage_to_pb(kv))


def decode_item_from_pb(m: pb.DecodeItem) -> tuple[DecodeItem, int]:
    if not m.cache.cache_id:
        raise InvalidRequest("a decode item needs {field} (run Prefill first)", "cache.cache_id")
    output, dtype = output_from_pb(m.output)
    drafts = (NgramDrafts(m.ngram_drafts.max_draft_tokens, m.ngram_drafts.ngram_min, m.ngram_drafts.ngram_max)
              if m.HasField("ngram_drafts") else None)
    return DecodeItem(CacheRef(m.cache.cache_id, m.cache.seq_len), m.token_id, sampling_from_pb(m.sampling),
                      output, m.adapter, frozenset(m.stop_token_ids), tuple(m.draft_token_ids), drafts,
                      m.max_tokens), dtype


def info_to_pb(info: ExecutorInfo) -> pb.GetInfoResponse:
    msg = pb.GetInfoResponse(
        model_id=info.model_id, architecture=info.architecture, vocab_size=info.vocab_size,
        hidden_size=info.hidden_size, num_layers=info.num_layers, num_heads=info.num_heads,
        num_kv_heads=info.num_kv_heads, head_dim=info.head_dim, max_seq_len=info.max_seq_len, dtype=info.dtype,
        device=info.device, eos_token_ids=list(info.eos_token_ids), kv=kv_usage_to_pb(info.kv),
        capabilities=list(info.capabilities), adapters=list(info.adapters), model_dir=info.model_dir,
        max_batch_tokens=info.max_batch_tokens, num_experts=info.num_experts,
        num_experts_per_tok=info.num_experts_per_tok, moe_layers=list(info.moe_layers),
        instance_id=info.instance_id, max_adapters_on_device=info.max_adapters_on_device,
        session_ttl_ms=ms(info.session_ttl_s), resident_memory_bytes=info.resident_memory_bytes,
        quantization=info.quantization, role=info.role, kv_fingerprint=info.kv_fingerprint)
    msg.deterministic = info.deterministic
    msg.tensor_parallel_size = info.tensor_parallel_size
    msg.kv_dtype, msg.attention_backend = info.kv_dtype, info.attention_backend
    if info.bos_token_id is not None:
        msg.bos_token_id = info.bos_token_id
    if info.pooling is not None:
        msg.pooling.CopyFrom(pooling_info_to_pb(info.pooling))
    if info.vision is not None:
        msg.vision.CopyFrom(vision_info_to_pb(info.vision))
    if info.kv_pool is not None:
        msg.kv_pool.CopyFrom(_kv_pool_to_pb(info.kv_pool))
    if info.draft_model is not None:
        d = info.draft_model
        msg.draft_model.CopyFrom(pb.DraftModelInfo(
            model_id=d.model_id, architecture=d.architecture, num_layers=d.num_layers, hidden_size=d.hidden_size,
            kv_pool=_kv_pool_to_pb(d.kv_pool), free_blocks=d.free_blocks, live_caches=d.live_caches,
            caches_freed=d.caches_freed, caches_evicted=d.caches_evicted, items_without_drafts=d.items_without_drafts,
            draft_tokens=d.draft_tokens, accepted_draft_tokens=d.accepted_draft_tokens,
            catch_up_tokens=d.catch_up_tokens, draft_ms=d.draft_seconds * 1e3))
    return msg


def _kv_pool_to_pb(p: KvPoolSizing) -> pb.KvPoolSizing:
    return pb.KvPoolSizing(blocks=p.blocks, tokens=p.tokens, bytes=p.bytes, reason=p.reason)


def latency_to_pb(s: LatencySummary) -> pb.LatencySummary:
    return pb.LatencySummary(count=s.count, mean_ms=s.mean_ms, p95_ms=s.p95_ms, max_ms=s.max_ms)


def metrics_to_pb(m: MetricsSnapshot, kv: KvUsage, rpcs: dict[str, LatencySummary],
                  adapters: list[AdapterInfo], expert_load: dict[int, list[int]],
                  prefix: PrefixCacheStats, vision: VisionStats | None = None) -> pb.GetMetricsResponse:
    msg = pb.GetMetricsResponse(
        operations={k: latency_to_pb(v) for k, v in m.ops.items()}, lock_wait=latency_to_pb(m.lock_wait),
        kv=kv_usage_to_pb(kv), forward_passes=m.forward_passes, tokens_processed=m.tokens_processed,
        tokens_sampled=m.tokens_sampled, caches_created=m.caches_created, caches_released=m.caches_released,
        rpcs={k: latency_to_pb(v) for k, v in rpcs.items()}, adapters=[adapter_to_pb(a) for a in adapters],
        expert_load=[pb.ExpertLoad(layer=layer, tokens=t) for layer, t in sorted(expert_load.items())],
        prefix_cache=prefix_stats_to_pb(prefix), resident_memory_bytes=m.resident_memory_bytes)
    if vision is not None:
        msg.vision.CopyFrom(vision_stats_to_pb(vision))
    return msg


def prefix_stats_to_pb(p: PrefixCacheStats) -> pb.PrefixCacheStats:
    return pb.PrefixCacheStats(enabled=p.enabled, query_tokens=p.query_tokens, hit_tokens=p.hit_tokens,
                               stored_blocks=p.stored_blocks, evicted_blocks=p.evicted_blocks,
                               indexed_blocks=p.indexed_blocks, copied_blocks=p.copied_blocks)


def create_cache_items_from_pb(items) -> list[CreateCacheItem]:
    return [CreateCacheItem(tuple(it.token_ids), it.adapter, it.cache_salt,
                            it.prompt_logprobs if it.HasField("prompt_logprobs") else None,
                            images_from_pb(it.images)) for it in items]


def create_cache_response_to_pb(results: list[CreateCacheResult], kv: KvUsage) -> pb.CreateCacheResponse:
    return pb.CreateCacheResponse(
        results=[pb.CreateCacheResult(cache=cache_to_pb(r.cache), cached_tokens=r.cached_tokens,
                                      status=item_status_to_pb(r.error),
                                      prompt_logprobs=prompt_logprobs_to_pb(r.prompt_logprobs)) for r in results],
        kv=kv_usage_to_pb(kv))


def kv_event_to_pb(event: KvEvent) -> pb.KvEvent:
    if isinstance(event, BlocksStored):
        return pb.KvEvent(stored=pb.BlocksStored(block_hashes=list(event.hashes), parent_hash=event.parent,
                                                 adapter=event.adapter, token_count=event.token_count,
                                                 token_ids=event.token_ids, medium=event.medium))
    return pb.KvEvent(removed=pb.BlocksRemoved(block_hashes=list(event.hashes), medium=event.medium))


def adapter_to_pb(a: AdapterInfo) -> pb.AdapterInfo:
    return pb.AdapterInfo(name=a.name, path=a.path, rank=a.rank, target_modules=list(a.target_modules),
                          on_device=a.on_device, active_caches=a.active_caches, requests=a.requests, loads=a.loads,
                          evictions=a.evictions, weights_digest=a.weights_digest)


def ms(seconds: float) -> int:
    """Seconds -> whole milliseconds (leases are capped at a day, so they fit the uint32 fields)."""
    return max(0, round(seconds * 1000))


def session_lease_to_pb(lease: SessionLease) -> pb.OpenSessionResponse:
    return pb.OpenSessionResponse(session_id=lease.session_id, lease_ttl_ms=ms(lease.ttl_s),
                                  instance_id=lease.instance_id)


def keep_alive_to_pb(ttl_s: float, caches: int) -> pb.KeepAliveResponse:
    return pb.KeepAliveResponse(lease_ttl_ms=ms(ttl_s), caches=caches)


def close_session_to_pb(released: int, kv: KvUsage) -> pb.CloseSessionResponse:
    return pb.CloseSessionResponse(released=released, kv=kv_usage_to_pb(kv))


def list_caches_to_pb(sessions: list[SessionListing], kv: KvUsage) -> pb.ListCachesResponse:
    return pb.ListCachesResponse(kv=kv_usage_to_pb(kv), sessions=[
        pb.SessionInfo(session_id=s.session_id, client_name=s.client_name, expires_in_ms=ms(s.expires_in_s),
                       caches=[pb.CacheInfo(cache_id=c.cache_id, seq_len=c.seq_len, adapter=c.adapter,
                                            age_ms=ms(c.age_s), blocks=c.blocks) for c in s.caches])
        for s in sessions])
