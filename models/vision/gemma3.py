"""Gemma 3's vision tower: a SigLIP encoder (patch convolution + learned positions indexed by the plain patch
order, the encoder layers of models/vision/siglip.py, a final LayerNorm) and Gemma3MultiModalProjector (the patch
grid average-pooled to mm_tokens_per_image rows, Gemma's (1 + weight) RMSNorm, one matrix to the text width),
as transformers' modeling_siglip.py and modeling_gemma3.py compute them. Parameter names are the checkpoint's:
`vision_tower.vision_model.*` (released checkpoints; transformers 5 saves `vision_tower.*`, models/vision/load.py
reads either) and `multi_modal_projector.*`."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.vision.config import VisionConfig
from models.vision.siglip import encoder


class _Embeddings(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.patches_per_tile, cfg.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [tiles, patches, hidden]
        return x + self.position_embedding.weight  # position ids: arange(patches)


class _SoftEmbNorm(nn.Module):
    """Gemma's RMSNorm: in float32, times (1 + weight)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class Gemma3VisionTower(nn.Module):
    """pixels [images, channels, image_size, image_size] -> embedding rows [images x tokens_per_tile, text hidden],
    image by image, each image's rows in the pooled grid's row-major order (the placeholder tokens' order)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.vision_tower = nn.Module()
        self.vision_tower.embeddings = _Embeddings(cfg)
        self.vision_tower.encoder = encoder(cfg)
        self.vision_tower.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.multi_modal_projector = nn.Module()
        self.multi_modal_projector.mm_input_projection_weight = nn.Parameter(
            torch.zeros(cfg.hidden_size, cfg.text_hidden_size))
        self.multi_modal_projector.mm_soft_emb_norm = _SoftEmbNorm(cfg.hidden_size, cfg.layer_norm_eps)

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        vt, proj = self.vision_tower, self.multi_modal_projector
        x = vt.embeddings(pixels.to(vt.post_layernorm.weight.dtype))  # [images, patches, hidden]
        for layer in vt.encoder.layers:
            x = layer(x)
        x = vt.post_layernorm(x)
        b, n, d = x.shape
        side, k = self.config.image_size // self.config.patch_size, self.config.scale_factor
        grid = x.transpose(1, 2).reshape(b, d, side, side)  # [images, hidden, side, side]
        x = F.avg_pool2d(grid, kernel_size=k, stride=k).flatten(2).transpose(1, 2)  # [images, tokens, hidden]
        x = torch.matmul(proj.mm_soft_emb_norm(x), proj.mm_input_projection_weight)  # [images, tokens, text hidden]
        return x.reshape(-1, self.config.text_hidden_size)
