"""The two MoE dispatch paths (grouped matmul and the per-expert loop) agree, including experts that get no
token, and both count routed tokens."""
from __future__ import annotations

import pytest
import torch

from models.config import ModelConfig, RopeConfig
from models.moe import SparseMoeBlock


def _block(experts: int, top_k: int) -> SparseMoeBlock:
    cfg = ModelConfig("Qwen3MoeForCausalLM", "qwen3_moe", 64, 32, 64, 1, 2, 1, 16, 1e-6, 64, False, False, True,
                      RopeConfig(), "float32", num_experts=experts, num_experts_per_tok=top_k,
                      moe_intermediate_size=24, norm_topk_prob=True)
    torch.manual_seed(0)
    block = SparseMoeBlock(cfg, 0)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    block.expert_tokens = torch.zeros(experts, dtype=torch.int64)
    return block


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm: only the loop exists")
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_grouped_and_loop_agree(tokens, monkeypatch):
    block = _block(experts=16, top_k=2)  # 1 or 3 tokens leave most experts empty
    x = torch.randn(tokens, 32)
    with torch.no_grad():
        monkeypatch.setattr(SparseMoeBlock, "grouped", True)
        grouped = block(x)
        monkeypatch.setattr(SparseMoeBlock, "grouped", False)
        loop = block(x)
    assert torch.allclose(grouped, loop, rtol=1e-5, atol=1e-6)
    assert int(block.expert_tokens.sum()) == 2 * tokens * 2  # both runs counted, k=2 each
