"""KV block hashes (tandem/block_hash.py) are a contract: routers compute them from prompts to follow an
executor's KV events, so they must never change silently. Pinned digests below; a deliberate change of the
scheme must bump its version string (and these values) and tell router authors."""
from __future__ import annotations

import hashlib
import struct

import pytest

from tandem.block_hash import HASH_BYTES, block_hash, chain_hashes, root_hash

BS = 16

# Pinned: blake2b-128 of the version and the extra keys (root), of parent + little-endian uint32 ids (block).
ROOT = "73928efecdee7e8e75866a2b48276d28"  # root_hash()
ROOT_A_SALT = "10e5055efc97ccda295824ba411c37ef"  # root_hash("a", "0123456789abcdef", "t")
CHAIN_0_TO_39 = ["93aaf20823649ed1aaefc95388951e95", "f2232396a72aeece960ca03a4778290b"]
MAX_IDS = "ed5c88de45b11ca833cb8835aa9e4477"  # block_hash(root_hash(), [2**32 - 1] * 4)


def reference_root(*parts: str) -> bytes:
    """The scheme written out independently: length-prefixed (4 bytes, little-endian) parts."""
    data = b""
    for part in (b"tandem-kv-v1", *(p.encode() for p in parts)):
        data += struct.pack("<I", len(part)) + part
    return hashlib.blake2b(data, digest_size=16).digest()


def reference_block(parent: bytes, ids: list[int]) -> bytes:
    return hashlib.blake2b(parent + struct.pack(f"<{len(ids)}I", *ids), digest_size=16).digest()


def test_pinned_values():
    assert HASH_BYTES == 16
    assert root_hash().hex() == ROOT
    assert root_hash("a", "0123456789abcdef", "t").hex() == ROOT_A_SALT
    assert [h.hex() for h in chain_hashes(root_hash(), list(range(40)), BS)] == CHAIN_0_TO_39
    assert block_hash(root_hash(), [2**32 - 1] * 4).hex() == MAX_IDS


def test_matches_an_independent_implementation():
    """blake2b-128 over length-prefixed keys (root) and parent + ids as little-endian uint32 (block)."""
    assert root_hash() == reference_root("", "", "")
    assert root_hash("a", "0123456789abcdef", "t") == reference_root("a", "0123456789abcdef", "t")
    ids = [0, 1, 255, 256, 65535, 65536, 2**31, 2**32 - 1] * 2
    assert block_hash(root_hash(), ids) == reference_block(root_hash(), ids)
    # little-endian: 1 is 01 00 00 00, not 00 00 00 01
    assert block_hash(b"", [1]) == hashlib.blake2b(b"\x01\x00\x00\x00", digest_size=16).digest()


def test_extra_keys_change_the_root():
    roots = {root_hash(), root_hash("a"), root_hash("b"), root_hash("a", "d1"), root_hash("a", "d2"),
             root_hash("", "", "salt"), root_hash("a", "d1", "salt"), root_hash("", "", "salt2")}
    assert len(roots) == 8
    # length-prefixed: moving a character from one key to the next is another root
    assert root_hash("ab", "c") != root_hash("a", "bc")
    assert root_hash("a", "", "b") != root_hash("", "a", "b")
    ids = list(range(BS))
    assert block_hash(root_hash("a"), ids) != block_hash(root_hash("b"), ids)


def test_chain_property():
    root = root_hash()
    ids = list(range(100, 100 + 3 * BS + 5))  # 3 full blocks and a partial one (never hashed)
    chain = chain_hashes(root, ids, BS)
    assert len(chain) == 3 and all(len(h) == HASH_BYTES for h in chain)
    parent = root
    for i, h in enumerate(chain):
        assert h == block_hash(parent, ids[i * BS:(i + 1) * BS])
        parent = h
    assert chain_hashes(root, ids, BS, max_blocks=2) == chain[:2]
    assert chain_hashes(root, ids, BS, max_blocks=0) == []
    assert chain_hashes(root, ids[:BS - 1], BS) == []
    # A block's hash depends on every token before it: a change in block 1 changes blocks 1 and 2, not 0.
    changed = list(ids)
    changed[BS + 3] += 1
    other = chain_hashes(root, changed, BS)
    assert other[0] == chain[0] and other[1] != chain[1] and other[2] != chain[2]
    # The same block of tokens after another prefix is another block.
    assert block_hash(chain[0], ids[BS:2 * BS]) != block_hash(root, ids[BS:2 * BS])


def test_ids_must_fit_uint32():
    with pytest.raises(OverflowError):
        block_hash(root_hash(), [2**32])
