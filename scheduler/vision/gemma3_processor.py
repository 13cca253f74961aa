"""Gemma 3's image processor in numpy + Pillow, step for step as transformers' PIL backend
(`Gemma3ImageProcessorPil`, transformers 5.24) computes it from the model's preprocessor_config.json: RGB
(transparency over white), then — with do_pan_and_scan, off by default — crops of a wide or tall image beside the
whole one, each resized to size.height x size.width with the config's filter (bilinear by default), rescaled and
normalized. Also the placeholder text transformers' Gemma3Processor puts in place of each `<start_of_image>` the
chat template writes: "\\n\\n<start_of_image>" + mm_tokens_per_image image tokens + "<end_of_image>\\n\\n" per view
(with crops: "Here is the original image ... and here are some crops to help you see better ..."). Each view's
span is its image tokens alone: they attend to each other both ways, so a span is prefilled in one chunk.

Tests check the pixels and the prompt's tokens against transformers' own classes
(tests/models/test_vision_gemma3.py)."""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from PIL import Image

from scheduler.vision.pixels import IMAGENET_STANDARD, ProcessedImage, resize, rgb, values
from tandem.errors import CheckpointError

BOI, EOI, IMAGE_TOKEN = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
# Gemma3Processor's defaults for the pan-and-scan settings a preprocessor_config.json leaves null
PAN_AND_SCAN = {"pan_and_scan_min_crop_size": 256, "pan_and_scan_max_num_crops": 4,
                "pan_and_scan_min_ratio_to_activate": 1.2}


class Gemma3ImageProcessor:
    marker = BOI  # what Gemma 3's chat template writes for an image part
    one_chunk = True  # scheduler/vision/image_chunks.py

    def __init__(self, cfg: dict[str, Any], tokens_per_image: int, source: str) -> None:
        if not _flag(cfg, "do_convert_rgb", True):
            raise CheckpointError(f"{source}: do_convert_rgb false is not supported (images are made RGB)")
        size = cfg.get("size") or {}
        if not _flag(cfg, "do_resize", True) or "height" not in size or "width" not in size:
            raise CheckpointError(f"{source}: Gemma 3 needs do_resize with size.height and size.width (the "
                                  "encoder's square)")
        self.height, self.width = int(size["height"]), int(size["width"])
        self.resample = int(_value(cfg, "resample", Image.Resampling.BILINEAR))
        self.rescale = float(_value(cfg, "rescale_factor", 1 / 255)) if _flag(cfg, "do_rescale", True) else None
        normalize = _flag(cfg, "do_normalize", True)
        self.mean = np.array(_value(cfg, "image_mean", IMAGENET_STANDARD), dtype=np.float32) if normalize else None
        self.std = np.array(_value(cfg, "image_std", IMAGENET_STANDARD), dtype=np.float32) if normalize else None
        self.pan_and_scan = _flag(cfg, "do_pan_and_scan", False)
        pas = {key: _value(cfg, key, default) for key, default in PAN_AND_SCAN.items()}
        self.min_crop, self.max_crops = int(pas["pan_and_scan_min_crop_size"]), int(pas["pan_and_scan_max_num_crops"])
        self.min_ratio = float(pas["pan_and_scan_min_ratio_to_activate"])
        self.tokens_per_image = tokens_per_image

    def process(self, image: Image.Image) -> ProcessedImage:
        """[1 + crops, 3, h, w]: the whole image, then its crops (none without pan-and-scan)."""
        x = rgb(image)  # uint8 [H, W, 3]
        views = [x] + (self._crops(x) if self.pan_and_scan else [])
        return ProcessedImage(np.stack([values(resize(v, self.height, self.width, self.resample), self.rescale,
                                               self.mean, self.std) for v in views]), 0, 0)

    def placeholder(self, im: ProcessedImage) -> list[tuple[str, slice | None]]:
        """Gemma3Processor.replace_image_token as pieces (text, the view whose span it is; None: no span)."""
        def view(k: int) -> list[tuple[str, slice | None]]:  # full_image_sequence, its image tokens the span
            return [(f"\n\n{BOI}", None), (IMAGE_TOKEN * self.tokens_per_image, slice(k, k + 1)), (f"{EOI}\n\n", None)]
        crops = im.pixels.shape[0] - 1
        if not crops:
            return view(0)
        pieces = [("Here is the original image ", None), *view(0),
                  (" and here are some crops to help you see better ", None)]
        for k in range(1, crops + 1):
            pieces += ([(" ", None)] if k > 1 else []) + view(k)
        return pieces

    def _crops(self, x: np.ndarray) -> list[np.ndarray]:
        """Gemma3ImageProcessorPil.pan_and_scan on uint8 [H, W, 3]: a grid of crops along the long side of an image
        whose aspect ratio reaches min_ratio (none otherwise)."""
        height, width = x.shape[:2]
        if width >= height:
            if width / height < self.min_ratio:
                return []
            across = min(int(math.floor(width / self.min_crop)), int(math.floor(width / height + 0.5)))
            across, down = min(self.max_crops, max(2, across)), 1
        else:
            if height / width < self.min_ratio:
                return []
            down = min(int(math.floor(height / self.min_crop)), int(math.floor(height / width + 0.5)))
            across, down = 1, min(self.max_crops, max(2, down))
        crop_w, crop_h = int(math.ceil(width / across)), int(math.ceil(height / down))
        if min(crop_w, crop_h) < self.min_crop:
            return []
        return [x[r * crop_h:(r + 1) * crop_h, c * crop_w:(c + 1) * crop_w] for r in range(down) for c in range(across)]


def _value(cfg: dict[str, Any], key: str, default: Any) -> Any:
    """A setting, where null means transformers' default (released Gemma 3 files write null for several)."""
    value = cfg.get(key)
    return default if value is None else value


def _flag(cfg: dict[str, Any], key: str, default: bool) -> bool:
    return bool(_value(cfg, key, default))
