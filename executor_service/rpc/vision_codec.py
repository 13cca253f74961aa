"""The contract's vision messages <-> the executor's types (ImageInput, VisionInfo, VisionStats)."""
from __future__ import annotations

from executor_service.types import ImageInput, VisionInfo
from executor_service.vision.embedding_cache import VisionStats
from tandem.executor.v1 import executor_pb2 as pb


def images_from_pb(messages) -> tuple[ImageInput, ...]:
    return tuple(ImageInput(m.content_hash, m.offset, m.length, m.dtype or "float32", tuple(m.shape),
                            m.pixel_values) for m in messages)


def vision_info_to_pb(v: VisionInfo) -> pb.VisionInfo:
    return pb.VisionInfo(family=v.family, image_token_id=v.image_token_id, tile_size=v.tile_size,
                         tokens_per_tile=v.tokens_per_tile, max_tiles=v.max_tiles,
                         max_images_per_item=v.max_images_per_item, max_pixel_bytes=v.max_pixel_bytes,
                         embedding_cache_images=v.embedding_cache_images)


def vision_stats_to_pb(s: VisionStats) -> pb.VisionStats:
    return pb.VisionStats(images_encoded=s.images_encoded, embedding_cache_hits=s.embedding_cache_hits,
                          encode_seconds=s.encode_seconds, cached_images=s.cached_images)
