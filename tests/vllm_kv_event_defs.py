"""vLLM's KV event layout as a consumer decodes it, for tests: a SUB subscriber and a replay client whose
decoder is built from vLLM v0.28.0's msgspec definitions (the field names, types, order and Struct options of
vllm/distributed/kv_events.py at tag v0.28.0, vLLM project, Apache-2.0; read from the release's wheel and
restated here without its docstrings and aggregator hooks). A payload that does not fit them fails to decode,
so these tests fail if Tandem's encoder drifts from the release.
"""
from __future__ import annotations

import time
from typing import Any

import msgspec
import zmq


# --- vllm/distributed/kv_events.py @ v0.28.0 (Struct options and fields as the release declares them) ------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]  # vLLM's ExternalBlockHash = bytes | int
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
# --- end of the release's definitions ------------------------------------------------------------------------


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
END_SEQ = -1


def decode(payload: bytes) -> KVEventBatch:
    return DECODER.decode(payload)


class Subscriber:
    """A ZMQ SUB socket on a topic; receive() gives (topic, seq, batch) with a deadline, never a sleep.
    rcvhwm: messages ZMQ holds for it (a stalled subscriber's tiny high-water mark)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, topic: str = "", rcvhwm: int = 1000) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        if rcvhwm < 10:  # a stalled reader: a small kernel buffer too, so that ZMQ's queue fills soon
            self.sock.setsockopt(zmq.RCVBUF, 4096)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)

    def receive(self, timeout_s: float = 10.0) -> tuple[str, int, KVEventBatch]:
        if not self.sock.poll(int(timeout_s * 1000)):
            raise AssertionError(f"no KV event batch within {timeout_s}s")
        topic, seq, payload = self.sock.recv_multipart()
        assert len(seq) == 8
        return topic.decode(), int.from_bytes(seq, "big"), decode(payload)

    def until(self, done, timeout_s: float = 20.0) -> list[tuple[str, int, KVEventBatch]]:
        """Batches up to and including the first for which done(batch) is true."""
        end = time.monotonic() + timeout_s
        out = []
        while True:
            out.append(self.receive(max(0.01, end - time.monotonic())))
            if done(out[-1][2]):
                return out

    def drain(self) -> list[tuple[str, int, KVEventBatch]]:
        """Whatever ZMQ holds for it now."""
        out = []
        while self.sock.poll(200):
            topic, seq, payload = self.sock.recv_multipart()
            out.append((topic.decode(), int.from_bytes(seq, "big"), decode(payload)))
        return out

    def close(self) -> None:
        self.sock.close(linger=0)


def replay(ctx: zmq.Context, endpoint: str, start_seq: int, timeout_s: float = 10.0
           ) -> list[tuple[str, int, KVEventBatch]]:
    """Asks a replay ROUTER for the batches from start_seq, as a vLLM consumer does (a DEALER sending an empty
    delimiter and the 8-byte start); v0.28.0 answers (topic, seq, payload) per batch, then ("", -1, "")."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart((b"", start_seq.to_bytes(8, "big")))
        out = []
        while True:
            if not sock.poll(int(timeout_s * 1000)):
                raise AssertionError(f"the replay socket sent no end marker within {timeout_s}s")
            frames = sock.recv_multipart()
            assert frames[0] == b"" and len(frames) == 4, frames
            _, topic, seq, payload = frames
            if int.from_bytes(seq, "big", signed=True) == END_SEQ:
                assert topic == b"" and payload == b""
                return out
            out.append((topic.decode(), int.from_bytes(seq, "big"), decode(payload)))
    finally:
        sock.close(linger=0)


def stored_events(batches) -> list[BlockStored]:
    return [e for _, _, b in batches for e in b.events if isinstance(e, BlockStored)]


def removed_hashes(batches) -> list[int]:
    return [h for _, _, b in batches for e in b.events if isinstance(e, BlockRemoved) for h in e.block_hashes]
