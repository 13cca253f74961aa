"""Builds a checkpoint's vision tower (models/vision/) on the meta device and assigns its tensors from the
checkpoint, as models/loader.py does for the text tower."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from models.vision.config import VisionConfig
from models.vision.idefics3 import Idefics3VisionTower
from models.vision.qwen2_5_vl import Qwen25VisionTower
from tandem.errors import CheckpointError

# family -> (module, checkpoint name prefix)
TOWERS = {"idefics3": (Idefics3VisionTower, "model."), "qwen2_5_vl": (Qwen25VisionTower, "visual.")}


def load_vision_tower(cfg: VisionConfig, read: Callable[[str], torch.Tensor], device: torch.device,
                      dtype: torch.dtype) -> nn.Module:
    """read(checkpoint name) -> tensor (the loader's: it raises CheckpointError naming a missing tensor)."""
    cls, prefix = TOWERS[cfg.family]
    with torch.device("meta"):
        tower = cls(cfg)
    state = {}
    for name, meta in tower.state_dict().items():
        tensor = read(prefix + name)
        if tuple(tensor.shape) != tuple(meta.shape):
            raise CheckpointError(f"vision tensor {prefix + name!r} has shape {tuple(tensor.shape)}, config.json "
                                  f"implies {tuple(meta.shape)}")
        state[name] = tensor.to(device=device, dtype=dtype)
    tower.load_state_dict(state, strict=True, assign=True)
    return tower.eval()
