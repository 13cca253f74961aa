"""A tiny random Qwen2.5-VL checkpoint, written by transformers itself from its own config classes (no downloads):
the tiny trained tokenizer of scripts/make_tiny_checkpoint.py with the family's vision special tokens added, a chat
template that writes `<|vision_start|><|image_pad|><|vision_end|>` for an image part (as Qwen2.5-VL's does), and
the PIL image processor's preprocessor_config.json beside. Test-only.

Sizes: 4x4-pixel patches, 2x2 of them merged into one image token (factor 8), images resized to 8..4096 pixels
(a 50x70 image: 48x72, 12x18 patches, 6x9 = 54 image tokens); windows of 16 pixels (2x2 image tokens, so a 6x9
grid is padded into windows of unequal size); two ViT blocks, the second with full attention. The text tower is
Qwen2's with M-RoPE sections [2, 3, 3] over its 16-wide heads.
"""
from __future__ import annotations

import json
from pathlib import Path

PATCH, MERGE, TEMPORAL = 4, 2, 2
MIN_PIXELS, MAX_PIXELS = 8 * 8, 64 * 64
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{'<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_qwen2_5_vl_checkpoint(out: Path, maker, seed: int = 0) -> Path:
    """maker: scripts/make_tiny_checkpoint.py loaded as a module (its tokenizer and init)."""
    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    maker._write_tokenizer(out)
    tok = Tokenizer.from_str((out / "tokenizer.json").read_text())
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in VISION_TOKENS])
    (out / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["chat_template"] = CHAT_TEMPLATE
    maker._dump_json(cfg_path, tok_cfg)
    vocab = tok.get_vocab_size()
    padded = -(-vocab // maker.VOCAB_MULTIPLE) * maker.VOCAB_MULTIPLE
    text = maker._config_kwargs("qwen2", 2, padded, None)
    text.update(max_position_embeddings=512, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, window_size=16, out_hidden_size=64,
                  fullatt_block_indexes=[1])
    ids = {name: tok.token_to_id(t) for name, t in (("image_token_id", "<|image_pad|>"),
                                                    ("video_token_id", "<|video_pad|>"),
                                                    ("vision_start_token_id", "<|vision_start|>"),
                                                    ("vision_end_token_id", "<|vision_end|>"))}
    config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    maker._reinit_(model, seed, 0.1)
    model.save_pretrained(out, safe_serialization=True)
    transformers.GenerationConfig(bos_token_id=maker.BOS_ID, eos_token_id=maker.EOS_ID,
                                  pad_token_id=maker.PAD_ID).save_pretrained(out)
    image_processor_class()(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH, merge_size=MERGE,
                            temporal_patch_size=TEMPORAL).save_pretrained(out)
    return out


def image_processor_class():
    """transformers' PIL/numpy image processor of the family (the default 'fast' one needs torchvision)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil


def qwen_vl_checkpoint(tmp_path_factory) -> Path:
    """The tiny checkpoint, built once per run (tests/conftest.py's built_once)."""
    from tests.conftest import built_once, load_script
    maker = load_script("make_tiny_checkpoint")
    return built_once(tmp_path_factory, "tiny-qwen2_5_vl", "Qwen2_5_VL",
                      lambda out: make_qwen2_5_vl_checkpoint(out, maker))
