"""Reference runs with Hugging Face transformers (its own forward and KV cache) for parity tests."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|: the issue's relative-error measure."""
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


class HfReference:
    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()

    @torch.no_grad()
    def last_logits(self, token_ids: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([token_ids])).logits[0, -1].float()

    @torch.no_grad()
    def all_logits(self, token_ids: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([token_ids])).logits[0].float()

    @torch.no_grad()
    def greedy(self, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy continuation with transformers' KV cache: (tokens, logits before each token)."""
        cache = DynamicCache()
        out = self.model(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        tokens, logits = [], []
        for _ in range(steps):
            row = out.logits[0, -1].float()
            logits.append(row)
            tokens.append(int(row.argmax()))
            out = self.model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
        return tokens, logits
