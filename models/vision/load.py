"""Builds a checkpoint's vision tower (models/vision/) on the meta device and assigns its tensors from the
checkpoint, as models/loader.py does for the text tower."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from models.vision.config import VisionConfig
from models.vision.gemma3 import Gemma3VisionTower
from models.vision.idefics3 import Idefics3VisionTower
from models.vision.qwen2_5_vl import Qwen25VisionTower
from tandem.errors import CheckpointError

# family -> (module, the checkpoint names of one of its parameters: the first a checkpoint holds is read)
TOWERS: dict[str, tuple[type[nn.Module], Callable[[str], tuple[str, ...]]]] = {
    "idefics3": (Idefics3VisionTower, lambda name: ("model." + name,)),
    # released Gemma 3 checkpoints nest the encoder under vision_model; transformers 5 saves it without
    "gemma3": (Gemma3VisionTower, lambda name: (name.replace("vision_tower.", "vision_tower.vision_model.", 1), name)),
    "qwen2_5_vl": (Qwen25VisionTower, lambda name: ("visual." + name,)),
}


def load_vision_tower(cfg: VisionConfig, read: Callable[[str], torch.Tensor], device: torch.device,
                      dtype: torch.dtype, has: Callable[[str], bool] = lambda name: True) -> nn.Module:
    """read(checkpoint name) -> tensor (the loader's: it raises CheckpointError naming a missing tensor);
    has(checkpoint name): whether the checkpoint holds it."""
    cls, names = TOWERS[cfg.family]
    with torch.device("meta"):
        tower = cls(cfg)
    state = {}
    for name, meta in tower.state_dict().items():
        candidates = names(name)
        found = next((n for n in candidates if has(n)), candidates[0])
        tensor = read(found)
        if tuple(tensor.shape) != tuple(meta.shape):
            raise CheckpointError(f"vision tensor {found!r} has shape {tuple(tensor.shape)}, config.json "
                                  f"implies {tuple(meta.shape)}")
        state[name] = tensor.to(device=device, dtype=dtype)
    tower.load_state_dict(state, strict=True, assign=True)
    return tower.eval()
