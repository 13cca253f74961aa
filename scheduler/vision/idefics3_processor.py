"""Idefics3 / SmolVLM's image processor in numpy + Pillow, step for step as transformers' PIL backend
(`Idefics3ImageProcessorPil` / `SmolVLMImageProcessorPil`, transformers 5.24) computes it, from the model's
preprocessor_config.json: RGB (transparency over white), resize so the longest edge is size.longest_edge, resize
up to multiples of the tile (max_image_size.longest_edge), split into rows x columns tiles plus the whole image
resized to one tile (none when it fits one tile), rescale and normalize. Resizes run on uint8 pixels in Pillow
with the config's resampling filter, as transformers' do. Also the placeholder text transformers' processor puts
in place of each `<image>` (`Idefics3Processor.replace_image_token`).

Tests check the pixels against transformers' own class (tests/scheduler/test_vision_processor.py)."""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from PIL import Image

from scheduler.vision.pixels import IMAGENET_STANDARD, ProcessedImage, resize, rgb, values
from tandem.errors import CheckpointError

MAX_IMAGE_SIZE = 4096  # transformers' absolute bound on the resized image


class Idefics3ImageProcessor:
    marker = "<image>"  # what the chat template writes for an image part
    one_chunk = False  # a span may run over several prefill chunks

    def __init__(self, cfg: dict[str, Any], tokens_per_tile: int, source: str) -> None:
        self.longest_edge = int((cfg.get("size") or {}).get("longest_edge", 4 * 364))
        self.tile = int((cfg.get("max_image_size") or {}).get("longest_edge", 364))
        self.resample = int(cfg.get("resample", Image.Resampling.LANCZOS))
        self.split = bool(cfg.get("do_image_splitting", True))
        self.do_resize = bool(cfg.get("do_resize", True))
        self.rescale = float(cfg.get("rescale_factor", 1 / 255)) if cfg.get("do_rescale", True) else None
        self.normalize = bool(cfg.get("do_normalize", True))
        self.mean = np.array(cfg.get("image_mean") or IMAGENET_STANDARD, dtype=np.float32)
        self.std = np.array(cfg.get("image_std") or IMAGENET_STANDARD, dtype=np.float32)
        self.tokens_per_tile = tokens_per_tile
        if not cfg.get("do_convert_rgb", True):
            raise CheckpointError(f"{source}: do_convert_rgb false is not supported (images are made RGB)")

    def process(self, image: Image.Image) -> ProcessedImage:
        x = rgb(image)  # uint8 [H, W, 3]
        if self.do_resize:
            h, w = _rescale_to_max_len(*x.shape[:2], self.longest_edge)
            h, w = _scale_below(h, w, MAX_IMAGE_SIZE)
            x = self._resize(x, h, w)
        rows = cols = 0
        if self.split:
            x = self._resize_for_encoder(x)
            h, w = x.shape[:2]
            t = self.tile
            if h > t or w > t:
                rows, cols = (h - t) // t + 1, (w - t) // t + 1
                tiles = [x[r * t:(r + 1) * t, c * t:(c + 1) * t] for r in range(rows) for c in range(cols)]
                tiles.append(self._resize(x, t, t))
            else:
                tiles = [x]
        else:
            tiles = [self._resize(x, self.tile, self.tile)]
        mean, std = (self.mean, self.std) if self.normalize else (None, None)
        return ProcessedImage(np.stack([values(t, self.rescale, mean, std) for t in tiles]), rows, cols)

    def placeholder(self, im: ProcessedImage) -> list[tuple[str, slice | None]]:
        """The text that replaces one `<image>` (transformers' Idefics3Processor.replace_image_token), as pieces
        (text, the tiles of the span it is; None: no span): one span, all of it, all the tiles."""
        rows, cols = im.rows, im.cols
        image = "<image>" * self.tokens_per_tile
        if rows == 0 and cols == 0:
            return [(f"<fake_token_around_image><global-img>{image}<fake_token_around_image>", slice(None))]
        text = ""
        for r in range(rows):
            for c in range(cols):
                text += f"<fake_token_around_image><row_{r + 1}_col_{c + 1}>{image}"
            text += "\n"
        return [(text + f"\n<fake_token_around_image><global-img>{image}<fake_token_around_image>", slice(None))]

    def _resize(self, x: np.ndarray, h: int, w: int) -> np.ndarray:
        return resize(x, h, w, self.resample)

    def _resize_for_encoder(self, x: np.ndarray) -> np.ndarray:
        h, w = x.shape[:2]
        t = self.tile
        aspect = w / h
        if w >= h:
            w = math.ceil(w / t) * t
            h = math.ceil(int(w / aspect) / t) * t
        else:
            h = math.ceil(h / t) * t
            w = math.ceil(int(h * aspect) / t) * t
        return self._resize(x, h, w)


def _rescale_to_max_len(height: int, width: int, max_len: int) -> tuple[int, int]:
    aspect = width / height
    if width >= height:
        width = max_len
        height = int(width / aspect)
        height += height % 2
    else:
        height = max_len
        width = int(height * aspect)
        width += width % 2
    return max(height, 1), max(width, 1)


def _scale_below(height: int, width: int, max_len: int) -> tuple[int, int]:
    aspect = width / height
    if width >= height and width > max_len:
        width = max_len
        height = int(width / aspect)
    elif height > width and height > max_len:
        height = max_len
        width = int(height * aspect)
    return max(height, 1), max(width, 1)
