"""The images a KV transfer carries (KvTransferHeader.images, docs/kv-transfer.md): a cache's image spans (offset,
length, content hash) and, for M-RoPE models, each image's merged grid — what the importer's cache needs to go on
exactly as the source's: the positions after an image (executor_service/vision/mrope.py), the image hash in the
prefix-cache keys of the blocks a span overlaps (tandem/block_hash.py), a later chunk that finishes an image's span
(executor_service/vision/image_checks.py reads the cache's tokens before it).

The exporter sends a cache that shows images only to an importer that says it builds them (ExportKvRequest.
accept_images); the importer refuses a header whose spans it cannot honour, and a header from an older exporter
(no images_listed) whose tokens hold the model's image token, since such an exporter dropped the spans."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from executor_service.kv.cache_table import CacheState
from models.config import ModelConfig
from tandem.errors import CacheStateConflict, Unsupported

MAX_TRANSFER_IMAGES = 256  # spans one header may carry: a long conversation's images, a bounded header (~15 KB)
_HASH_CHARS = 32  # tandem/image_hash.py: blake2b-128, hex


@dataclass(frozen=True)
class TransferImage:
    offset: int  # the span's first position
    length: int  # tokens in the span (it may run past the cache's length)
    content_hash: str
    grid: tuple[int, int] | None  # M-RoPE: the merged grid (rows, columns); None for other families


def images_of(cache_id: str, state: CacheState, accept_images: bool) -> tuple[TransferImage, ...]:
    """The spans of a cache being exported, in offset order. Unsupported (FAILED_PRECONDITION) when it shows
    images and the importer did not say it builds them, or shows more than a header carries."""
    if not state.images:
        return ()
    if not accept_images:
        raise Unsupported(f"cache {cache_id!r} shows images and the importer did not set "
                          "ExportKvRequest.accept_images (an older executor, which would drop its image spans): "
                          "recompute it there")
    if len(state.images) > MAX_TRANSFER_IMAGES:
        raise Unsupported(f"cache {cache_id!r} shows {len(state.images)} images; a transfer carries at most "
                          f"{MAX_TRANSFER_IMAGES} (KvTransferHeader.images): recompute it there")
    return tuple(TransferImage(o, n, h, state.image_grids.get(o)) for o, n, h in sorted(state.images))


def check_images(images: Sequence[TransferImage], listed: bool, token_ids: Sequence[int], config: ModelConfig) -> None:
    """The importer's checks of a header's spans against its own model (CacheStateConflict, FAILED_PRECONDITION,
    naming why: nothing is taken). token_ids: the header's."""
    vision = config.vision
    if not listed:  # an older exporter: it sends no spans, even for a cache that has them
        if vision is not None and vision.image_token_id in token_ids:
            raise CacheStateConflict(
                f"the export's tokens hold the image token (id {vision.image_token_id}) but its header lists no "
                "image spans (KvTransferHeader.images_listed unset: an exporter older than image transfer); the "
                "cache cannot go on as at the source: recompute it here")
        return
    if not images:
        return
    if vision is None:
        raise CacheStateConflict("the export shows images (KvTransferHeader.images) and this model has no vision "
                                 "tower")
    if len(images) > MAX_TRANSFER_IMAGES:
        raise CacheStateConflict(f"the export carries {len(images)} image spans (KvTransferHeader.images); at most "
                                 f"{MAX_TRANSFER_IMAGES}")
    n, last_end = len(token_ids), 0
    for k, im in enumerate(images):
        name = f"KvTransferHeader.images[{k}] (offset {im.offset})"
        if im.length < 1 or im.offset < last_end or im.offset >= n \
                or im.offset + im.length > config.max_position_embeddings:
            raise CacheStateConflict(f"{name}: its span [{im.offset}, {im.offset + im.length}) is empty, overlaps the "
                                     f"previous one, starts past the export's {n} tokens or ends past this model's "
                                     f"{config.max_position_embeddings} positions")
        last_end = im.offset + im.length
        if len(im.content_hash) != _HASH_CHARS or im.content_hash.strip("0123456789abcdef"):
            raise CacheStateConflict(f"{name}: content_hash must be {_HASH_CHARS} lowercase hex characters")
        if bool(config.mrope_section) != (im.grid is not None):
            raise CacheStateConflict(
                f"{name}: " + ("this model places images by M-RoPE and the span has no grid (grid_rows, "
                               "grid_columns): the positions after it are unknown" if config.mrope_section else
                               "the span has an M-RoPE grid and this model has no M-RoPE positions"))
        if im.grid is not None:
            rows, cols = im.grid
            run = sum(1 for t in token_ids[im.offset:min(im.offset + im.length, n)] if t == vision.image_token_id)
            if rows < 1 or cols < 1 or rows * cols > im.length or run > rows * cols:
                raise CacheStateConflict(f"{name}: its grid {rows} x {cols} does not fit its span of {im.length} "
                                         f"tokens ({run} image tokens written)")


def adopt_images(state: CacheState, images: Sequence[TransferImage]) -> None:
    """The imported cache shows the exported spans, with their grids (checked: check_images)."""
    state.images = [(im.offset, im.length, im.content_hash) for im in images]
    state.image_grids = {im.offset: im.grid for im in images if im.grid is not None}
