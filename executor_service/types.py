"""Domain objects of the executor API (the in-process form of the tandem.executor.v1 messages)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterable, TypeVar

import torch

from executor_service.step.ngram_drafts import NgramDrafts
from tandem.errors import TandemError
from tandem.kv_usage import KvUsage
from tandem.sampling_params import SamplingParams

R = TypeVar("R")


class OutputMode(enum.Enum):
    TOKENS = "tokens"
    LOGITS = "logits"
    TOKENS_AND_LOGITS = "tokens_and_logits"


@dataclass(frozen=True)
class OutputOptions:
    """What a caller wants back for each sampled position. top_logprobs: alternatives per token (0 = none)."""

    mode: OutputMode = OutputMode.TOKENS
    top_logprobs: int = 0

    @property
    def wants_tokens(self) -> bool:
        return self.mode is not OutputMode.LOGITS

    @property
    def wants_logits(self) -> bool:
        return self.mode is not OutputMode.TOKENS


@dataclass(frozen=True)
class CacheRef:
    cache_id: str
    seq_len: int  # tokens the cache holds after the call


@dataclass
class TokenOutput:
    token_id: int
    logprob: float  # log-probability under the model's raw distribution
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first
    rank: int | None = None  # 1-based rank in the raw distribution: prompt logprobs only (None for sampled tokens)


@dataclass
class SequenceOutput:
    tokens: list[TokenOutput] = field(default_factory=list)
    logits: torch.Tensor | None = None  # [positions, vocab] float32 on CPU, when asked for


class PoolingTask(enum.Enum):
    EMBED = "embed"  # the pooled final hidden state
    CLASSIFY = "classify"  # the sequence-classification head at the last position
    TOKEN_LOGITS = "token_logits"  # chosen tokens' raw logits at the last position


class PoolingType(enum.Enum):
    LAST = "last"
    MEAN = "mean"


@dataclass(frozen=True)
class PoolingOptions:
    """What a pooled item returns instead of a sampled token (executor_service/step/pooling.py)."""

    task: PoolingTask = PoolingTask.EMBED
    type: PoolingType | None = None  # EMBED: None = the model's default (validation resolves it)
    normalize: bool = False  # EMBED: L2-normalised
    token_ids: tuple[int, ...] = ()  # TOKEN_LOGITS: whose logits, in this order


@dataclass(frozen=True)
class PoolingInfo:
    """What the model offers for pooling (GetInfo)."""

    default_type: PoolingType | None  # None: the checkpoint asks for a pooling not served (source says which)
    source: str
    num_labels: int = 0  # classification head outputs; 0 = none
    lm_head: bool = True
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()


@dataclass(frozen=True)
class VisionInfo:
    """GetInfo's vision facts (the contract's VisionInfo)."""

    family: str
    image_token_id: int
    tile_size: int
    tokens_per_tile: int
    max_tiles: int
    max_images_per_item: int
    max_pixel_bytes: int
    embedding_cache_images: int


@dataclass(frozen=True)
class ImageInput:
    """One image of a prompt (UnifiedItem.images): its pre-processed pixels and its placeholder span (the
    positions offset .. offset + length - 1; those whose token is the model's image token take its embedding
    rows in order). content_hash: tandem/image_hash.py's digest of dtype, shape and pixels (computed here when
    the pixels come; the only thing CreateCache reads beside the span)."""

    content_hash: str
    offset: int
    length: int
    dtype: str = "float32"
    shape: tuple[int, ...] = ()
    pixel_values: bytes = b""


@dataclass(frozen=True)
class UnifiedItem:
    """One item of a mixed batch: a prefill chunk (several tokens) or a decode (one token).

    cache_id None (or "") starts a new cache, at pos_offset 0. Output is produced only for final chunks.
    sampling None: the parameters registered with the cache (greedy for a new cache); set: they are used and,
    once the item succeeds, registered with the cache for later items that send none (so a large logit_bias
    travels and is validated once).
    """

    token_ids: tuple[int, ...]
    cache_id: str | None = None
    pos_offset: int = 0
    is_final_chunk: bool = True
    sampling: SamplingParams | None = None
    output: OutputOptions = OutputOptions()
    adapter: str = ""
    # How many of the cache's tokens are prompt (presence/frequency penalties count only the rest), fixed
    # at the first final chunk. None = every token up to that chunk. A scheduler recomputing a preempted
    # sequence passes its true prompt length so the earlier outputs still count as outputs.
    prompt_len: int | None = None
    # Speculative decoding (final chunks only): tokens guessed to follow token_ids, verified in the same
    # forward (executor_service/step/batch.py). The output then holds the accepted drafts and the token sampled after them; the
    # cache keeps only token_ids and the accepted drafts.
    draft_token_ids: tuple[int, ...] = ()
    # The packed mask of the tokens the token sampled after this item may be (tandem/token_mask.py's layout);
    # None = any. Applied before every other sampling step; logprobs stay raw. Final chunks only.
    allowed_tokens: bytes | None = None
    # Prompt logprobs: return each of this item's tokens' logprob (given the tokens before it) with this many
    # alternatives; None = not asked. The cache keeps the last position's hidden state for the next item
    # (executor_service/prompt_logprobs.py).
    prompt_logprobs: int | None = None
    # Pooling: the sequence is pooled, not sampled; its final chunk returns UnifiedResult.pooled and no token.
    pooling: PoolingOptions | None = None
    # Draft tokens the executor's draft model guesses for this item (--draft-model), verified as draft_token_ids
    # are (executor_service/step/model_drafts.py); 0 = none. Up to this many: fewer where they do not fit.
    model_draft_tokens: int = 0
    # Images whose placeholder span overlaps this item's tokens (executor_service/vision/): their embedding
    # rows replace the image token's embeddings at the span's image-token positions.
    images: tuple[ImageInput, ...] = ()


@dataclass
class UnifiedResult:
    cache: CacheRef  # a failed item: its cache as it was (id "" and length 0 for an unknown or new one)
    output: SequenceOutput | None  # None for non-final chunks and failed items
    # This item's own failure (the domain error it would raise alone); None = it ran. A failed item wrote
    # nothing; the other items of the call ran.
    error: TandemError | None = None
    # When the item asked: its tokens at positions max(pos_offset, 1) .. end - 1, each scored from the one before.
    prompt_logprobs: list[TokenOutput] = field(default_factory=list)
    pooled: torch.Tensor | None = None  # a pooled item's final chunk: float32 [dim] on the CPU
    model_draft_tokens: int = 0  # the draft model's guesses verified for this item (accepted: output tokens - 1)


@dataclass(frozen=True)
class DecodeItem:
    cache: CacheRef  # seq_len = the position token_id is written at (the cache's current length)
    token_id: int
    sampling: SamplingParams = SamplingParams()
    output: OutputOptions = OutputOptions()
    adapter: str = ""
    stop_token_ids: frozenset[int] = frozenset()
    draft_token_ids: tuple[int, ...] = ()  # as UnifiedItem's; only with num_steps <= 1
    ngram_drafts: NgramDrafts | None = None  # the executor drafts before each step (executor_service/step/ngram_drafts.py)
    max_tokens: int = 0  # most tokens returned in the call; 0 = num_steps


@dataclass
class DecodeResult:
    cache: CacheRef
    output: SequenceOutput  # one TokenOutput per step taken (with ngram_drafts: per token)
    error: TandemError | None = None  # as UnifiedResult.error: this item failed alone and wrote nothing
    draft_steps: int = 0  # with ngram_drafts: steps that carried drafts, draft tokens verified, accepted
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


class StepResults(list[R]):
    """What a step call (unified_decode, decode) returns: its results, one per item in order (a plain list to
    callers that want only those), and `released`: how many caches the call's release ids freed before its
    items ran (ids the session did not hold are not counted)."""

    def __init__(self, results: Iterable[R] = (), released: int = 0, draft_model_seconds: float = 0.0) -> None:
        super().__init__(results)
        self.released = released
        self.draft_model_seconds = draft_model_seconds  # time the call ran the draft model (model drafts)


@dataclass
class PrefillResult:
    cache: CacheRef
    output: SequenceOutput
    cached_tokens: int = 0  # tokens the cache reused from the prefix cache when CreateCache created it


@dataclass(frozen=True)
class CreateCacheItem:
    """A prompt to create a cache for, reusing its longest cached prefix (prefix caching)."""

    token_ids: tuple[int, ...]  # the whole prompt
    adapter: str = ""
    cache_salt: str = ""  # only blocks of caches with the same salt are reused
    # Reuse only blocks with prompt logprobs stored with this many alternatives, and return the reused prefix's
    # (None: any block, none returned).
    prompt_logprobs: int | None = None
    images: tuple[ImageInput, ...] = ()  # the prompt's images (hash and span: they key the blocks they overlap)


@dataclass
class CreateCacheResult:
    cache: CacheRef  # seq_len = cached_tokens; ("", 0) for a failed item
    cached_tokens: int = 0
    error: TandemError | None = None  # this item failed alone: no cache was created for it
    prompt_logprobs: list[TokenOutput] = field(default_factory=list)  # positions 1 .. cached_tokens - 1, when asked


@dataclass
class VerifyResult:
    cache: CacheRef
    positions: list[SequenceOutput]  # one per input token: the prediction for the next position


@dataclass(frozen=True)
class KvPoolSizing:
    """The KV pool's size and why (executor_service/kv/sizing.py decides it at start)."""

    blocks: int
    tokens: int  # blocks x block_size
    bytes: int  # K and V, every layer and block; on CPU committed only as blocks are first written
    reason: str  # the flag, or the default and the bound that applied; for people


