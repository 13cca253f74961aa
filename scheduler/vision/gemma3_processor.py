"""Gemma 3's image processor in numpy + Pillow, step for step as transformers' PIL backend
(`Gemma3ImageProcessorPil`, transformers 5.24) computes it from the model's preprocessor_config.json: RGB
(transparency over white), resize to size.height x size.width with the config's filter (bilinear by default),
rescale, normalize. Pan-and-scan (extra crops of a wide or tall image) is off by default there and refused here.
Also the placeholder text transformers' Gemma3Processor puts in place of each `<start_of_image>` the chat template
writes: "\\n\\n<start_of_image>" + mm_tokens_per_image image tokens + "<end_of_image>\\n\\n"; the image's span is
its image tokens alone (they attend to each other both ways, so the span is prefilled in one chunk).

Tests check the pixels and the prompt's tokens against transformers' own classes
(tests/models/test_vision_gemma3.py)."""
from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from scheduler.vision.pixels import IMAGENET_STANDARD, ProcessedImage, resize, rgb, values
from tandem.errors import CheckpointError

BOI, EOI, IMAGE_TOKEN = "<start_of_image>", "<end_of_image>", "<image_soft_token>"


class Gemma3ImageProcessor:
    marker = BOI  # what Gemma 3's chat template writes for an image part
    one_chunk = True  # scheduler/vision/image_chunks.py

    def __init__(self, cfg: dict[str, Any], tokens_per_image: int, source: str) -> None:
        if _flag(cfg, "do_pan_and_scan", False):
            raise CheckpointError(f"{source}: do_pan_and_scan true is not supported (each image is one "
                                  "resized view; transformers' default leaves it off)")
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
        self.tokens_per_image = tokens_per_image

    def process(self, image: Image.Image) -> ProcessedImage:
        x = resize(rgb(image), self.height, self.width, self.resample)  # uint8 [h, w, 3]
        return ProcessedImage(values(x, self.rescale, self.mean, self.std)[None], 0, 0)  # [1, 3, h, w]

    def placeholder(self, im: ProcessedImage) -> tuple[str, str, str]:
        """(text before the span, the span's, after it): transformers' Gemma3Processor.full_image_sequence."""
        return f"\n\n{BOI}", IMAGE_TOKEN * self.tokens_per_image, f"{EOI}\n\n"


def _value(cfg: dict[str, Any], key: str, default: Any) -> Any:
    """A setting, where null means transformers' default (released Gemma 3 files write null for several)."""
    value = cfg.get(key)
    return default if value is None else value


def _flag(cfg: dict[str, Any], key: str, default: bool) -> bool:
    return bool(_value(cfg, key, default))
