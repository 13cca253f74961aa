"""The checks of an item's images (UnifiedItem.images, CreateCacheItem.images) against the model's vision tower
and the item's tokens: shapes, sizes, hashes, spans. Raise InvalidRequest naming the image."""
from __future__ import annotations

import math
from typing import Sequence

from executor_service.types import ImageInput, VisionInfo
from models.vision.config import VisionConfig
from tandem.errors import CacheStateConflict, InvalidRequest
from tandem.image_hash import image_hash

MAX_TILES = 37  # 6 x 6 tiles + the global one: the most Idefics3's <row_i_col_j> tokens name
MAX_IMAGES_PER_ITEM = 8
MAX_PIXEL_BYTES = 64 * 1024 * 1024  # per item, all its images (a 37-tile image of 364 px tiles is ~59 MB); the
# gRPC message limit (--max-message-mb of both processes) bounds a call as well
DTYPES = {"float32": 4}


def check_images(images: Sequence[ImageInput], vision: VisionConfig | None, start: int, end: int,
                 tokens_before: Sequence[int], token_ids: Sequence[int], with_pixels: bool = True) -> None:
    """start, end: the item's positions [start, end); tokens_before: the cache's tokens (positions < start);
    token_ids: the item's. with_pixels: UnifiedItem (pixels required and hashed) or CreateCacheItem (spans)."""
    if not images:
        return
    if vision is None:
        raise CacheStateConflict("this model has no vision tower (capability \"vision\" is absent): send no images")
    if len(images) > MAX_IMAGES_PER_ITEM:
        raise InvalidRequest(f"{len(images)} images in one item; at most {MAX_IMAGES_PER_ITEM}")
    total = sum(len(im.pixel_values) for im in images)
    if total > MAX_PIXEL_BYTES:
        raise InvalidRequest(f"the item's images carry {total} bytes of pixels; at most {MAX_PIXEL_BYTES}")
    last_end = -1
    for k, im in enumerate(sorted(images, key=lambda i: i.offset)):
        name = f"image {k} (offset {im.offset})"
        if im.length < 1:
            raise InvalidRequest(f"{name}: length must be at least 1")
        if im.offset < last_end:
            raise InvalidRequest(f"{name}: its span overlaps the previous image's")
        last_end = im.offset + im.length
        if with_pixels:
            if not (im.offset < end and im.offset + im.length > start):
                raise InvalidRequest(f"{name}: its span [{im.offset}, {im.offset + im.length}) does not overlap the "
                                     f"item's positions [{start}, {end}): send an image only with the chunks it "
                                     "covers")
            _check_pixels(name, im, vision)
            _check_span_tokens(name, im, vision, start, end, tokens_before, token_ids)
        elif len(im.content_hash) != 32:
            raise InvalidRequest(f"{name}: content_hash must be 32 hex characters (tandem/image_hash.py)")
        elif vision.family == "qwen2_5_vl":  # (M-RoPE reads the image's grid from its shape: CreateCache too)
            _check_shape(name, im, vision)


def embedding_rows(im: ImageInput, v: VisionConfig) -> int:
    """The image's embedding rows: tiles x tokens_per_tile (idefics3), rows x columns of the merged grid
    (qwen2_5_vl)."""
    if v.family == "qwen2_5_vl":
        return im.shape[0] * im.shape[1]
    return im.shape[0] * v.tokens_per_tile


def _check_shape(name: str, im: ImageInput, v: VisionConfig) -> None:
    if v.family == "qwen2_5_vl":
        m, features = v.scale_factor, v.num_channels * v.temporal_patch_size * v.patch_size ** 2
        if len(im.shape) != 5 or tuple(im.shape[2:]) != (m, m, features) or min(im.shape[:2]) < 1:
            raise InvalidRequest(f"{name}: shape {list(im.shape)} is not [rows, columns, {m}, {m}, {features}] (the "
                                 "model's flattened patches, merge groups of merge x merge, on a rows x columns grid)")
        return
    want = (v.num_channels, v.image_size, v.image_size)
    if len(im.shape) != 4 or tuple(im.shape[1:]) != want or not 1 <= im.shape[0] <= MAX_TILES:
        raise InvalidRequest(f"{name}: shape {list(im.shape)} is not [tiles (1..{MAX_TILES}), {want[0]}, {want[1]}, "
                             f"{want[2]}] (the model's tiles)")


def _check_pixels(name: str, im: ImageInput, v: VisionConfig) -> None:
    if im.dtype not in DTYPES:
        raise InvalidRequest(f"{name}: dtype {im.dtype!r} is not served; send {', '.join(DTYPES)}")
    _check_shape(name, im, v)
    size = DTYPES[im.dtype] * math.prod(im.shape)
    if len(im.pixel_values) != size:
        raise InvalidRequest(f"{name}: pixel_values has {len(im.pixel_values)} bytes; shape {list(im.shape)} of "
                             f"{im.dtype} needs {size}")
    if im.content_hash and im.content_hash != image_hash(im.dtype, im.shape, im.pixel_values):
        raise InvalidRequest(f"{name}: content_hash is not the digest of its pixels (tandem/image_hash.py); "
                             "leave it empty to have it computed")


def _check_span_tokens(name: str, im: ImageInput, v: VisionConfig, start: int, end: int,
                       tokens_before: Sequence[int], token_ids: Sequence[int]) -> None:
    """The image tokens of the span written so far (through this item) are at most its rows, and exactly its
    rows once the span is whole; for M-RoPE (qwen2_5_vl) they are one run (the grid's positions follow it)."""
    rows = embedding_rows(im, v)
    if v.bidirectional_images:  # (Gemma 3) the span is one block of image tokens, written in one chunk
        if im.length != rows:
            raise InvalidRequest(f"{name}: its span is {im.length} tokens; this model's image tokens attend to each "
                                 f"other both ways, so the span must be exactly its {rows} image tokens")
        if im.offset < end < im.offset + im.length:
            raise InvalidRequest(f"{name}: the item ends at position {end}, inside its span [{im.offset}, "
                                 f"{im.offset + im.length}); this model's image tokens attend to each other both "
                                 "ways, so a chunk must end before the span or after it")
    hi = min(im.offset + im.length, end)
    marks = [p for p in range(im.offset, hi)
             if (tokens_before[p] if p < start else token_ids[p - start]) == v.image_token_id]
    seen = len(marks)
    whole = im.offset + im.length <= end
    if seen > rows or (whole and seen != rows):
        raise InvalidRequest(f"{name}: its span holds {seen} image tokens (id {v.image_token_id}) "
                             f"{'' if whole else 'so far '}but its pixels give {rows} embedding rows")
    if v.family == "qwen2_5_vl" and marks and marks[-1] - marks[0] + 1 != seen:
        raise InvalidRequest(f"{name}: its image tokens (id {v.image_token_id}) must be one unbroken run in its span")


def vision_info(v: VisionConfig, cache_images: int) -> VisionInfo:
    """GetInfo's vision facts (VisionInfo in the contract)."""
    tiled = v.family != "qwen2_5_vl"  # (Qwen2.5-VL: one grid of any size, bounded by MAX_PIXEL_BYTES)
    return VisionInfo(v.family, v.image_token_id, v.image_size, v.tokens_per_tile, MAX_TILES if tiled else 0,
                      MAX_IMAGES_PER_ITEM, MAX_PIXEL_BYTES, cache_images)
