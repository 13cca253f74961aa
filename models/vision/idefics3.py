"""The Idefics3 / SmolVLM vision tower: a SigLIP-style encoder (patch convolution + learned positions, the
encoder layers of models/vision/siglip.py, a final LayerNorm) and the connector (pixel shuffle: each scale_factor x
scale_factor group of patches becomes one row, then one linear map to the text width), as transformers'
modeling_idefics3.py computes them. Parameter names are the checkpoint's under `model.`.

Tiles are whole (the scheduler's image processor makes every tile image_size square), so every patch is real:
no patch mask, and positions are the patch grid's, bucketed as transformers buckets them.
"""
from __future__ import annotations

import torch
from torch import nn

from models.vision.config import VisionConfig
from models.vision.siglip import encoder


class _Embeddings(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.side = cfg.image_size // cfg.patch_size
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, cfg.patch_size)
        self.position_embedding = nn.Embedding(self.side ** 2, cfg.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [tiles, patches, hidden]
        return x + self.position_embedding(self._positions(pixels.device))

    def _positions(self, device: torch.device) -> torch.Tensor:
        """transformers' bucketed fractional coordinates for a whole tile (the grid's own indices, computed
        the same way so that rounding agrees): [patches]."""
        n = self.side
        boundaries = torch.arange(1 / n, 1.0, 1 / n, device=device)
        frac = torch.clamp(torch.arange(n, device=device, dtype=torch.float32) * (1.0 / torch.tensor(
            float(n), device=device)), max=1.0 - 1e-6)
        b = torch.bucketize(frac, boundaries, right=True)
        return (b[:, None] * n + b[None, :]).reshape(-1)


class _VisionModel(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.embeddings = _Embeddings(cfg)
        self.encoder = encoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)


class Idefics3VisionTower(nn.Module):
    """pixels [tiles, channels, image_size, image_size] -> embedding rows [tiles x tokens_per_tile, text hidden],
    in the order the placeholder tokens take them (tile by tile)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.vision_model = _VisionModel(cfg)
        self.connector = nn.Module()
        self.connector.modality_projection = nn.Module()
        self.connector.modality_projection.proj = nn.Linear(
            cfg.hidden_size * cfg.scale_factor ** 2, cfg.text_hidden_size, bias=False)

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        vm = self.vision_model
        x = vm.embeddings(pixels.to(vm.post_layernorm.weight.dtype))  # [tiles, patches, hidden]
        for layer in vm.encoder.layers:
            x = layer(x)
        x = self._pixel_shuffle(vm.post_layernorm(x))  # [tiles, tokens_per_tile, hidden * scale^2]
        return self.connector.modality_projection.proj(x).reshape(-1, self.config.text_hidden_size)

    def _pixel_shuffle(self, x: torch.Tensor) -> torch.Tensor:
        """transformers' Idefics3Connector.pixel_shuffle, step for step."""
        s = self.config.scale_factor
        b, seq, d = x.shape
        side = int(seq ** 0.5)
        x = x.view(b, side, side // s, d * s).permute(0, 2, 1, 3)
        x = x.reshape(b, side // s, side // s, d * s * s).permute(0, 2, 1, 3)
        return x.reshape(b, seq // (s * s), d * s * s)
