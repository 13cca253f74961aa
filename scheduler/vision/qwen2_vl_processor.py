"""Qwen2.5-VL's image processor in numpy + Pillow, step for step as transformers' PIL backend
(`Qwen2VLImageProcessorPil`, transformers 5.24) computes it, from the model's preprocessor_config.json: RGB
(transparency over white), smart_resize (each side a multiple of patch_size x merge_size, the pixel count within
[min_pixels, max_pixels], the aspect ratio kept as closely as that allows; Pillow on uint8 pixels with the config's
filter), rescale, normalize, and the patches flattened as transformers flattens them (each patch repeated over
temporal_patch_size frames), in merge groups. Also the placeholder text Qwen2_5_VLProcessor puts in place of the
`<|image_pad|>` the chat template writes for an image: one `<|image_pad|>` per merged patch.

The pixels go to the executor as [rows, columns, merge, merge, features] (rows x columns: the merged grid; the
executor's M-RoPE reads the grid from that shape). Tests check them against transformers' own class
(tests/models/test_vision_qwen2_5_vl.py)."""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from PIL import Image

from scheduler.vision.pixels import ProcessedImage, rgb
from tandem.errors import CheckpointError, InvalidRequest

IMAGE_PAD = "<|image_pad|>"
OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
MAX_ASPECT = 200  # transformers' smart_resize refuses a longer side more than this many times the shorter


class Qwen2VLImageProcessor:
    marker = IMAGE_PAD  # what the chat template writes for an image part (inside its vision_start / vision_end)
    one_chunk = False  # a span may run over several prefill chunks

    def __init__(self, cfg: dict[str, Any], source: str) -> None:
        size = cfg.get("size") or {}
        self.min_pixels = int(size.get("shortest_edge") or cfg.get("min_pixels") or 56 * 56)
        self.max_pixels = int(size.get("longest_edge") or cfg.get("max_pixels") or 28 * 28 * 1280)
        self.patch = int(cfg.get("patch_size", 14))
        self.merge = int(cfg.get("merge_size", 2))
        self.temporal = int(cfg.get("temporal_patch_size", 2))
        self.resample = int(cfg.get("resample", Image.Resampling.BICUBIC))
        self.do_resize = bool(cfg.get("do_resize", True))
        self.rescale = float(cfg.get("rescale_factor", 1 / 255)) if cfg.get("do_rescale", True) else None
        self.normalize = bool(cfg.get("do_normalize", True))
        self.mean = np.array(cfg.get("image_mean") or OPENAI_CLIP_MEAN, dtype=np.float32)
        self.std = np.array(cfg.get("image_std") or OPENAI_CLIP_STD, dtype=np.float32)
        if not cfg.get("do_convert_rgb", True):
            raise CheckpointError(f"{source}: do_convert_rgb false is not supported (images are made RGB)")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise CheckpointError(f"{source}: size.shortest_edge (min_pixels) {self.min_pixels} must be positive and "
                                  f"at most size.longest_edge (max_pixels) {self.max_pixels}")

    def process(self, image: Image.Image) -> ProcessedImage:
        """pixels float32 [rows, columns, merge, merge, channels x temporal x patch x patch]; rows, cols: the
        merged grid (one image token each)."""
        x = rgb(image)  # uint8 [H, W, 3]
        if self.do_resize:
            h, w = self.smart_resize(*x.shape[:2])
            x = np.array(Image.fromarray(x).resize((w, h), resample=self.resample))
        h, w = x.shape[:2]
        f = self.patch * self.merge
        if h % f or w % f:  # (do_resize false and a size that does not divide)
            raise InvalidRequest(f"the image is {w}x{h} pixels; without resizing each side must be a multiple of {f}")
        c = np.moveaxis(x, -1, 0)  # [3, H, W]
        c = (c.astype(np.float64) * self.rescale).astype(np.float32) if self.rescale is not None else c.astype(
            np.float32)
        if self.normalize:
            c = ((c.T - self.mean) / self.std).T
        rows, cols, m, p = h // f, w // f, self.merge, self.patch
        patches = c.astype(np.float32).reshape(3, rows, m, p, cols, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        # [rows, cols, m, m, 3, p, p] -> each patch repeated over the temporal frames: [..., 3, temporal, p, p]
        patches = np.broadcast_to(patches[:, :, :, :, :, None], (rows, cols, m, m, 3, self.temporal, p, p))
        pixels = np.ascontiguousarray(patches.reshape(rows, cols, m, m, -1), dtype=np.float32)
        return ProcessedImage(pixels, rows, cols)

    def placeholder(self, im: ProcessedImage) -> list[tuple[str, slice | None]]:
        """The text that replaces the template's one `<|image_pad|>` (Qwen2_5_VLProcessor's expansion), as pieces
        (text, the pixels of the span it is): one span, the whole grid."""
        return [(IMAGE_PAD * (im.rows * im.cols), slice(None))]

    def smart_resize(self, height: int, width: int) -> tuple[int, int]:
        """transformers' smart_resize (factor = patch_size x merge_size)."""
        if max(height, width) / min(height, width) > MAX_ASPECT:
            raise InvalidRequest(f"the image is {width}x{height} pixels; its aspect ratio must be below {MAX_ASPECT}")
        factor = self.patch * self.merge
        h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt((height * width) / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar
