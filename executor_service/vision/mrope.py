"""M-RoPE positions (Qwen2.5-VL), computed by the executor for every token it runs, as transformers' get_rope_index
and its decode-time rope_deltas give them: a text token's three positions are equal; an image's tokens (the image
token ids of its span, one contiguous run) sit on its merged grid, starting at the position the run's first token
would have had as text: (start, start + row, start + column); after the run the text positions go on from
start + max(rows, columns), so every image shifts the text after it by max(rows, columns) - rows x columns (the
sequence's rope delta, which transformers adds to the cache length at every decode step).

Per cache the executor keeps each image's merged grid by span offset (CacheState.image_grids: from the pixel
shape, ImageInput.shape = [rows, columns, merge, merge, patch features], on the items and on CreateCache), so a
chunk, a decode step, a recompute or a prefix-cache hit after an image all know its shift, and a chunk boundary
inside an image's run changes nothing (each token's position depends only on the span and its index in it)."""
from __future__ import annotations

from typing import Sequence

import torch

from executor_service.kv.cache_table import CacheState
from executor_service.types import ImageInput


def grid_of(im: ImageInput) -> tuple[int, int]:
    """(rows, columns) of the image's merged grid: its embedding rows are rows x columns."""
    return int(im.shape[0]), int(im.shape[1])


def record_grids(state: CacheState, images: Sequence[ImageInput]) -> None:
    """Keeps the grids of the images that have one (qwen2_5_vl's 5-D shape; validated)."""
    for im in images:
        if len(im.shape) == 5:
            state.image_grids[im.offset] = grid_of(im)


def reuse_images(state: CacheState, images: Sequence[ImageInput]) -> None:
    """A cache CreateCache made from the prefix cache: the images its reused blocks show (spans from before
    state.cached_tokens), with their grids."""
    state.images = [(im.offset, im.length, im.content_hash) for im in images if im.offset < state.cached_tokens]
    record_grids(state, images)


def _shift(grid: tuple[int, int]) -> int:
    return max(grid) - grid[0] * grid[1]


def item_positions(state: CacheState, pos: int, n: int, chunk: Sequence[int], images: Sequence[ImageInput],
                   image_token_id: int) -> tuple[list[int], list[int], list[int]]:
    """The (temporal, height, width) positions of an item's n tokens at sequence positions [pos, pos + n): chunk,
    its token ids (drafts included); images: the item's (their spans overlap it); state: its cache (tokens before
    pos, earlier images' spans and grids)."""
    grids = dict(state.image_grids)
    grids.update((im.offset, grid_of(im)) for im in images)
    spans = {s[0]: s[1] for s in state.images}
    spans.update((im.offset, im.length) for im in images)
    shift = sum(_shift(grids[o]) for o, length in spans.items() if o + length <= pos and o in grids)
    t, h, w = [0] * n, [0] * n, [0] * n
    cuts = []  # (first index in the item after an image's run, the run's shift), ascending
    slots: dict[int, tuple[int, int, int]] = {}  # item index -> image token's (t, h, w) before the shift so far
    token_at = lambda p: state.tokens[p] if p < pos else chunk[p - pos]  # noqa: E731
    for o in sorted(o for o in spans if o + spans[o] > pos):
        rows_cols = grids.get(o)
        first = next((p for p in range(o, min(o + spans[o], pos + n)) if token_at(p) == image_token_id), None)
        if rows_cols is None or first is None:
            continue
        rows, cols = rows_cols
        end = first + rows * cols  # the run's end (validated: the run is contiguous and whole once written)
        for p in range(max(first, pos), min(end, pos + n)):
            k = p - first
            slots[p - pos] = (first, first + k // cols, first + k % cols)
        if end < pos + n:  # (a run that ended before the item: its shift from the item's first token)
            cuts.append((max(end - pos, 0), _shift(rows_cols)))
    if not slots and not cuts:  # (text only, as most items are: three equal positions)
        same = list(range(pos + shift, pos + shift + n))
        return same, same, same
    cuts.append((n, 0))
    start, extra = 0, shift
    for cut, more in cuts:
        for i in range(start, cut):
            if i in slots:
                a, b, c = slots[i]
                t[i], h[i], w[i] = a + extra, b + extra, c + extra
            else:
                t[i] = h[i] = w[i] = pos + i + extra
        start, extra = cut, extra + more
    return t, h, w


def batch_positions(parts: Sequence[tuple[list[int], list[int], list[int]]], device: torch.device) -> torch.Tensor:
    """The items' positions, packed in batch order: [3, T] int64."""
    rows = [[v for part in parts for v in part[axis]] for axis in range(3)]
    return torch.tensor(rows, dtype=torch.int64, device=device)
