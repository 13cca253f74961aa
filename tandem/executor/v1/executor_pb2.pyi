from tandem.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OutputMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_MODE_UNSPECIFIED: _ClassVar[OutputMode]
    OUTPUT_MODE_TOKENS: _ClassVar[OutputMode]
    OUTPUT_MODE_LOGITS: _ClassVar[OutputMode]
    OUTPUT_MODE_TOKENS_AND_LOGITS: _ClassVar[OutputMode]

class LogitsDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOGITS_DTYPE_UNSPECIFIED: _ClassVar[LogitsDtype]
    LOGITS_DTYPE_FLOAT32: _ClassVar[LogitsDtype]
    LOGITS_DTYPE_BFLOAT16: _ClassVar[LogitsDtype]
    LOGITS_DTYPE_FLOAT16: _ClassVar[LogitsDtype]

class PoolingTask(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOLING_TASK_UNSPECIFIED: _ClassVar[PoolingTask]
    POOLING_TASK_EMBED: _ClassVar[PoolingTask]
    POOLING_TASK_CLASSIFY: _ClassVar[PoolingTask]
    POOLING_TASK_TOKEN_LOGITS: _ClassVar[PoolingTask]

class PoolingType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOLING_TYPE_UNSPECIFIED: _ClassVar[PoolingType]
    POOLING_TYPE_LAST: _ClassVar[PoolingType]
    POOLING_TYPE_MEAN: _ClassVar[PoolingType]
OUTPUT_MODE_UNSPECIFIED: OutputMode
OUTPUT_MODE_TOKENS: OutputMode
OUTPUT_MODE_LOGITS: OutputMode
OUTPUT_MODE_TOKENS_AND_LOGITS: OutputMode
LOGITS_DTYPE_UNSPECIFIED: LogitsDtype
LOGITS_DTYPE_FLOAT32: LogitsDtype
LOGITS_DTYPE_BFLOAT16: LogitsDtype
LOGITS_DTYPE_FLOAT16: LogitsDtype
POOLING_TASK_UNSPECIFIED: PoolingTask
POOLING_TASK_EMBED: PoolingTask
POOLING_TASK_CLASSIFY: PoolingTask
POOLING_TASK_TOKEN_LOGITS: PoolingTask
POOLING_TYPE_UNSPECIFIED: PoolingType
POOLING_TYPE_LAST: PoolingType
POOLING_TYPE_MEAN: PoolingType

class CacheRef(_message.Message):
    __slots__ = ("cache_id", "seq_len")
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    cache_id: str
    seq_len: int
    def __init__(self, cache_id: _Optional[str] = ..., seq_len: _Optional[int] = ...) -> None: ...

class KvUsage(_message.Message):
    __slots__ = ("block_size", "total_blocks", "free_blocks", "active_caches", "cached_blocks")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_CACHES_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    total_blocks: int
    free_blocks: int
    active_caches: int
    cached_blocks: int
    def __init__(self, block_size: _Optional[int] = ..., total_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., active_caches: _Optional[int] = ..., cached_blocks: _Optional[int] = ...) -> None: ...

class OutputOptions(_message.Message):
    __slots__ = ("mode", "top_logprobs", "logits_dtype")
    MODE_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGITS_DTYPE_FIELD_NUMBER: _ClassVar[int]
    mode: OutputMode
    top_logprobs: int
    logits_dtype: LogitsDtype
    def __init__(self, mode: _Optional[_Union[OutputMode, str]] = ..., top_logprobs: _Optional[int] = ..., logits_dtype: _Optional[_Union[LogitsDtype, str]] = ...) -> None: ...

class Logits(_message.Message):
    __slots__ = ("data", "dtype", "vocab_size")
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    dtype: LogitsDtype
    vocab_size: int
    def __init__(self, data: _Optional[bytes] = ..., dtype: _Optional[_Union[LogitsDtype, str]] = ..., vocab_size: _Optional[int] = ...) -> None: ...

class SequenceOutput(_message.Message):
    __slots__ = ("tokens", "logits")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    logits: Logits
    def __init__(self, tokens: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., logits: _Optional[_Union[Logits, _Mapping]] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("model_id", "architecture", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "max_seq_len", "dtype", "device", "eos_token_ids", "kv", "capabilities", "adapters", "model_dir", "max_batch_tokens", "bos_token_id", "num_experts", "num_experts_per_tok", "moe_layers", "instance_id", "max_adapters_on_device", "session_ttl_ms", "kv_pool", "resident_memory_bytes", "quantization", "role", "kv_fingerprint", "deterministic", "tensor_parallel_size", "kv_dtype", "attention_backend", "pooling", "draft_model", "vision")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIR_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_PER_TOK_FIELD_NUMBER: _ClassVar[int]
    MOE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_ADAPTERS_ON_DEVICE_FIELD_NUMBER: _ClassVar[int]
    SESSION_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    KV_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    VISION_FIELD_NUMBER: _ClassVar[int]
    model_id: str
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
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv: KvUsage
    capabilities: _containers.RepeatedScalarFieldContainer[str]
    adapters: _containers.RepeatedScalarFieldContainer[str]
    model_dir: str
    max_batch_tokens: int
    bos_token_id: int
    num_experts: int
    num_experts_per_tok: int
    moe_layers: _containers.RepeatedScalarFieldContainer[int]
    instance_id: str
    max_adapters_on_device: int
    session_ttl_ms: int
    kv_pool: KvPoolSizing
    resident_memory_bytes: int
    quantization: str
    role: str
    kv_fingerprint: str
    deterministic: bool
    tensor_parallel_size: int
    kv_dtype: str
    attention_backend: str
    pooling: PoolingInfo
    draft_model: DraftModelInfo
    vision: VisionInfo
    def __init__(self, model_id: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., max_seq_len: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., kv: _Optional[_Union[KvUsage, _Mapping]] = ..., capabilities: _Optional[_Iterable[str]] = ..., adapters: _Optional[_Iterable[str]] = ..., model_dir: _Optional[str] = ..., max_batch_tokens: _Optional[int] = ..., bos_token_id: _Optional[int] = ..., num_experts: _Optional[int] = ..., num_experts_per_tok: _Optional[int] = ..., moe_layers: _Optional[_Iterable[int]] = ..., instance_id: _Optional[str] = ..., max_adapters_on_device: _Optional[int] = ..., session_ttl_ms: _Optional[int] = ..., kv_pool: _Optional[_Union[KvPoolSizing, _Mapping]] = ..., resident_memory_bytes: _Optional[int] = ..., quantization: _Optional[str] = ..., role: _Optional[str] = ..., kv_fingerprint: _Optional[str] = ..., deterministic: _Optional[bool] = ..., tensor_parallel_size: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., attention_backend: _Optional[str] = ..., pooling: _Optional[_Union[PoolingInfo, _Mapping]] = ..., draft_model: _Optional[_Union[DraftModelInfo, _Mapping]] = ..., vision: _Optional[_Union[VisionInfo, _Mapping]] = ...) -> None: ...

class KvPoolSizing(_message.Message):
    __slots__ = ("blocks", "tokens", "bytes", "reason")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    tokens: int
    bytes: int
    reason: str
    def __init__(self, blocks: _Optional[int] = ..., tokens: _Optional[int] = ..., bytes: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class DraftModelInfo(_message.Message):
    __slots__ = ("model_id", "architecture", "num_layers", "hidden_size", "kv_pool", "free_blocks", "live_caches", "caches_freed", "caches_evicted", "items_without_drafts", "draft_tokens", "accepted_draft_tokens", "catch_up_tokens", "draft_ms")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LIVE_CACHES_FIELD_NUMBER: _ClassVar[int]
    CACHES_FREED_FIELD_NUMBER: _ClassVar[int]
    CACHES_EVICTED_FIELD_NUMBER: _ClassVar[int]
    ITEMS_WITHOUT_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CATCH_UP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
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
    draft_ms: float
    def __init__(self, model_id: _Optional[str] = ..., architecture: _Optional[str] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., kv_pool: _Optional[_Union[KvPoolSizing, _Mapping]] = ..., free_blocks: _Optional[int] = ..., live_caches: _Optional[int] = ..., caches_freed: _Optional[int] = ..., caches_evicted: _Optional[int] = ..., items_without_drafts: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., catch_up_tokens: _Optional[int] = ..., draft_ms: _Optional[float] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("token_ids", "cache_id", "sampling", "output", "adapter", "session_id")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_id: str
    sampling: _common_pb2.SamplingParams
    output: OutputOptions
    adapter: str
    session_id: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., cache_id: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., output: _Optional[_Union[OutputOptions, _Mapping]] = ..., adapter: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("cache", "output", "cached_tokens", "kv")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    cache: CacheRef
    output: SequenceOutput
    cached_tokens: int
    kv: KvUsage
    def __init__(self, cache: _Optional[_Union[CacheRef, _Mapping]] = ..., output: _Optional[_Union[SequenceOutput, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., kv: _Optional[_Union[KvUsage, _Mapping]] = ...) -> None: ...

class DecodeItem(_message.Message):
    __slots__ = ("cache", "token_id", "sampling", "output", "adapter", "stop_token_ids", "draft_token_ids", "ngram_drafts", "max_tokens")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NGRAM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cache: CacheRef
    token_id: int
    sampling: _common_pb2.SamplingParams
    output: OutputOptions
    adapter: str
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ngram_drafts: NgramDrafts
    max_tokens: int
    def __init__(self, cache: _Optional[_Union[CacheRef, _Mapping]] = ..., token_id: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., output: _Optional[_Union[OutputOptions, _Mapping]] = ..., adapter: _Optional[str] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., ngram_drafts: _Optional[_Union[NgramDrafts, _Mapping]] = ..., max_tokens: _Optional[int] = ...) -> None: ...

class NgramDrafts(_message.Message):
    __slots__ = ("max_draft_tokens", "ngram_min", "ngram_max")
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NGRAM_MIN_FIELD_NUMBER: _ClassVar[int]
    NGRAM_MAX_FIELD_NUMBER: _ClassVar[int]
    max_draft_tokens: int
    ngram_min: int
    ngram_max: int
    def __init__(self, max_draft_tokens: _Optional[int] = ..., ngram_min: _Optional[int] = ..., ngram_max: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("items", "num_steps", "session_id", "release_cache_ids")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RELEASE_CACHE_IDS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[DecodeItem]
    num_steps: int
    session_id: str
    release_cache_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, items: _Optional[_Iterable[_Union[DecodeItem, _Mapping]]] = ..., num_steps: _Optional[int] = ..., session_id: _Optional[str] = ..., release_cache_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DecodeResult(_message.Message):
    __slots__ = ("cache", "output", "status", "draft_steps", "draft_tokens", "accepted_draft_tokens")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cache: CacheRef
    output: SequenceOutput
    status: ItemStatus
    draft_steps: int
    draft_tokens: int
    accepted_draft_tokens: int
    def __init__(self, cache: _Optional[_Union[CacheRef, _Mapping]] = ..., output: _Optional[_Union[SequenceOutput, _Mapping]] = ..., status: _Optional[_Union[ItemStatus, _Mapping]] = ..., draft_steps: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("results", "kv", "released")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[DecodeResult]
    kv: KvUsage
    released: int
    def __init__(self, results: _Optional[_Iterable[_Union[DecodeResult, _Mapping]]] = ..., kv: _Optional[_Union[KvUsage, _Mapping]] = ..., released: _Optional[int] = ...) -> None: ...

class UnifiedItem(_message.Message):
    __slots__ = ("cache_id", "token_ids", "pos_offset", "is_final_chunk", "sampling", "output", "adapter", "prompt_len", "draft_token_ids", "allowed_tokens", "prompt_logprobs", "pooling", "model_draft_tokens", "images")
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    POS_OFFSET_FIELD_NUMBER: _ClassVar[int]
    IS_FINAL_CHUNK_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    MODEL_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    cache_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    pos_offset: int
    is_final_chunk: bool
    sampling: _common_pb2.SamplingParams
    output: OutputOptions
    adapter: str
    prompt_len: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    allowed_tokens: bytes
    prompt_logprobs: int
    pooling: PoolingOptions
    model_draft_tokens: int
    images: _containers.RepeatedCompositeFieldContainer[ImageInput]
    def __init__(self, cache_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., pos_offset: _Optional[int] = ..., is_final_chunk: _Optional[bool] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., output: _Optional[_Union[OutputOptions, _Mapping]] = ..., adapter: _Optional[str] = ..., prompt_len: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., allowed_tokens: _Optional[bytes] = ..., prompt_logprobs: _Optional[int] = ..., pooling: _Optional[_Union[PoolingOptions, _Mapping]] = ..., model_draft_tokens: _Optional[int] = ..., images: _Optional[_Iterable[_Union[ImageInput, _Mapping]]] = ...) -> None: ...

class ImageInput(_message.Message):
    __slots__ = ("content_hash", "dtype", "shape", "pixel_values", "offset", "length")
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PIXEL_VALUES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    content_hash: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    pixel_values: bytes
    offset: int
    length: int
    def __init__(self, content_hash: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., pixel_values: _Optional[bytes] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class VisionInfo(_message.Message):
    __slots__ = ("family", "image_token_id", "tile_size", "tokens_per_tile", "max_tiles", "max_images_per_item", "max_pixel_bytes", "embedding_cache_images")
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TILE_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_TILE_FIELD_NUMBER: _ClassVar[int]
    MAX_TILES_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGES_PER_ITEM_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXEL_BYTES_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_CACHE_IMAGES_FIELD_NUMBER: _ClassVar[int]
    family: str
    image_token_id: int
    tile_size: int
    tokens_per_tile: int
    max_tiles: int
    max_images_per_item: int
    max_pixel_bytes: int
    embedding_cache_images: int
    def __init__(self, family: _Optional[str] = ..., image_token_id: _Optional[int] = ..., tile_size: _Optional[int] = ..., tokens_per_tile: _Optional[int] = ..., max_tiles: _Optional[int] = ..., max_images_per_item: _Optional[int] = ..., max_pixel_bytes: _Optional[int] = ..., embedding_cache_images: _Optional[int] = ...) -> None: ...

class VisionStats(_message.Message):
    __slots__ = ("images_encoded", "embedding_cache_hits", "encode_seconds", "cached_images")
    IMAGES_ENCODED_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    ENCODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_IMAGES_FIELD_NUMBER: _ClassVar[int]
    images_encoded: int
    embedding_cache_hits: int
    encode_seconds: float
    cached_images: int
    def __init__(self, images_encoded: _Optional[int] = ..., embedding_cache_hits: _Optional[int] = ..., encode_seconds: _Optional[float] = ..., cached_images: _Optional[int] = ...) -> None: ...

class PoolingOptions(_message.Message):
    __slots__ = ("task", "type", "normalize", "token_ids")
    TASK_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    task: PoolingTask
    type: PoolingType
    normalize: bool
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, task: _Optional[_Union[PoolingTask, str]] = ..., type: _Optional[_Union[PoolingType, str]] = ..., normalize: _Optional[bool] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PooledOutput(_message.Message):
    __slots__ = ("data", "dim")
    DATA_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    dim: int
    def __init__(self, data: _Optional[bytes] = ..., dim: _Optional[int] = ...) -> None: ...

class PoolingInfo(_message.Message):
    __slots__ = ("default_type", "source", "num_labels", "lm_head", "matryoshka", "matryoshka_dimensions")
    DEFAULT_TYPE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    NUM_LABELS_FIELD_NUMBER: _ClassVar[int]
    LM_HEAD_FIELD_NUMBER: _ClassVar[int]
    MATRYOSHKA_FIELD_NUMBER: _ClassVar[int]
    MATRYOSHKA_DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    default_type: PoolingType
    source: str
    num_labels: int
    lm_head: bool
    matryoshka: bool
    matryoshka_dimensions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, default_type: _Optional[_Union[PoolingType, str]] = ..., source: _Optional[str] = ..., num_labels: _Optional[int] = ..., lm_head: _Optional[bool] = ..., matryoshka: _Optional[bool] = ..., matryoshka_dimensions: _Optional[_Iterable[int]] = ...) -> None: ...

class UnifiedDecodeRequest(_message.Message):
    __slots__ = ("items", "session_id", "release_cache_ids")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RELEASE_CACHE_IDS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[UnifiedItem]
    session_id: str
    release_cache_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, items: _Optional[_Iterable[_Union[UnifiedItem, _Mapping]]] = ..., session_id: _Optional[str] = ..., release_cache_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class UnifiedResult(_message.Message):
    __slots__ = ("cache", "output", "status", "prompt_logprobs", "pooled", "model_draft_tokens")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    MODEL_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cache: CacheRef
    output: SequenceOutput
    status: ItemStatus
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    pooled: PooledOutput
    model_draft_tokens: int
    def __init__(self, cache: _Optional[_Union[CacheRef, _Mapping]] = ..., output: _Optional[_Union[SequenceOutput, _Mapping]] = ..., status: _Optional[_Union[ItemStatus, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., pooled: _Optional[_Union[PooledOutput, _Mapping]] = ..., model_draft_tokens: _Optional[int] = ...) -> None: ...

class UnifiedDecodeResponse(_message.Message):
    __slots__ = ("results", "kv", "released", "draft_model_ms")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_MS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[UnifiedResult]
    kv: KvUsage
    released: int
    draft_model_ms: float
    def __init__(self, results: _Optional[_Iterable[_Union[UnifiedResult, _Mapping]]] = ..., kv: _Optional[_Union[KvUsage, _Mapping]] = ..., released: _Optional[int] = ..., draft_model_ms: _Optional[float] = ...) -> None: ...

class ForwardVerifyRequest(_message.Message):
    __slots__ = ("cache", "token_ids", "output", "adapter", "session_id")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    cache: CacheRef
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    output: OutputOptions
    adapter: str
    session_id: str
    def __init__(self, cache: _Optional[_Union[CacheRef, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., output: _Optional[_Union[OutputOptions, _Mapping]] = ..., adapter: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class ForwardVerifyResponse(_message.Message):
    __slots__ = ("cache", "positions", "kv")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    cache: CacheRef
    positions: _containers.RepeatedCompositeFieldContainer[SequenceOutput]
    kv: KvUsage
    def __init__(self, cache: _Optional[_Union[CacheRef, _Mapping]] = ..., positions: _Optional[_Iterable[_Union[SequenceOutput, _Mapping]]] = ..., kv: _Optional[_Union[KvUsage, _Mapping]] = ...) -> None: ...

class TruncateCacheRequest(_message.Message):
    __slots__ = ("cache_id", "new_len", "session_id")
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_LEN_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    cache_id: str
    new_len: int
    session_id: str
    def __init__(self, cache_id: _Optional[str] = ..., new_len: _Optional[int] = ..., session_id: _Optional[str] = ...) -> None: ...

class TruncateCacheResponse(_message.Message):
    __slots__ = ("cache", "kv")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    cache: CacheRef
    kv: KvUsage
    def __init__(self, cache: _Optional[_Union[CacheRef, _Mapping]] = ..., kv: _Optional[_Union[KvUsage, _Mapping]] = ...) -> None: ...

class ReleaseCacheRequest(_message.Message):
    __slots__ = ("cache_ids", "session_id")
    CACHE_IDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    cache_ids: _containers.RepeatedScalarFieldContainer[str]
    session_id: str
    def __init__(self, cache_ids: _Optional[_Iterable[str]] = ..., session_id: _Optional[str] = ...) -> None: ...

class ReleaseCacheResponse(_message.Message):
    __slots__ = ("released", "unknown_cache_ids", "kv")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_CACHE_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    released: int
    unknown_cache_ids: _containers.RepeatedScalarFieldContainer[str]
    kv: KvUsage
    def __init__(self, released: _Optional[int] = ..., unknown_cache_ids: _Optional[_Iterable[str]] = ..., kv: _Optional[_Union[KvUsage, _Mapping]] = ...) -> None: ...

class GetMetricsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LatencySummary(_message.Message):
    __slots__ = ("count", "mean_ms", "p95_ms", "max_ms")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MEAN_MS_FIELD_NUMBER: _ClassVar[int]
    P95_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_MS_FIELD_NUMBER: _ClassVar[int]
    count: int
    mean_ms: float
    p95_ms: float
    max_ms: float
    def __init__(self, count: _Optional[int] = ..., mean_ms: _Optional[float] = ..., p95_ms: _Optional[float] = ..., max_ms: _Optional[float] = ...) -> None: ...

class GetMetricsResponse(_message.Message):
    __slots__ = ("operations", "lock_wait", "kv", "forward_passes", "tokens_processed", "tokens_sampled", "caches_created", "caches_released", "rpcs", "adapters", "expert_load", "prefix_cache", "resident_memory_bytes", "vision")
    class OperationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: LatencySummary
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[LatencySummary, _Mapping]] = ...) -> None: ...
    class RpcsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: LatencySummary
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[LatencySummary, _Mapping]] = ...) -> None: ...
    OPERATIONS_FIELD_NUMBER: _ClassVar[int]
    LOCK_WAIT_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    FORWARD_PASSES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PROCESSED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    CACHES_CREATED_FIELD_NUMBER: _ClassVar[int]
    CACHES_RELEASED_FIELD_NUMBER: _ClassVar[int]
    RPCS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_LOAD_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    VISION_FIELD_NUMBER: _ClassVar[int]
    operations: _containers.MessageMap[str, LatencySummary]
    lock_wait: LatencySummary
    kv: KvUsage
    forward_passes: int
    tokens_processed: int
    tokens_sampled: int
    caches_created: int
    caches_released: int
    rpcs: _containers.MessageMap[str, LatencySummary]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    expert_load: _containers.RepeatedCompositeFieldContainer[ExpertLoad]
    prefix_cache: PrefixCacheStats
    resident_memory_bytes: int
    vision: VisionStats
    def __init__(self, operations: _Optional[_Mapping[str, LatencySummary]] = ..., lock_wait: _Optional[_Union[LatencySummary, _Mapping]] = ..., kv: _Optional[_Union[KvUsage, _Mapping]] = ..., forward_passes: _Optional[int] = ..., tokens_processed: _Optional[int] = ..., tokens_sampled: _Optional[int] = ..., caches_created: _Optional[int] = ..., caches_released: _Optional[int] = ..., rpcs: _Optional[_Mapping[str, LatencySummary]] = ..., adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ..., expert_load: _Optional[_Iterable[_Union[ExpertLoad, _Mapping]]] = ..., prefix_cache: _Optional[_Union[PrefixCacheStats, _Mapping]] = ..., resident_memory_bytes: _Optional[int] = ..., vision: _Optional[_Union[VisionStats, _Mapping]] = ...) -> None: ...

class PrefixCacheStats(_message.Message):
    __slots__ = ("enabled", "query_tokens", "hit_tokens", "stored_blocks", "evicted_blocks", "indexed_blocks", "copied_blocks")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COPIED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    query_tokens: int
    hit_tokens: int
    stored_blocks: int
    evicted_blocks: int
    indexed_blocks: int
    copied_blocks: int
    def __init__(self, enabled: _Optional[bool] = ..., query_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., stored_blocks: _Optional[int] = ..., evicted_blocks: _Optional[int] = ..., indexed_blocks: _Optional[int] = ..., copied_blocks: _Optional[int] = ...) -> None: ...

class ExpertLoad(_message.Message):
    __slots__ = ("layer", "tokens")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("name", "path", "rank", "target_modules", "on_device", "active_caches", "requests", "loads", "evictions", "weights_digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    ON_DEVICE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_CACHES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    on_device: bool
    active_caches: int
    requests: int
    loads: int
    evictions: int
    weights_digest: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ..., on_device: _Optional[bool] = ..., active_caches: _Optional[int] = ..., requests: _Optional[int] = ..., loads: _Optional[int] = ..., evictions: _Optional[int] = ..., weights_digest: _Optional[str] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: AdapterInfo
    def __init__(self, adapter: _Optional[_Union[AdapterInfo, _Mapping]] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    def __init__(self, adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ...) -> None: ...

class ItemStatus(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("client_name",)
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    def __init__(self, client_name: _Optional[str] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "lease_ttl_ms", "instance_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    lease_ttl_ms: int
    instance_id: str
    def __init__(self, session_id: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ..., instance_id: _Optional[str] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("lease_ttl_ms", "caches")
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    CACHES_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_ms: int
    caches: int
    def __init__(self, lease_ttl_ms: _Optional[int] = ..., caches: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("released", "kv")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    released: int
    kv: KvUsage
    def __init__(self, released: _Optional[int] = ..., kv: _Optional[_Union[KvUsage, _Mapping]] = ...) -> None: ...

class ListCachesRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ListCachesResponse(_message.Message):
    __slots__ = ("sessions", "kv")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    kv: KvUsage
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ..., kv: _Optional[_Union[KvUsage, _Mapping]] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "client_name", "expires_in_ms", "caches")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_MS_FIELD_NUMBER: _ClassVar[int]
    CACHES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    client_name: str
    expires_in_ms: int
    caches: _containers.RepeatedCompositeFieldContainer[CacheInfo]
    def __init__(self, session_id: _Optional[str] = ..., client_name: _Optional[str] = ..., expires_in_ms: _Optional[int] = ..., caches: _Optional[_Iterable[_Union[CacheInfo, _Mapping]]] = ...) -> None: ...

class CacheInfo(_message.Message):
    __slots__ = ("cache_id", "seq_len", "adapter", "age_ms", "blocks")
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    AGE_MS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    cache_id: str
    seq_len: int
    adapter: str
    age_ms: int
    blocks: int
    def __init__(self, cache_id: _Optional[str] = ..., seq_len: _Optional[int] = ..., adapter: _Optional[str] = ..., age_ms: _Optional[int] = ..., blocks: _Optional[int] = ...) -> None: ...

class CreateCacheItem(_message.Message):
    __slots__ = ("token_ids", "adapter", "cache_salt", "prompt_logprobs", "images")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    adapter: str
    cache_salt: str
    prompt_logprobs: int
    images: _containers.RepeatedCompositeFieldContainer[ImageInput]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., adapter: _Optional[str] = ..., cache_salt: _Optional[str] = ..., prompt_logprobs: _Optional[int] = ..., images: _Optional[_Iterable[_Union[ImageInput, _Mapping]]] = ...) -> None: ...

class CreateCacheRequest(_message.Message):
    __slots__ = ("items", "session_id")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[CreateCacheItem]
    session_id: str
    def __init__(self, items: _Optional[_Iterable[_Union[CreateCacheItem, _Mapping]]] = ..., session_id: _Optional[str] = ...) -> None: ...

class CreateCacheResult(_message.Message):
    __slots__ = ("cache", "cached_tokens", "status", "prompt_logprobs")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    cache: CacheRef
    cached_tokens: int
    status: ItemStatus
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, cache: _Optional[_Union[CacheRef, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., status: _Optional[_Union[ItemStatus, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class CreateCacheResponse(_message.Message):
    __slots__ = ("results", "kv")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[CreateCacheResult]
    kv: KvUsage
    def __init__(self, results: _Optional[_Iterable[_Union[CreateCacheResult, _Mapping]]] = ..., kv: _Optional[_Union[KvUsage, _Mapping]] = ...) -> None: ...

class SubscribeKvEventsRequest(_message.Message):
    __slots__ = ("summary_interval_ms",)
    SUMMARY_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    summary_interval_ms: int
    def __init__(self, summary_interval_ms: _Optional[int] = ...) -> None: ...

class SubscribeKvEventsResponse(_message.Message):
    __slots__ = ("seq", "events", "summary", "snapshot", "instance_id")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    seq: int
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    summary: KvSummary
    snapshot: bool
    instance_id: str
    def __init__(self, seq: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ..., summary: _Optional[_Union[KvSummary, _Mapping]] = ..., snapshot: _Optional[bool] = ..., instance_id: _Optional[str] = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("stored", "removed")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    stored: BlocksStored
    removed: BlocksRemoved
    def __init__(self, stored: _Optional[_Union[BlocksStored, _Mapping]] = ..., removed: _Optional[_Union[BlocksRemoved, _Mapping]] = ...) -> None: ...

class BlocksStored(_message.Message):
    __slots__ = ("block_hashes", "parent_hash", "adapter", "token_count", "token_ids", "medium")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_hash: bytes
    adapter: str
    token_count: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    medium: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_hash: _Optional[bytes] = ..., adapter: _Optional[str] = ..., token_count: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., medium: _Optional[str] = ...) -> None: ...

class BlocksRemoved(_message.Message):
    __slots__ = ("block_hashes", "medium")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    medium: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., medium: _Optional[str] = ...) -> None: ...

class KvSummary(_message.Message):
    __slots__ = ("kv", "prefix_cache")
    KV_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    kv: KvUsage
    prefix_cache: PrefixCacheStats
    def __init__(self, kv: _Optional[_Union[KvUsage, _Mapping]] = ..., prefix_cache: _Optional[_Union[PrefixCacheStats, _Mapping]] = ...) -> None: ...

class ExportKvRequest(_message.Message):
    __slots__ = ("cache_id", "block_hashes", "max_chunk_bytes", "session_id", "accept_images")
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_IMAGES_FIELD_NUMBER: _ClassVar[int]
    cache_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    max_chunk_bytes: int
    session_id: str
    accept_images: bool
    def __init__(self, cache_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., max_chunk_bytes: _Optional[int] = ..., session_id: _Optional[str] = ..., accept_images: _Optional[bool] = ...) -> None: ...

class KvTransferHeader(_message.Message):
    __slots__ = ("kv_fingerprint", "block_size", "num_tokens", "token_ids", "adapter", "num_blocks", "images", "images_listed")
    KV_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    IMAGES_LISTED_FIELD_NUMBER: _ClassVar[int]
    kv_fingerprint: str
    block_size: int
    num_tokens: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    adapter: str
    num_blocks: int
    images: _containers.RepeatedCompositeFieldContainer[KvImageSpan]
    images_listed: bool
    def __init__(self, kv_fingerprint: _Optional[str] = ..., block_size: _Optional[int] = ..., num_tokens: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., adapter: _Optional[str] = ..., num_blocks: _Optional[int] = ..., images: _Optional[_Iterable[_Union[KvImageSpan, _Mapping]]] = ..., images_listed: _Optional[bool] = ...) -> None: ...

class KvImageSpan(_message.Message):
    __slots__ = ("offset", "length", "content_hash", "grid_rows", "grid_columns")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    GRID_ROWS_FIELD_NUMBER: _ClassVar[int]
    GRID_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    content_hash: str
    grid_rows: int
    grid_columns: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ..., content_hash: _Optional[str] = ..., grid_rows: _Optional[int] = ..., grid_columns: _Optional[int] = ...) -> None: ...

class KvBlock(_message.Message):
    __slots__ = ("block_hash", "index", "num_tokens", "data", "crc32c")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    index: int
    num_tokens: int
    data: bytes
    crc32c: int
    def __init__(self, block_hash: _Optional[bytes] = ..., index: _Optional[int] = ..., num_tokens: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32c: _Optional[int] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("header", "blocks")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    header: KvTransferHeader
    blocks: _containers.RepeatedCompositeFieldContainer[KvBlock]
    def __init__(self, header: _Optional[_Union[KvTransferHeader, _Mapping]] = ..., blocks: _Optional[_Iterable[_Union[KvBlock, _Mapping]]] = ...) -> None: ...

class ImportKvRequest(_message.Message):
    __slots__ = ("source_address", "export", "create_cache", "session_id")
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EXPORT_FIELD_NUMBER: _ClassVar[int]
    CREATE_CACHE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    source_address: str
    export: ExportKvRequest
    create_cache: bool
    session_id: str
    def __init__(self, source_address: _Optional[str] = ..., export: _Optional[_Union[ExportKvRequest, _Mapping]] = ..., create_cache: _Optional[bool] = ..., session_id: _Optional[str] = ...) -> None: ...

class ImportKvResponse(_message.Message):
    __slots__ = ("cache_id", "num_tokens", "blocks_imported", "bytes")
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_IMPORTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    cache_id: str
    num_tokens: int
    blocks_imported: int
    bytes: int
    def __init__(self, cache_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., blocks_imported: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...
