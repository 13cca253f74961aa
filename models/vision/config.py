"""VisionConfig: what the vision tower of a vision-language checkpoint needs, read from its config.json."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VisionConfig:
    # "idefics3" (Idefics3 / SmolVLM: SigLIP-style encoder + pixel-shuffle connector) | "gemma3" (SigLIP +
    # average pooling + Gemma RMSNorm + a projection matrix) | "qwen2_5_vl" (Qwen2.5-VL: a window-attention ViT
    # over pre-flattened patches + a patch merger)
    family: str
    hidden_size: int  # the encoder's width
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int  # side of one (square) tile the encoder reads, in pixels (qwen2_5_vl: patch_size x merge, the
    # pixels one embedding row covers)
    patch_size: int
    layer_norm_eps: float
    hidden_act: str  # gelu_tanh (idefics3, gemma3) | silu (qwen2_5_vl's SwiGLU)
    # The connector: scale_factor x scale_factor patches -> one embedding row (Idefics3's pixel shuffle, Gemma 3's
    # average pooling kernel, qwen2_5_vl's spatial_merge_size)
    scale_factor: int
    image_token_id: int  # the placeholder token whose positions take embedding rows
    text_hidden_size: int  # the language model's width (the connector's output)
    # qwen2_5_vl only: frames per patch (an image is repeated to fill them), the side of an attention window in
    # pixels, the blocks that attend over the whole image instead, and the axial rope's theta
    temporal_patch_size: int = 1
    window_size: int = 0
    fullatt_blocks: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    # The tokens of one image's span attend to each other both ways during prefill (Gemma 3: transformers'
    # token_type_ids block mask), so a span is written in one chunk and a span is exactly its image tokens
    # (executor_service/vision/image_checks.py; models/attention/paged.py applies it).
    bidirectional_images: bool = False

    @property
    def patches_per_tile(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_tile(self) -> int:
        """Embedding rows one tile gives after the connector."""
        return self.patches_per_tile // (self.scale_factor ** 2)
