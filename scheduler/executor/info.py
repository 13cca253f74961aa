"""What the scheduler knows of an executor (domain form of tandem.executor.v1.GetInfoResponse, converted by
scheduler/engine/executor_codec.py), and what it publishes about each one (ExecutorStats: GetModelInfo and the metrics read
these plain values; nothing outside an engine reads the engine itself)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol

from tandem.kv_usage import KvUsage


@dataclass(frozen=True)
class PoolingFacts:
    """What the executor's model offers for pooling (GetInfoResponse.pooling; scheduler/pooling/ reads it)."""

    default_type: str | None  # "last" | "mean"; None: the checkpoint names a pooling the executor does not serve
    source: str  # where the default comes from, for people
    num_labels: int = 0  # sequence-classification head outputs; 0 = none
    lm_head: bool = True
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()


@dataclass(frozen=True)
class ExecutorInfo:
    """An executor's model facts, limits and capabilities, as of its last GetInfo answer."""

    model_id: str = ""
    architecture: str = ""
    vocab_size: int = 0
    max_seq_len: int = 0
    eos_token_ids: tuple[int, ...] = ()
    kv: KvUsage = field(default_factory=lambda: KvUsage(16, 0, 0))
    capabilities: frozenset[str] = frozenset()
    adapters: tuple[str, ...] = ()  # sorted
    model_dir: str = ""  # on the executor's host (tokenizer files live there); never shown to clients
    dtype: str = ""
    device: str = ""
    instance_id: str = ""  # a restart shows as a new id ("" = the executor does not say)
    session_ttl_ms: int = 0
    max_batch_tokens: int = 0  # tokens one call may carry (0 = no limit given)
    max_adapters_on_device: int = 0  # distinct adapters per step (0 = no limit)
    role: str = "both"  # its part in disaggregated serving: "prefill", "decode" or "both" (--role)
    kv_fingerprint: str = ""  # its KV layout's identity: caches move only between equal ones ("" = not stated)
    hidden_size: int = 0  # the model's hidden state width (an embedding's length)
    pooling: PoolingFacts | None = None  # None: an executor that serves no pooled items (or an older one)


@dataclass(frozen=True)
class ExecutorStats:
    """One executor as its engine sees it now: its state, its load, and the counters the engine keeps."""

    address: str
    state: str  # "serving", "unreachable" or "refused"
    reason: str  # why it is not serving ("" while it is)
    running: int
    waiting: int
    kv_free_blocks: int
    kv_cached_blocks: int
    kv_total_blocks: int
    device: str
    instance_id: str
    preemptions: int = 0  # running requests preempted to free KV blocks
    step_calls: int = 0  # step calls (UnifiedDecode / Decode) that ran
    losses: int = 0  # times the executor was lost
    masks: int = 0  # token masks computed for constrained requests ...
    mask_compute_s: float = 0.0  # ... the mask thread's time for them ...
    mask_wait_s: float = 0.0  # ... and the loop's wait for them before a step call
    running_adapters: tuple[str, ...] = ()  # adapters of the running requests, sorted (llm-d's LoRA affinity)
    waiting_adapters: tuple[str, ...] = ()  # ... and of the queued ones
    max_adapters: int = 0  # distinct adapters one step may carry (the executor's --max-adapters-on-device)
    block_size: int = 0  # tokens per KV block


class _HasRequest(Protocol):
    @property
    def request(self) -> "_HasAdapter": ...


class _HasAdapter(Protocol):
    @property
    def adapter(self) -> str: ...


def adapters_of(sequences: Iterable[_HasRequest]) -> tuple[str, ...]:
    """The distinct adapters (not the base model) that these sequences' requests use, sorted."""
    return tuple(sorted({s.request.adapter for s in sequences if s.request.adapter}))
