"""Content hashes of KV blocks, for prefix caching: the executor indexes full blocks by them, and a router
that follows an executor's KV events (SubscribeKvEvents) computes the same hashes from a prompt to find
where its prefix is cached. Torch-free, so the scheduler can import it.

A block's hash is chained from its parent's: two blocks match only when every token before them matches
too. The chain starts at a root that holds what else changes the KV: the adapter (name and weights
digest) and the request's cache salt. blake2b with 16-byte digests: collisions are out of reach in
practice (2^64 blocks for an even chance), and a collision would serve another prompt's KV, so no cheaper
non-cryptographic hash is used.
"""
from __future__ import annotations

import hashlib
import sys
from array import array
from typing import Sequence

HASH_BYTES = 16
_VERSION = b"tandem-kv-v1"


def root_hash(adapter: str = "", adapter_digest: str = "", cache_salt: str = "") -> bytes:
    """The parent of a sequence's first block: the extra keys every block of the sequence depends on."""
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    for part in (_VERSION, adapter.encode(), adapter_digest.encode(), cache_salt.encode()):
        h.update(len(part).to_bytes(4, "little"))  # length-prefixed: ("ab", "c") != ("a", "bc")
        h.update(part)
    return h.digest()


ImageSpan = tuple[int, int, str]  # (offset, length, content hash) of an image's placeholder span


def block_hash(parent: bytes, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """The hash of a full block of token ids whose predecessor has hash parent (root_hash() for the first).
    extra: what else the block's KV depends on (image_extra: the images its positions show), as vLLM's block
    extra keys hold an image's mm_hash; b"" leaves a text block's hash as it always was."""
    h = hashlib.blake2b(parent, digest_size=HASH_BYTES)
    ids = array("I", token_ids)  # uint32 ids, hashed little-endian on every host
    if sys.byteorder == "big":
        ids.byteswap()
    h.update(ids.tobytes())
    if extra:
        h.update(b"\x00images")
        h.update(extra)
    return h.digest()


def image_extra(images: Sequence[ImageSpan], start: int, end: int) -> bytes:
    """The extra key of the block of positions start .. end - 1: the hashes of the images whose span overlaps
    it, in span order (b"" when none does: a text block)."""
    return b"".join(f"{o}:{n}:{h};".encode() for o, n, h in sorted(images) if o < end and o + n > start)


def chain_hashes(root: bytes, token_ids: Sequence[int], block_size: int, max_blocks: int | None = None,
                 images: Sequence[ImageSpan] = ()) -> list[bytes]:
    """Hashes of the full blocks of token_ids (at most max_blocks of them), in order."""
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    out, parent = [], root
    for b in range(n):
        lo, hi = b * block_size, (b + 1) * block_size
        parent = block_hash(parent, token_ids[lo:hi], image_extra(images, lo, hi) if images else b"")
        out.append(parent)
    return out
