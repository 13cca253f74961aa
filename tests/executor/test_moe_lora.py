"""LoRA on a Qwen3-MoE model: attention adapters match peft; LoRA on expert layers is refused with a clear
INVALID_ARGUMENT."""
from __future__ import annotations

import pytest

from tandem.status_map import status_for
from tandem.errors import InvalidRequest
from tests.executor_driver import greedy_run, make_executor
from tests.lora_fixtures import PeftReference, make_peft_adapter, rel_err

PROMPT = [1, 5, 9, 33, 44, 100, 7]


@pytest.fixture(scope="module")
def moe(tiny_checkpoint):
    # layer 0 dense (mlp_only_layers), layer 1 MoE
    return tiny_checkpoint("qwen3_moe", config_overrides={"mlp_only_layers": [0]})


def test_attention_lora_matches_peft(moe, tmp_path):
    adapter = make_peft_adapter(moe, tmp_path / "a", r=8, alpha=16, seed=3,
                                target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    ex = make_executor(moe, adapter_root=tmp_path)
    ex.load_adapter("a", "a")
    _, tokens, logits = greedy_run(ex, PROMPT, 12, adapter="a")
    ref_tokens, ref_logits = PeftReference(moe, adapter).greedy(PROMPT, 12)
    assert tokens == ref_tokens
    assert max(rel_err(a, b) for a, b in zip(logits, ref_logits)) < 1e-4
    _, base_tokens, _ = greedy_run(ex, PROMPT, 12)
    assert base_tokens != tokens  # the adapter is really applied


def test_lora_on_expert_layers_is_refused(moe, tmp_path):
    # peft adapts layer 0's dense MLP and layer 1's (fused) experts: the experts part is refused
    make_peft_adapter(moe, tmp_path / "e", r=4, alpha=8, seed=4, target_modules=("gate_proj", "up_proj", "down_proj"))
    ex = make_executor(moe, adapter_root=tmp_path)
    with pytest.raises(InvalidRequest, match="mixture-of-experts") as err:
        ex.load_adapter("e", "e")
    assert status_for(err.value).name == "INVALID_ARGUMENT"
    assert ex.list_adapters() == []
