"""What one layer's attention computes beyond softmax(q.k * scale) v, and the one function computing it.

- window: the query at position p sees keys p - window + 1 .. p (sliding-window layers; the masks that say
  so are built by the metadata, models/attention/paged.py and models/attention/decode.py);
- softcap: scores become cap * tanh(scores / cap) before the mask (Gemma 2);
- sinks: one learned logit per head joins each row's softmax and is dropped after it, so a row's weights
  may sum to less than 1 (GPT-OSS).

Without softcap and sinks the scores go through one `scaled_dot_product_attention` call; with either, the
scores are formed explicitly (as transformers' eager attention does for these models).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionSpec:
    scale: float
    window: int | None = None
    softcap: float | None = None

    @property
    def plain(self) -> bool:
        """Plain causal attention: the prefill fast path (is_causal over a chunk from position 0) applies."""
        return self.window is None and self.softcap is None


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, spec: AttentionSpec,
           sinks: torch.Tensor | None) -> torch.Tensor:
    """q: [B, kv_heads, R, d] with R = group * queries rows ordered (group, query); keys, values:
    [B, kv_heads, L, d]; mask: additive float or boolean (True = visible), broadcastable to [B, kv_heads, R, L];
    sinks: [heads] or None. Returns [B, kv_heads, R, d]."""
    if spec.softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=spec.scale)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * spec.scale  # [B, kv_heads, R, L]
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        rows, kv_heads = scores.shape[2], scores.shape[1]
        group = sinks.shape[0] // kv_heads
        # head h = kv * group + g; row r = g * queries + i -> the sink of row r in kv-head kv: sinks[kv, r // queries]
        sink = sinks.view(kv_heads, group, 1).repeat_interleave(rows // group, dim=1).to(scores.dtype)
        logits = torch.cat([scores, sink.expand(scores.shape[0], -1, -1, -1)], dim=-1)  # [B, kv_heads, R, L + 1]
        logits = logits - logits.amax(dim=-1, keepdim=True)
        probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return torch.matmul(probs, values)
