"""PEFT LoRA adapters on the dense families, parity with peft's own forward (as tests/executor/
test_lora_parity.py does for Llama/Qwen): a base sequence and an adapted one in the same steps, chunked
prefill then decode. Phi-3's adapters target its fused qkv_proj and gate_up_proj (models/lora/weights.py)."""
from __future__ import annotations

import random

import pytest

from tests.executor_driver import make_executor, mixed_batch_run
from tests.lora_fixtures import ALL_MODULES, HfReference, PeftReference, make_peft_adapter, rel_err

TOL = 1e-4
STEPS = 8
DENSE = ("mistral", "gemma2", "gemma3", "phi3", "granite", "olmo2", "smollm3")
PHI3_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def prompt_of(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(length)]


@pytest.mark.parametrize("family", DENSE)
def test_adapter_beside_the_base_model_matches_peft(family, family_checkpoint, tmp_path):
    base = family_checkpoint(family)
    modules = PHI3_MODULES if family == "phi3" else ALL_MODULES
    adapter = make_peft_adapter(base, tmp_path / "a", r=8, alpha=16, target_modules=modules, seed=1)
    ex = make_executor(base, adapter_root=tmp_path, adapters=(("a", adapter),))
    prompts = [prompt_of(30, seed=1), prompt_of(30, seed=1)]
    gen, logits = mixed_batch_run(ex, prompts, STEPS, chunk=7, adapters=["", "a"])
    for i, ref in enumerate((HfReference(base), PeftReference(base, adapter))):
        ref_tokens, ref_logits = ref.greedy(prompts[i], STEPS)
        assert gen[i] == ref_tokens, (family, i)
        assert max(rel_err(o, r) for o, r in zip(logits[i], ref_logits)) < TOL, (family, i)
    assert gen[0] != gen[1] or logits[0][0].ne(logits[1][0]).any()  # the adapter changes something
