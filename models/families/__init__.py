"""The architectures Tandem serves, one file per family: config.json -> ModelConfig, checkpoint names."""
# Each family reads its config.json into ModelConfig's fields (what it shares with the Llama layout comes from
# base.py; the file states only what differs) and, where its checkpoint names differ from the Llama layout, maps
# them (models/loader.py asks `checkpoint_tensor`). FAMILIES: architecture name -> parse(raw config,
# architecture, source file) -> ModelConfig keyword arguments.
from __future__ import annotations

from typing import Any, Callable

from models.families import (base, classifier, gemma2, gemma3, gemma3_vision, gpt_oss, granite, idefics3, mistral,
                             mixtral, olmo2, phi3, qwen2_5_vl, smollm3)

Parse = Callable[[dict[str, Any], str, str], dict[str, Any]]

FAMILIES: dict[str, Parse] = {
    "LlamaForCausalLM": base.parse,
    "Qwen2ForCausalLM": base.parse,
    "Qwen3ForCausalLM": base.parse,
    "Qwen3MoeForCausalLM": base.parse,
    "MistralForCausalLM": mistral.parse,
    "MixtralForCausalLM": mixtral.parse,
    "Gemma2ForCausalLM": gemma2.parse,
    "Gemma3ForCausalLM": gemma3.parse,
    "Phi3ForCausalLM": phi3.parse,
    "GraniteForCausalLM": granite.parse,
    "Olmo2ForCausalLM": olmo2.parse,
    "SmolLM3ForCausalLM": smollm3.parse,
    "GptOssForCausalLM": gpt_oss.parse,
    # sequence classifiers: the causal family's decoder + a `score` head (models/families/classifier.py)
    **{arch: classifier.parse for arch in classifier.CAUSAL_OF},
    # vision-language: a vision tower + a text tower (models/vision/): Llama's, Gemma 3's
    **{arch: idefics3.parse for arch in idefics3.ARCHITECTURES},
    **{arch: gemma3_vision.parse for arch in gemma3_vision.ARCHITECTURES},
    # vision-language: a window-attention ViT + Qwen2's text tower with M-RoPE (models/families/qwen2_5_vl.py)
    **{arch: qwen2_5_vl.parse for arch in qwen2_5_vl.ARCHITECTURES},
}

# Families whose checkpoint names differ from ours: architecture -> checkpoint_tensor(name, shape, read, cfg)
# returning our parameter `name` built from the checkpoint (read(hf_name) -> tensor), or None for the
# default mapping (models/loader.py).
CHECKPOINT_LAYOUTS = {
    "MixtralForCausalLM": mixtral.checkpoint_tensor,
    "Phi3ForCausalLM": phi3.checkpoint_tensor,
    "GptOssForCausalLM": gpt_oss.checkpoint_tensor,
}
