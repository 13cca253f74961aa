"""The content hash of a pre-processed image (ImageInput.content_hash): what the executor's embedding cache and
its prefix cache key an image by. Torch-free: the scheduler computes the same hash for CreateCache lookups.

blake2b with a 16-byte digest over the dtype, the shape and the pixel bytes (length-prefixed, so no two
different (dtype, shape, bytes) triples hash alike by concatenation), as tandem/block_hash.py hashes blocks.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

_VERSION = b"tandem-image-v1"


def image_hash(dtype: str, shape: Sequence[int], pixel_values: bytes) -> str:
    """Lowercase hex digest (32 characters) of one image's pixels."""
    h = hashlib.blake2b(digest_size=16)
    for part in (_VERSION, dtype.encode(), ",".join(str(int(d)) for d in shape).encode(), pixel_values):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()
