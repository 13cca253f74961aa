"""What the image processors here share (scheduler/vision/idefics3_processor.py, gemma3_processor.py,
qwen2_vl_processor.py), step for step
as transformers' PIL backend computes it: RGB conversion, resizing uint8 pixels in Pillow, rescaling and
normalizing to float32 channels-first; and ProcessedImage, what a processor hands on."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

IMAGENET_STANDARD = [0.5, 0.5, 0.5]


@dataclass(frozen=True)
class ProcessedImage:
    pixels: np.ndarray  # float32 [tiles, 3, tile, tile] (scheduler/vision/qwen2_vl_processor.py: its own shape)
    rows: int  # the split: rows x cols tiles before the global one (0, 0: one tile, not split); Qwen2.5-VL: the
    # merged patch grid
    cols: int


def rgb(image: Image.Image) -> np.ndarray:
    """transformers' convert_to_rgb: transparency composited over white -> uint8 [H, W, 3]."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, image)
    return np.array(image.convert("RGB"))


def resize(x: np.ndarray, h: int, w: int, resample: int) -> np.ndarray:
    """uint8 [H, W, 3] -> [h, w, 3] with Pillow's filter `resample`, as transformers' PIL backend resizes."""
    return np.array(Image.fromarray(x).resize((w, h), resample=resample))


def values(tile: np.ndarray, rescale: float | None, mean: np.ndarray | None, std: np.ndarray | None) -> np.ndarray:
    """uint8 [H, W, 3] -> float32 [3, H, W], rescaled (None: not) and normalized (mean None: not) as transformers'
    numpy steps round."""
    x = np.moveaxis(tile, -1, 0)
    if rescale is not None:
        x = (x.astype(np.float64) * rescale).astype(np.float32)
    else:
        x = x.astype(np.float32)
    if mean is not None and std is not None:
        x = ((x.T - mean) / std).T
    return np.ascontiguousarray(x, dtype=np.float32)
