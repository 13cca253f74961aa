"""The Idefics3 / SmolVLM vision tower: a SigLIP-style encoder (patch convolution + learned positions, pre-norm
layers of bidirectional attention and a tanh-GELU MLP, a final LayerNorm) and the connector (pixel shuffle:
each scale_factor x scale_factor group of patches becomes one row, then one linear map to the text width), as
transformers' modeling_idefics3.py computes them. Parameter names are the checkpoint's under `model.`.

Tiles are whole (the scheduler's image processor makes every tile image_size square), so every patch is real:
no patch mask, and positions are the patch grid's, bucketed as transformers buckets them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.vision.config import VisionConfig


class _Attention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.heads = cfg.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape  # x: [tiles, patches, hidden]
        split = lambda t: t.view(b, n, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731  [b, heads, n, hd]
        out = F.scaled_dot_product_attention(split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class _Mlp(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class _EncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = _Attention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = _Mlp(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


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
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(_EncoderLayer(cfg) for _ in range(cfg.num_layers))
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
