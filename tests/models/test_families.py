"""the families at the config and checkpoint level: what each config.json becomes, the fields the code
does not implement refused by name, the native decode step's refusal facts, and GPT-OSS's MXFP4 experts
dequantized at load (on a checkpoint this test quantizes itself)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.config import ModelConfig
from models.loader import load_model
from models.quant.mxfp4 import FP4_VALUES, dequantize_mxfp4, quantize_mxfp4
from tandem.errors import CheckpointError
from tests.executor_driver import greedy_run, make_executor
from tests.device_tolerances import greedy_agreement
from tests.hf_reference import HfReference, rel_err
from tests.models.family_checkpoints import FAMILIES, config_of


def parsed(family_checkpoint, family: str, **changes) -> ModelConfig:
    raw = config_of(family_checkpoint(family))
    raw.update(changes)
    return ModelConfig.from_hf(raw)


def test_what_each_family_reads(family_checkpoint):
    mistral = parsed(family_checkpoint, "mistral")
    assert mistral.kv_window == 24 and mistral.window_of(1) == 24
    gemma2 = parsed(family_checkpoint, "gemma2")
    assert (gemma2.layout, gemma2.norm_offset) == ("sandwich", True)
    assert (gemma2.attn_softcap, gemma2.final_softcap) == (3.0, 4.0)
    assert gemma2.window_of(0) == 24 and gemma2.window_of(1) is None and gemma2.kv_window is None
    assert gemma2.embed_scale == 8.0 and gemma2.attn_scale == pytest.approx(24 ** -0.5)
    gemma3 = parsed(family_checkpoint, "gemma3")
    assert gemma3.rope_of(0).theta == 10_000.0 and gemma3.rope_of(2).kind == "linear" and gemma3.qk_norm
    assert parsed(family_checkpoint, "smollm3").rope_layers == (True, False)
    olmo2 = parsed(family_checkpoint, "olmo2")
    assert olmo2.layout == "post" and olmo2.qk_norm_whole
    granite = parsed(family_checkpoint, "granite")
    assert (granite.embed_scale, granite.residual_scale, granite.logits_divisor) == (3.0, 0.6, 2.5)
    oss = parsed(family_checkpoint, "gpt_oss")
    assert oss.moe_style == "gpt_oss" and oss.attention_sinks and oss.o_bias and oss.num_experts == 4
    assert parsed(family_checkpoint, "mixtral").norm_topk_prob
    assert parsed(family_checkpoint, "phi3").rope.kind == "longrope"


def test_sliding_window_wider_than_the_model_slides_nothing(family_checkpoint):
    cfg = parsed(family_checkpoint, "mistral", sliding_window=4096)
    assert cfg.sliding_window is None and cfg.native_decode_refusal is None


@pytest.mark.parametrize("family,changes,field", [
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("olmo2", {"clip_qkv": 8.0}, "clip_qkv"),
    ("mistral", {"hidden_act": "relu"}, "hidden_act"),
    ("gemma2", {"hidden_activation": "gelu_new"}, "hidden_act"),
    ("mistral", {"quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config"),
    ("mistral", {"quantization_config": {"quant_method": "gptq", "desc_act": True}}, "desc_act"),
    ("gpt_oss", {"quantization_config": {"quant_method": "fp8"}}, "quant_method"),
    ("gemma2", {"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
    ("smollm3", {"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window"),
    ("smollm3", {"no_rope_layers": [1]}, "no_rope_layers"),
    ("mixtral", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
])
def test_unsupported_fields_are_named(family_checkpoint, family, changes, field):
    with pytest.raises(CheckpointError, match=field):
        parsed(family_checkpoint, family, **changes)


def test_unsupported_rope_type_is_named(family_checkpoint, tmp_path):
    d = shutil.copytree(family_checkpoint("phi3"), tmp_path / "m")
    raw = config_of(d)
    raw["rope_parameters"]["rope_type"] = "mrope"
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="mrope"):
        load_model(d, progress=False)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_native_refusal_names_what_the_native_step_lacks(family_checkpoint, family):
    """The native C++ step runs the Llama layout only; each tiny family here differs from it somewhere, except
    Phi-3 with plain rope (fused projections are a loading matter)."""
    reason = parsed(family_checkpoint, family).native_decode_refusal
    assert (reason is None) == (family == "phi3_plain"), reason


def test_partial_rotary_matches_transformers(family_checkpoint, device):
    """Phi-4-mini's partial_rotary_factor: the first half of each head rotates, the rest passes."""
    model_dir = family_checkpoint("phi3_plain", rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                                                                 "partial_rotary_factor": 0.5})
    assert ModelConfig.from_dir(model_dir).native_decode_refusal == "partial rotary embeddings"
    prompt = [5, 17, 33, 80, 120, 7, 9, 250, 31, 44, 3, 99]
    ref_tokens, ref_logits = HfReference(model_dir).greedy(prompt, 6)
    _, tokens, logits = greedy_run(make_executor(model_dir, device=device), prompt, 6)
    greedy_agreement(tokens, logits, ref_tokens, ref_logits, device.dtype, "partial rotary")


def test_mxfp4_round_trip_and_layout():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (3, 5, 64), generator=g)
    exps = torch.randint(-3, 4, (3, 5, 2), generator=g).repeat_interleave(32, dim=-1)
    values = torch.tensor(FP4_VALUES)[codes] * torch.exp2(exps.float())  # on the grid of each group's scale
    blocks, scales = quantize_mxfp4(values)
    assert blocks.shape == (3, 5, 2, 16) and scales.shape == (3, 5, 2)
    assert torch.equal(dequantize_mxfp4(blocks, scales), values)  # grid values x powers of two: exact
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    hf = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, 64, 5]: transposed for x @ W
    assert torch.equal(hf.transpose(1, 2), dequantize_mxfp4(blocks, scales))


def test_gpt_oss_mxfp4_experts_are_dequantized_at_load(family_checkpoint, tmp_path):
    """The float checkpoint's experts quantized to MXFP4 (as released GPT-OSS checkpoints store them): the
    executor loads it and equals transformers on the same, dequantized, weights."""
    src = family_checkpoint("gpt_oss")
    ref_dir = shutil.copytree(src, tmp_path / "ref")
    q_dir = shutil.copytree(src, tmp_path / "mxfp4")
    tensors = load_file(src / "model.safetensors")
    dequantized, packed = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors[name].transpose(1, 2))  # [E, out, in]
        packed.pop(name)
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        dequantized[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
        assert rel_err(dequantized[name], tensors[name]) < 0.25  # it is 4-bit
    save_file({k: v.contiguous() for k, v in dequantized.items()}, ref_dir / "model.safetensors",
              metadata={"format": "pt"})
    save_file({k: v.contiguous() for k, v in packed.items()}, q_dir / "model.safetensors", metadata={"format": "pt"})
    raw = config_of(q_dir)
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (q_dir / "config.json").write_text(json.dumps(raw))
    prompt = [5, 17, 33, 80, 120, 7, 9, 250, 31, 44]
    ref_tokens, ref_logits = HfReference(ref_dir).greedy(prompt, 8)
    _, tokens, logits = greedy_run(make_executor(q_dir), prompt, 8)
    assert tokens == ref_tokens
    assert max(rel_err(o, r) for o, r in zip(logits, ref_logits)) < 1e-4
