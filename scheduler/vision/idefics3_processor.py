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
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from tandem.errors import CheckpointError

MAX_IMAGE_SIZE = 4096  # transformers' absolute bound on the resized image
IMAGENET_STANDARD = [0.5, 0.5, 0.5]
IMAGE_MARKER = "<image>"  # what the chat template writes for an image part


@dataclass(frozen=True)
class ProcessedImage:
    pixels: np.ndarray  # float32 [tiles, 3, tile, tile] (scheduler/vision/qwen2_vl_processor.py: its own shape)
    rows: int  # the split: rows x cols tiles before the global one (0, 0: one tile, not split); Qwen2.5-VL: the
    # merged patch grid
    cols: int


class Idefics3ImageProcessor:
    marker = IMAGE_MARKER

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
        x = _rgb(image)  # uint8 [H, W, 3]
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
        return ProcessedImage(np.stack([self._values(t) for t in tiles]), rows, cols)

    def placeholder(self, rows: int, cols: int) -> str:
        """The text that replaces one `<image>` (transformers' Idefics3Processor.replace_image_token)."""
        image = "<image>" * self.tokens_per_tile
        if rows == 0 and cols == 0:
            return f"<fake_token_around_image><global-img>{image}<fake_token_around_image>"
        text = ""
        for r in range(rows):
            for c in range(cols):
                text += f"<fake_token_around_image><row_{r + 1}_col_{c + 1}>{image}"
            text += "\n"
        return text + f"\n<fake_token_around_image><global-img>{image}<fake_token_around_image>"

    def _resize(self, x: np.ndarray, h: int, w: int) -> np.ndarray:
        return np.array(Image.fromarray(x).resize((w, h), resample=self.resample))

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

    def _values(self, tile: np.ndarray) -> np.ndarray:
        """uint8 [H, W, 3] -> float32 [3, H, W], rescaled and normalized as transformers' numpy steps round."""
        x = np.moveaxis(tile, -1, 0)
        if self.rescale is not None:
            x = (x.astype(np.float64) * self.rescale).astype(np.float32)
        else:
            x = x.astype(np.float32)
        if self.normalize:
            x = ((x.T - self.mean) / self.std).T
        return np.ascontiguousarray(x, dtype=np.float32)


def _rgb(image: Image.Image) -> np.ndarray:
    """transformers' convert_to_rgb: transparency composited over white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, image)
    return np.array(image.convert("RGB"))


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
