"""Which packed rows of a forward take image embedding rows, and which: an item's chunk covers positions
[pos, pos + n); the image token positions of each image's span inside it take the image's rows in order, the
k-th image token of the span (counting from the span's start, earlier chunks included) its row k. So a chunk
boundary inside an image's span changes nothing: each chunk slices the same rows by position."""
from __future__ import annotations

from typing import Sequence

import torch

from executor_service.types import ImageInput
from executor_service.vision.embedding_cache import ImageEmbeddings


def merge_rows(items: Sequence[tuple[int, Sequence[int], Sequence[int], Sequence[ImageInput]]],
               embeddings: ImageEmbeddings, image_token_id: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """items: per item in batch order (packed start row, cache tokens before the chunk, chunk token ids, its
    images). Returns (packed rows [M], embedding rows [M, hidden]) or None when no item has images."""
    packed: list[int] = []
    parts: list[torch.Tensor] = []
    for start_row, before, chunk, images in items:
        pos, n = len(before), len(chunk)
        for im in images:
            token_at = lambda p: before[p] if p < pos else chunk[p - pos]  # noqa: E731
            k = sum(1 for p in range(im.offset, max(im.offset, pos)) if token_at(p) == image_token_id)
            take: list[int] = []
            for p in range(max(im.offset, pos), min(im.offset + im.length, pos + n)):
                if chunk[p - pos] == image_token_id:
                    packed.append(start_row + p - pos)
                    take.append(k)
                    k += 1
            if take:
                rows = embeddings.rows(im)  # [tiles x tokens_per_tile, hidden]
                parts.append(rows[torch.tensor(take, dtype=torch.int64, device=rows.device)])
    if not packed:
        return None
    return torch.tensor(packed, dtype=torch.int64, device=device), torch.cat(parts)  # [M], [M, hidden]
