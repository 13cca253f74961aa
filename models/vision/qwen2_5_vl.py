"""The Qwen2.5-VL vision tower, as transformers' modeling_qwen2_5_vl.py computes it: a patch embedding (a Conv3d
whose kernel is the whole temporal_patch_size x patch x patch patch, so one matrix product over the processor's
pre-flattened patches), 2-D axial rotary positions, pre-norm blocks (RMSNorm, attention inside windows of
window_size pixels except the fullatt_blocks, which see the whole image, and a SwiGLU MLP with biases), and the
patch merger (RMSNorm, each merge x merge group of patches -> one row, a GELU MLP to the text width).

Window attention reorders the patches window by window (merge groups kept whole) before the blocks and the merged
rows back to the image's order after the merger. One image per call, one frame (video is not served): its patches
form one attention sequence for the full-attention blocks. Parameter names are the checkpoint's under `visual.`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.vision.config import VisionConfig


class _RmsNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # normalised in float32, scaled in the input's dtype
        f = x.float()
        return self.weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, head_dim]; cos, sin: [N, head_dim] float32. In float32, back to x's dtype."""
    f = x.float()
    half = f.shape[-1] // 2
    rotated = torch.cat((-f[..., half:], f[..., :half]), dim=-1)
    return (f * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.heads = cfg.num_heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        n, d = x.shape  # x: [patches, hidden] in window order; lengths: the attention segments, in order
        q, k, v = self.qkv(x).view(n, 3, self.heads, d // self.heads).unbind(1)  # each [n, heads, head_dim]
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        out = [F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in seg))[0].transpose(0, 1)
               for seg in zip(q.split(lengths), k.split(lengths), v.split(lengths))]  # each [len, heads, head_dim]
        return self.proj(torch.cat(out).reshape(n, d))


class _Mlp(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = _RmsNorm(cfg.hidden_size)
        self.norm2 = _RmsNorm(cfg.hidden_size)
        self.attn = _Attention(cfg)
        self.mlp = _Mlp(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, lengths)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        wide = cfg.hidden_size * cfg.scale_factor ** 2
        self.ln_q = _RmsNorm(cfg.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(wide, wide), nn.GELU(), nn.Linear(wide, cfg.text_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        unit_rows = self.ln_q(x).view(-1, self.mlp[0].in_features)  # [patches / merge^2, hidden x merge^2]
        return self.mlp(unit_rows)


class Qwen25VisionTower(nn.Module):
    """pixels [grid_h / merge, grid_w / merge, merge, merge, channels x temporal x patch x patch] (the processor's
    flattened patches, in its order) -> embedding rows [grid_h x grid_w / merge^2, text hidden], in the order the
    image's placeholder tokens take them (row by row over the merged grid)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.patch_embed = nn.Module()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.patch_embed.proj = nn.Conv3d(cfg.num_channels, cfg.hidden_size, kernel, kernel, bias=False)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.num_layers))
        self.merger = _Merger(cfg)

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        rows, cols, m = pixels.shape[0], pixels.shape[1], cfg.scale_factor
        weight = self.patch_embed.proj.weight  # [hidden, channels, temporal, patch, patch]
        x = F.linear(pixels.reshape(-1, weight[0].numel()).to(weight.dtype), weight.flatten(1))  # [N, hidden]
        order, lengths = self._windows(rows, cols, x.device)
        unit = m * m
        x = x.view(-1, unit, x.shape[-1])[order].flatten(0, 1)  # [N, hidden], window by window
        cos, sin = (t.view(-1, unit, t.shape[-1])[order].flatten(0, 1) for t in self._rope(rows, cols, x.device))
        whole = [x.shape[0]]
        for i, block in enumerate(self.blocks):
            x = block(x, (cos, sin), whole if i in cfg.fullatt_blocks else lengths)
        return self.merger(x)[torch.argsort(order)]  # [rows x cols, text hidden], back in the image's order

    def _windows(self, rows: int, cols: int, device: torch.device) -> tuple[torch.Tensor, list[int]]:
        """transformers' get_vision_window_index for one frame: the merged rows in window order (windows of
        window_size pixels row by row, each row by row inside; edge windows smaller), and each window's patches."""
        win = self.config.window_size // self.config.scale_factor // self.config.patch_size
        grid = torch.arange(rows * cols, device=device).view(rows, cols)
        parts = [grid[r:r + win, c:c + win].reshape(-1) for r in range(0, rows, win) for c in range(0, cols, win)]
        unit = self.config.scale_factor ** 2
        return torch.cat(parts), [p.numel() * unit for p in parts]

    def _rope(self, rows: int, cols: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, head_dim] float32 of each patch (image order): its row's angles on the first half of the
        rotated pair's features, its column's on the second (transformers' axial rope)."""
        cfg = self.config
        m, head_dim = cfg.scale_factor, cfg.hidden_size // cfg.num_heads
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float, device=device)
                                        / (head_dim // 2)))  # [head_dim / 4]
        inner = torch.arange(m, device=device)
        h = (torch.arange(rows, device=device)[:, None, None, None] * m + inner[None, None, :, None])
        w = (torch.arange(cols, device=device)[None, :, None, None] * m + inner[None, None, None, :])
        h, w = (t.expand(rows, cols, m, m).reshape(-1).float() for t in (h, w))  # [N] each, the processor's order
        half = torch.cat((h[:, None] * inv, w[:, None] * inv), dim=-1)  # [N, head_dim / 2]
        emb = torch.cat((half, half), dim=-1)
        return emb.cos(), emb.sin()
