"""VisionConfig: what the vision tower of a vision-language checkpoint needs, read from its config.json."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VisionConfig:
    family: str  # "idefics3" (Idefics3 / SmolVLM: SigLIP-style encoder + pixel-shuffle connector) | "qwen2_5_vl"
    # (Qwen2.5-VL: a window-attention ViT over pre-flattened patches + a patch merger)
    hidden_size: int  # the encoder's width
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int  # side of one (square) tile the encoder reads, in pixels (qwen2_5_vl: patch_size x merge, the
    # pixels one embedding row covers)
    patch_size: int
    layer_norm_eps: float
    hidden_act: str  # gelu_tanh (idefics3) | silu (qwen2_5_vl's SwiGLU)
    scale_factor: int  # the connector's pixel shuffle (qwen2_5_vl: spatial_merge_size): scale_factor^2 patches
    # -> one embedding row
    image_token_id: int  # the placeholder token whose positions take embedding rows
    text_hidden_size: int  # the language model's width (the connector's output)
    # qwen2_5_vl only: frames per patch (an image is repeated to fill them), the side of an attention window in
    # pixels, the blocks that attend over the whole image instead, and the axial rope's theta
    temporal_patch_size: int = 1
    window_size: int = 0
    fullatt_blocks: tuple[int, ...] = ()
    rope_theta: float = 10000.0

    @property
    def patches_per_tile(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_tile(self) -> int:
        """Embedding rows one tile gives after the pixel shuffle."""
        return self.patches_per_tile // (self.scale_factor ** 2)