@dataclass(frozen=True)
class DraftModelInfo:
    """The draft model (--draft-model) and its counters since start (executor_service/step/draft_model.py)."""

    model_id: str
    architecture: str
    num_layers: int
    hidden_size: int
    kv_pool: KvPoolSizing
    free_blocks: int
    live_caches: int
    caches_freed: int
    caches_evicted: int
    items_without_drafts: int
    draft_tokens: int
    accepted_draft_tokens: int
    catch_up_tokens: int
    draft_seconds: float


@dataclass(frozen=True)
class ExecutorInfo:
    model_id: str
    model_dir: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_seq_len: int
    dtype: str
    device: str
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    kv: KvUsage
    max_batch_tokens: int
    capabilities: tuple[str, ...]
    adapters: tuple[str, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_layers: tuple[int, ...] = ()
    instance_id: str = ""  # random per executor process: a change means a restart (every cache is gone)
    max_adapters_on_device: int = 0
    session_ttl_s: float = 0.0  # the lease of every session
    kv_pool: KvPoolSizing | None = None
    resident_memory_bytes: int = 0  # the process's RSS when the info was taken (0: not known)
    quantization: str = "none"  # --quantization: none | int8 | fp16 | int4, after the GGUF block formats kept if any
    deterministic: bool = False  # --deterministic (executor_service/step/deterministic.py)
    role: str = "both"  # --role: prefill | decode | both
    kv_fingerprint: str = ""  # executor_service/kv/fingerprint.py
    tensor_parallel_size: int = 1  # --tensor-parallel-size: ranks the model is split over (executor_service/tp/stack.py)
    kv_dtype: str = ""  # the KV pool's dtype, as --kv-dtype spells it (models/kv/dtype.py)
    attention_backend: str = ""  # the eager forward's paged attention (models/attention/backend.py)
    pooling: PoolingInfo | None = None  # None: pooled items are not served (executor_service/step/pooling.py)
    draft_model: DraftModelInfo | None = None  # None: no --draft-model
    vision: VisionInfo | None = None  # None: a text-only model (images are not served)


@dataclass(frozen=True)
class SessionLease:
    """A session just opened."""

    session_id: str
    ttl_s: float
    instance_id: str


@dataclass(frozen=True)
class CacheListing:
    cache_id: str
    seq_len: int
    adapter: str
    age_s: float  # since it was created
    blocks: int


@dataclass(frozen=True)
class SessionListing:
    session_id: str  # "" = the anonymous session
    client_name: str
    expires_in_s: float  # until its lease ends unless renewed (0: lapsed, about to be reaped)
    caches: list[CacheListing]  # oldest first


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: str
    rank: int
    target_modules: tuple[str, ...]
    on_device: bool
    active_caches: int
    requests: int
    loads: int
    evictions: int
    weights_digest: str = ""  # of its files: part of its caches' block hashes (executor_service/adapters.py)
