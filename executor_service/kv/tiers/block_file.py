"""The block file format the KV tiers keep blocks in (docs/kv-transfer.md, 'Tiers'): a block as a tier holds it
(TierBlock) and its bytes on disk. A file is: magic, CRC-32C of the rest, parent hash, adapter, token ids, the
block's bytes (executor_service/kv/block_bytes.py). Separate from the tiers because both the disk tier and the
shutdown flush read it, and the format is one decision (a change to it is a change to every file on disk).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from executor_service.kv.block_bytes import crc32c

MAGIC = b"TKVBLK1\n"
_HEAD = struct.Struct("<8sI")  # magic, CRC-32C of everything after it


@dataclass(frozen=True)
class TierBlock:
    """A block kept in a tier: its hash, what the prefix cache's index records of it, and its bytes."""

    hash: bytes
    parent: bytes  # b"" for a sequence's first block
    adapter: str
    token_ids: bytes  # uint32 little-endian
    data: bytes


def encode(b: TierBlock) -> bytes:
    ad = b.adapter.encode()
    body = struct.pack("<HHI", len(b.parent), len(ad), len(b.token_ids)) + b.parent + ad + b.token_ids + b.data
    return _HEAD.pack(MAGIC, crc32c(body)) + body


def decode(h: bytes, raw: bytes, data_bytes: int) -> TierBlock | None:
    """None when raw is not a whole, intact block file of this layout."""
    if len(raw) < _HEAD.size + 8:
        return None
    magic, crc = _HEAD.unpack_from(raw)
    body = raw[_HEAD.size:]
    if magic != MAGIC or crc32c(body) != crc:
        return None
    np_, na, nt = struct.unpack_from("<HHI", body)
    off = 8
    if len(body) != off + np_ + na + nt + data_bytes:
        return None
    parent = bytes(body[off:off + np_])
    adapter = bytes(body[off + np_:off + np_ + na]).decode(errors="replace")
    tokens = bytes(body[off + np_ + na:off + np_ + na + nt])
    return TierBlock(h, parent, adapter, tokens, bytes(body[off + np_ + na + nt:]))



def read_meta(p: Path, h: bytes, size: int, data_bytes: int) -> TierBlock | None:
    """A block file's parent, adapter and token ids (not its data), or None when its head is not ours or its size
    is not what its head says (truncated)."""
    if size < _HEAD.size + 8 + data_bytes:
        return None
    try:
        with p.open("rb") as f:
            head = f.read(_HEAD.size + 8)
            if len(head) < _HEAD.size + 8 or head[:len(MAGIC)] != MAGIC:
                return None
            np_, na, nt = struct.unpack_from("<HHI", head, _HEAD.size)
            rest = f.read(np_ + na + nt)
    except OSError:
        return None
    if len(rest) != np_ + na + nt or np_ not in (0, 16) or nt % 4 or size != _HEAD.size + 8 + np_ + na + nt + data_bytes:
        return None
    return TierBlock(h, rest[:np_], rest[np_:np_ + na].decode(errors="replace"), rest[np_ + na:], b"")

