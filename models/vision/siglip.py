"""The SigLIP encoder layer both vision families here run (Idefics3 / SmolVLM, Gemma 3): pre-norm, bidirectional
attention over one tile's patches, a tanh-GELU MLP, as transformers' modeling_siglip.py / modeling_idefics3.py
compute them. Parameter names are the checkpoints' (`layer_norm1`, `self_attn.q_proj`, `mlp.fc1`, ...)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.vision.config import VisionConfig


class SiglipAttention(nn.Module):
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


class SiglipMlp(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = SiglipAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = SiglipMlp(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


def encoder(cfg: VisionConfig) -> nn.Module:
    """An `encoder` module holding `layers` (the checkpoints' nesting)."""
    enc = nn.Module()
    enc.layers = nn.ModuleList(SiglipEncoderLayer(cfg) for _ in range(cfg.num_layers))
    return enc
