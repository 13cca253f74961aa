"""Tandem's KV events in vLLM's wire layout: the msgpack payload of one ZMQ batch, as vLLM v0.28.0's
ZmqEventPublisher sends it (vllm/distributed/kv_events.py at tag v0.28.0), for routers that follow vLLM
engines' KV events (llm-d's precise-prefix scorer, vllm-router's kv_aware policy).

The layout of v0.28.0 (its msgspec Structs: EventBatch array_like; events tagged maps, tag field "type"):

    EventBatch  = [ts: float, events: [event, ...], data_parallel_rank: int]
    BlockStored = {"type": "BlockStored", "block_hashes": [int], "parent_block_hash": int | nil,
                   "token_ids": [int], "block_size": int, "lora_id": int | nil, "medium": str | nil,
                   "lora_name": str | nil, "group_idx": int, "kv_cache_spec_kind": str,
                   "kv_cache_spec_sliding_window": int (sliding windows only)}
    BlockRemoved = {"type": "BlockRemoved", "block_hashes": [int], "medium": str | nil, "group_idx": int}
    AllBlocksCleared = {"type": "AllBlocksCleared"}

`medium` is where the blocks are (executor_service/kv/events/hub.py: "GPU" for the KV pool whatever the device, as vLLM names its
own pool; "CPU" for the host-memory tier, as vLLM's offloading connector; "DISK" for the disk tier). Fields vLLM
leaves at their defaults are omitted (omit_defaults): extra_keys, locality (and the window of a
model without one). The cache spec kind is "full_attention", or "sliding_window" with its window when every
layer slides (Tandem then keeps only the window's blocks); vLLM v0.28.0 annotates every store with it, and
consumers that classify KV groups by it skip stores without it. Other releases (read from their wheels): up to v0.23 every event is a
positional array (["BlockStored", hashes, parent, token_ids, ...]) and the replay answer has no topic frame;
v0.24 and v0.25 encode events as these maps; v0.26 added `locality` and the topic frame in replay answers;
v0.11 has `medium` but no `lora_name`.

Block hashes: vLLM sends by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1) the low 64 bits of its digest as
an unsigned int; Tandem sends the low 64 bits of its 16-byte block hash (tandem/block_hash.py) the same way
(big-endian, as vLLM reads its digest). Ints are what every consumer decodes: vllm-router 0.1.17 takes ints
or bytes, llm-d's kv-cache indexer and vllm-router's older decoder take ints only. Consumers key the
blocks by these numbers and match prompts by the token ids, which they hash themselves.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import msgspec

from executor_service.kv.events.hub import BlocksRemoved, BlocksStored, KvEvent

VLLM_RELEASE = "v0.28.0"  # the release whose layout this module writes
GROUP = 0  # vLLM's KV cache group of a model with one kind of attention layer
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay answer's last frame pair: no more batches

_encoder = msgspec.msgpack.Encoder()


def hash_to_int(block_hash: bytes) -> int:
    """A Tandem block hash as the unsigned 64-bit int vLLM sends (its digest's last 8 bytes, big-endian)."""
    return int.from_bytes(block_hash[-8:], "big")


def stored(event: BlocksStored, sliding_window: int | None = None) -> dict[str, Any]:
    """sliding_window: the model's, when every layer slides (ModelConfig.kv_window)."""
    block_size = event.token_count // len(event.hashes)
    out = {"type": "BlockStored", "block_hashes": [hash_to_int(h) for h in event.hashes],
           "parent_block_hash": hash_to_int(event.parent) if event.parent else None,
           "token_ids": list(event.token_ids), "block_size": block_size,
           "lora_id": None,  # vLLM's deprecated adapter number: Tandem names adapters (lora_name)
           "medium": event.medium, "lora_name": event.adapter or None, "group_idx": GROUP,
           "kv_cache_spec_kind": "full_attention" if sliding_window is None else "sliding_window"}
    if sliding_window is not None:
        out["kv_cache_spec_sliding_window"] = sliding_window
    return out


def removed(event: BlocksRemoved) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": [hash_to_int(h) for h in event.hashes], "medium": event.medium,
            "group_idx": GROUP}


ALL_BLOCKS_CLEARED: dict[str, Any] = {"type": "AllBlocksCleared"}


def event_to_wire(event: KvEvent, sliding_window: int | None = None) -> dict[str, Any]:
    return stored(event, sliding_window) if isinstance(event, BlocksStored) else removed(event)


def encode_batch(events: Sequence[dict[str, Any]], ts: float | None = None, data_parallel_rank: int = 0) -> bytes:
    """One batch's payload (the third frame). vLLM's publisher stamps its data-parallel rank on every batch;
    an executor is one rank (0)."""
    return _encoder.encode([time.time() if ts is None else ts, list(events), data_parallel_rank])
