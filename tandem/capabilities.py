"""The names an executor lists in GetInfoResponse.capabilities, spelled once for both processes.

The executor advertises a name only when it does what the name promises; the scheduler checks for a name
before relying on the feature, since a fleet in the middle of an upgrade mixes executor versions
(docs/executor-contract.md#capabilities). A name one side spells differently from the other would read as
"not supported" without any error, so both import the names from here, and tests/contract/test_capabilities.py
checks that neither side uses a capability string that is not one of them.
"""
from __future__ import annotations

# Always listed by this build's executor (executor_service/executor.py).
PAGED_KV = "paged_kv"  # the paged KV cache; every reply carries KvUsage
UNIFIED_DECODE = "unified_decode"  # UnifiedDecode: prefill chunks and decode tokens in one packed forward
CHUNKED_PREFILL = "chunked_prefill"  # prompts in chunks (Prefill with cache_id, UnifiedItem.pos_offset)
MULTI_STEP_DECODE = "multi_step_decode"  # Decode with num_steps > 1 (the scheduler's decode bursts)
FORWARD_VERIFY = "forward_verify"  # ForwardVerify
TRUNCATE_CACHE = "truncate_cache"  # TruncateCache
LOGITS_OUTPUT = "logits_output"  # the logits output mode
TOP_LOGPROBS = "top_logprobs"  # top-N alternatives with each sampled token
SEEDED_SAMPLING = "seeded_sampling"  # per-request seeds make sampling reproducible
LORA = "lora"  # LoRA adapters, several in one batch
SESSIONS = "sessions"  # OpenSession / KeepAlive / CloseSession: caches owned by leased sessions
ITEM_STATUS = "item_status"  # one item's error is that item's status; the rest of the batch answers
REGISTERED_SAMPLING = "registered_sampling"  # sampling registered with the cache: an item may leave it unset
CREATE_CACHE = "create_cache"  # CreateCache
KV_EVENTS = "kv_events"  # SubscribeKvEvents (blocks stored and removed, for prefix-aware routing)
SPECULATIVE_DRAFTS = "speculative_drafts"  # UnifiedItem/DecodeItem.draft_token_ids verified in the batch
TOKEN_MASKS = "token_masks"  # UnifiedItem.allowed_tokens applied (an older executor would ignore it)
RELEASE_WITH_STEP = "release_with_step"  # release_cache_ids of UnifiedDecode and Decode freed before the items
PROMPT_LOGPROBS = "prompt_logprobs"  # UnifiedItem/CreateCacheItem.prompt_logprobs
MULTI_STEP_DRAFTS = "multi_step_drafts"  # DecodeItem.ngram_drafts: drafts proposed and verified within a burst
KV_TRANSFER = "kv_transfer"  # ExportKv / ImportKv of a cache between executors

# Listed depending on the executor's configuration.
PREFIX_CACHING = "prefix_caching"  # CreateCache reuses cached prompt prefixes (absent with --no-prefix-caching)
COMPILED_DECODE = "compiled_decode"  # decode calls run the torch.compile'd step
NATIVE_DECODE = "native_decode"  # decode calls run the native C++ step
DETERMINISTIC = "deterministic"  # --deterministic: an item's tokens do not depend on its batch or executor
CUDA_GRAPHS = "cuda_graphs"  # all-decode steps replay CUDA graphs captured at start
DRAFT_MODEL = "draft_model"  # --draft-model: UnifiedItem.model_draft_tokens drafted by the executor's draft model
POOLING = "pooling"  # UnifiedItem.pooling: embeddings, classification head outputs, token logits (not with
# --deterministic or tensor parallelism)
VISION = "vision"  # UnifiedItem.images / CreateCacheItem.images: images in, text out (GetInfoResponse.vision)

ALL: frozenset[str] = frozenset({
    PAGED_KV, UNIFIED_DECODE, CHUNKED_PREFILL, MULTI_STEP_DECODE, FORWARD_VERIFY, TRUNCATE_CACHE, LOGITS_OUTPUT,
    TOP_LOGPROBS, SEEDED_SAMPLING, LORA, SESSIONS, ITEM_STATUS, REGISTERED_SAMPLING, CREATE_CACHE, KV_EVENTS,
    SPECULATIVE_DRAFTS, TOKEN_MASKS, RELEASE_WITH_STEP, PROMPT_LOGPROBS, MULTI_STEP_DRAFTS, KV_TRANSFER,
    PREFIX_CACHING, COMPILED_DECODE, NATIVE_DECODE, DETERMINISTIC, CUDA_GRAPHS, POOLING, DRAFT_MODEL, VISION,
})

# What a scheduler relies on without checking: the first contract's features, listed by every executor since
# capabilities exist. Every other name is checked before the scheduler uses what it stands for, and without it
# the scheduler falls back (docs/executor-contract.md#versions): so an executor of an older release, which lacks
# newer names, serves a newer scheduler with the older behaviour, and tests/contract/test_mixed_versions.py
# checks that a scheduler shown only these names sends nothing that needs another.
BASELINE: frozenset[str] = frozenset({PAGED_KV, UNIFIED_DECODE, CHUNKED_PREFILL, ITEM_STATUS, TOP_LOGPROBS,
                                      SEEDED_SAMPLING, LORA, LOGITS_OUTPUT})
