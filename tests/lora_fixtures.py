"""PEFT LoRA adapters for the tiny checkpoints, and peft's own forward as the reference for parity tests.

make_peft_adapter writes a real PEFT adapter directory (adapter_config.json + adapter_model.safetensors)
with peft itself, so the executor is tested on exactly the files peft users produce. Test-only.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from tests.hf_reference import HfReference, rel_err  # noqa: F401  (re-exported for the LoRA tests)

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(base_dir: Path, out_dir: Path, *, r: int, alpha: float,
                      target_modules: Sequence[str] | str = ALL_MODULES, seed: int = 0, use_rslora: bool = False,
                      dtype: torch.dtype = torch.float32, model_class=AutoModelForCausalLM, **config) -> Path:
    """Builds a LoRA adapter for the checkpoint in base_dir with peft (random non-zero A and B drawn from
    torch's global RNG seeded with `seed`) and saves it to out_dir with save_pretrained. Returns out_dir.
    target_modules: names, or one regex over the modules' full names (peft's two forms; a vision-language model's
    users write a regex to keep off the vision tower's q_proj). model_class: transformers' class of the checkpoint
    (a vision-language model's *ForConditionalGeneration). config: more LoraConfig fields (rank_pattern, ...)."""
    from peft import LoraConfig, get_peft_model

    base = model_class.from_pretrained(base_dir, dtype=dtype)
    torch.manual_seed(seed)
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False,
                     use_rslora=use_rslora, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **config)
    model = get_peft_model(base, cfg)
    # init_lora_weights=False: lora_B is random like lora_A (not zero), so the adapter moves the logits of
    # the tiny models by about as much as their own spread (checked by the parity tests).
    with torch.no_grad():
        assert all(p.abs().max() > 0 for n, p in model.named_parameters() if "lora_B" in n)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    return out


def edit_adapter_config(adapter_dir: Path, **changes) -> None:
    """Rewrites keys of adapter_config.json in place (for error tests)."""
    path = Path(adapter_dir) / "adapter_config.json"
    cfg = json.loads(path.read_text(encoding="utf-8"))
    cfg.update(changes)
    path.write_text(json.dumps(cfg, indent=2), encoding="utf-8")


def edit_adapter_tensors(adapter_dir: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Loads adapter_model.safetensors, lets `edit` change the dict in place, writes it back."""
    from safetensors.torch import load_file, save_file

    path = Path(adapter_dir) / "adapter_model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})


class PeftReference:
    """peft's forward (PeftModel.from_pretrained over transformers) with transformers' KV cache."""

    def __init__(self, base_dir: Path, adapter_dir: Path, dtype: torch.dtype = torch.float32) -> None:
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
        self.model = PeftModel.from_pretrained(base, adapter_dir).eval()

    @torch.no_grad()
    def last_logits(self, token_ids: list[int]) -> torch.Tensor:
        return self.model(input_ids=torch.tensor([token_ids])).logits[0, -1].float()

    @torch.no_grad()
    def all_logits(self, token_ids: list[int]) -> torch.Tensor:
        return self.model(input_ids=torch.tensor([token_ids])).logits[0].float()

    @torch.no_grad()
    def greedy(self, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy continuation: (tokens, logits before each token), like HfReference.greedy."""
        cache = DynamicCache()
        out = self.model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        tokens, logits = [], []
        for _ in range(steps):
            row = out.logits[0, -1].float()
            logits.append(row)
            tokens.append(int(row.argmax()))
            out = self.model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                             use_cache=True)
        return tokens, logits
