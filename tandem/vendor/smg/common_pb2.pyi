from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Modality(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODALITY_UNSPECIFIED: _ClassVar[Modality]
    IMAGE: _ClassVar[Modality]
    AUDIO: _ClassVar[Modality]
    VIDEO: _ClassVar[Modality]
MODALITY_UNSPECIFIED: Modality
IMAGE: Modality
AUDIO: Modality
VIDEO: Modality

class GetTokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTokenizerChunk(_message.Message):
    __slots__ = ("data", "sha256")
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    sha256: str
    def __init__(self, data: _Optional[bytes] = ..., sha256: _Optional[str] = ...) -> None: ...

class SubscribeKvEventsRequest(_message.Message):
    __slots__ = ("start_sequence_number",)
    START_SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    start_sequence_number: int
    def __init__(self, start_sequence_number: _Optional[int] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("sequence_number", "timestamp", "events", "dp_rank", "group_events_enabled", "group_events")
    SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    GROUP_EVENTS_ENABLED_FIELD_NUMBER: _ClassVar[int]
    GROUP_EVENTS_FIELD_NUMBER: _ClassVar[int]
    sequence_number: int
    timestamp: float
    events: _containers.RepeatedCompositeFieldContainer[KvCacheEvent]
    dp_rank: int
    group_events_enabled: bool
    group_events: _containers.RepeatedCompositeFieldContainer[KvGroupEvent]
    def __init__(self, sequence_number: _Optional[int] = ..., timestamp: _Optional[float] = ..., events: _Optional[_Iterable[_Union[KvCacheEvent, _Mapping]]] = ..., dp_rank: _Optional[int] = ..., group_events_enabled: _Optional[bool] = ..., group_events: _Optional[_Iterable[_Union[KvGroupEvent, _Mapping]]] = ...) -> None: ...

class KvGroupEvent(_message.Message):
    __slots__ = ("operation", "group_id", "block_hashes", "parent_block_hash", "token_ids", "block_size", "kind", "sliding_window", "tokens_matchable")
    class Operation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        INVALID: _ClassVar[KvGroupEvent.Operation]
        STORE: _ClassVar[KvGroupEvent.Operation]
        REMOVE: _ClassVar[KvGroupEvent.Operation]
        CLEAR: _ClassVar[KvGroupEvent.Operation]
    INVALID: KvGroupEvent.Operation
    STORE: KvGroupEvent.Operation
    REMOVE: KvGroupEvent.Operation
    CLEAR: KvGroupEvent.Operation
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    TOKENS_MATCHABLE_FIELD_NUMBER: _ClassVar[int]
    operation: KvGroupEvent.Operation
    group_id: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_block_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    kind: str
    sliding_window: int
    tokens_matchable: bool
    def __init__(self, operation: _Optional[_Union[KvGroupEvent.Operation, str]] = ..., group_id: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., parent_block_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., kind: _Optional[str] = ..., sliding_window: _Optional[int] = ..., tokens_matchable: _Optional[bool] = ...) -> None: ...

class KvCacheEvent(_message.Message):
    __slots__ = ("event_id", "stored", "removed", "cleared")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    event_id: int
    stored: KvBlocksStored
    removed: KvBlocksRemoved
    cleared: KvCacheCleared
    def __init__(self, event_id: _Optional[int] = ..., stored: _Optional[_Union[KvBlocksStored, _Mapping]] = ..., removed: _Optional[_Union[KvBlocksRemoved, _Mapping]] = ..., cleared: _Optional[_Union[KvCacheCleared, _Mapping]] = ...) -> None: ...

class KvBlocksStored(_message.Message):
    __slots__ = ("blocks", "parent_block_hash")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[KvBlock]
    parent_block_hash: int
    def __init__(self, blocks: _Optional[_Iterable[_Union[KvBlock, _Mapping]]] = ..., parent_block_hash: _Optional[int] = ...) -> None: ...

class KvBlock(_message.Message):
    __slots__ = ("block_hash", "token_ids", "block_size", "lora_id", "cache_level")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEVEL_FIELD_NUMBER: _ClassVar[int]
    block_hash: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    lora_id: int
    cache_level: int
    def __init__(self, block_hash: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., lora_id: _Optional[int] = ..., cache_level: _Optional[int] = ...) -> None: ...

class KvBlocksRemoved(_message.Message):
    __slots__ = ("block_hashes", "cache_level")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEVEL_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    cache_level: int
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., cache_level: _Optional[int] = ...) -> None: ...

class KvCacheCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FlushCacheRequest(_message.Message):
    __slots__ = ("timeout_s",)
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    def __init__(self, timeout_s: _Optional[float] = ...) -> None: ...

class FlushCacheResponse(_message.Message):
    __slots__ = ("success", "message")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    success: bool
    message: str
    def __init__(self, success: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class StartProfileRequest(_message.Message):
    __slots__ = ("output_dir", "start_step", "num_steps", "activities", "with_stack", "record_shapes", "profile_by_stage")
    OUTPUT_DIR_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    ACTIVITIES_FIELD_NUMBER: _ClassVar[int]
    WITH_STACK_FIELD_NUMBER: _ClassVar[int]
    RECORD_SHAPES_FIELD_NUMBER: _ClassVar[int]
    PROFILE_BY_STAGE_FIELD_NUMBER: _ClassVar[int]
    output_dir: str
    start_step: int
    num_steps: int
    activities: _containers.RepeatedScalarFieldContainer[str]
    with_stack: bool
    record_shapes: bool
    profile_by_stage: bool
    def __init__(self, output_dir: _Optional[str] = ..., start_step: _Optional[int] = ..., num_steps: _Optional[int] = ..., activities: _Optional[_Iterable[str]] = ..., with_stack: _Optional[bool] = ..., record_shapes: _Optional[bool] = ..., profile_by_stage: _Optional[bool] = ...) -> None: ...

class StopProfileRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProfileResponse(_message.Message):
    __slots__ = ("success", "message")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    success: bool
    message: str
    def __init__(self, success: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class ShmHandle(_message.Message):
    __slots__ = ("name", "offset", "nbytes", "owner_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    nbytes: int
    owner_id: str
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., owner_id: _Optional[str] = ...) -> None: ...

class RemoteTensorHandle(_message.Message):
    __slots__ = ("transport", "descriptor", "nbytes")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    transport: str
    descriptor: bytes
    nbytes: int
    def __init__(self, transport: _Optional[str] = ..., descriptor: _Optional[bytes] = ..., nbytes: _Optional[int] = ...) -> None: ...
