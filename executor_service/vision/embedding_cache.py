"""Image embeddings, computed once per image: the vision tower's rows for an image, kept by content hash in a
bounded LRU (--vision-cache-images), so a repeated image (another turn, another request, the next chunk of a
span that runs over several chunks) costs no encoder run. Counters for GetMetrics."""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from executor_service.types import ImageInput
from tandem.image_hash import image_hash


@dataclass(frozen=True)
class VisionStats:
    images_encoded: int
    embedding_cache_hits: int
    encode_seconds: float
    cached_images: int


class ImageEmbeddings:
    def __init__(self, tower: nn.Module, device: torch.device, capacity: int) -> None:
        self.tower = tower
        self.device = device
        self.capacity = capacity  # images kept; 0 = none (every reference encodes)
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.images_encoded = 0
        self.hits = 0
        self.encode_seconds = 0.0

    def rows(self, im: ImageInput) -> torch.Tensor:
        """The image's embedding rows [tiles x tokens_per_tile, text hidden] (validated pixels)."""
        key = im.content_hash or image_hash(im.dtype, im.shape, im.pixel_values)
        got = self._cache.get(key)
        if got is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            return got
        start = time.perf_counter()
        pixels = torch.from_numpy(np.frombuffer(im.pixel_values, dtype="<f4").reshape(im.shape).copy())
        rows = self.tower(pixels.to(self.device))  # [tiles x tokens_per_tile, hidden]
        self.encode_seconds += time.perf_counter() - start
        self.images_encoded += 1
        if self.capacity:
            self._cache[key] = rows
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return rows

    def stats(self) -> VisionStats:
        return VisionStats(self.images_encoded, self.hits, self.encode_seconds, len(self._cache))
