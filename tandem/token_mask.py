"""The packed token mask of the executor contract (tandem.executor.v1 UnifiedItem.allowed_tokens): which
tokens the next sample may pick, one bit per vocabulary id.

Layout: ceil(vocab_size / 32) little-endian 32-bit words; token t is allowed iff bit (t % 32) of word t // 32
is set (bit 0 = the least significant). Bits past vocab_size in the last word are ignored. The scheduler
packs masks (llguidance writes exactly this layout), the executor checks and applies them.
"""
from __future__ import annotations

import numpy as np


def mask_words(vocab_size: int) -> int:
    """32-bit words of a mask over vocab_size tokens."""
    return (vocab_size + 31) // 32


def mask_bytes(vocab_size: int) -> int:
    """Bytes of a packed mask over vocab_size tokens."""
    return 4 * mask_words(vocab_size)


def allows_any(mask: bytes, vocab_size: int) -> bool:
    """Whether the mask (of mask_bytes(vocab_size) bytes) allows at least one token id < vocab_size."""
    words = np.frombuffer(mask, dtype="<u4")
    tail = vocab_size % 32
    if tail and words.size and words[-1] & ((1 << tail) - 1):
        return True
    full = words[:-1] if tail else words
    return bool(full.any())


def pack(allowed: "np.ndarray", vocab_size: int) -> bytes:
    """The mask allowing the token ids in `allowed` (for tests and tools)."""
    bits = np.zeros(mask_words(vocab_size) * 32, dtype=np.uint8)
    bits[np.asarray(allowed, dtype=np.int64)] = 1
    return np.packbits(bits, bitorder="little").tobytes()
