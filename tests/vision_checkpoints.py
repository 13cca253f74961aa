"""A tiny random Idefics3 (SmolVLM's architecture) checkpoint, written by transformers itself from its own config
classes (no downloads): the tiny trained tokenizer of scripts/make_tiny_checkpoint.py with the family's image
special tokens added, a chat template that writes `<image>` for an image part (as SmolVLM's does), and the PIL
image processor's preprocessor_config.json beside. Test-only.

Sizes: 32x32 tiles of 8x8 patches (16 patches), pixel shuffle 2 -> 4 image tokens per tile; images are resized to
a longest edge of 64 and split into up to 2x2 tiles + the global one (5 tiles, 20 image tokens).
"""
from __future__ import annotations

import json
from pathlib import Path

TILE = 32  # vision_config.image_size = max_image_size.longest_edge
PATCH = 8
LONGEST_EDGE = 64  # size.longest_edge: images are resized to this first
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"] + [
    f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{'<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_idefics3_checkpoint(out: Path, maker, seed: int = 0, architecture: str = "Idefics3") -> Path:
    """maker: scripts/make_tiny_checkpoint.py loaded as a module (its tokenizer and init)."""
    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    maker._write_tokenizer(out)
    tok = Tokenizer.from_str((out / "tokenizer.json").read_text())
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in IMAGE_TOKENS])
    (out / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["chat_template"] = CHAT_TEMPLATE
    maker._dump_json(cfg_path, tok_cfg)
    vocab = tok.get_vocab_size()
    padded = -(-vocab // maker.VOCAB_MULTIPLE) * maker.VOCAB_MULTIPLE
    text = maker._config_kwargs("llama", 2, padded, None)
    text["tie_word_embeddings"] = False
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  image_size=TILE, patch_size=PATCH, layer_norm_eps=1e-6)
    cfg_cls = getattr(transformers, f"{architecture}Config")
    config = cfg_cls(text_config=text, vision_config=vision, scale_factor=2,
                     image_token_id=tok.token_to_id("<image>"), tie_word_embeddings=False)
    config.architectures = [f"{architecture}ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = getattr(transformers, f"{architecture}ForConditionalGeneration")(config).eval()
    maker._reinit_(model, seed, 0.1)
    model.save_pretrained(out, safe_serialization=True)
    transformers.GenerationConfig(bos_token_id=maker.BOS_ID, eos_token_id=maker.EOS_ID,
                                  pad_token_id=maker.PAD_ID).save_pretrained(out)
    processor = image_processor_class(architecture)(
        size={"longest_edge": LONGEST_EDGE}, max_image_size={"longest_edge": TILE}, do_image_splitting=True)
    processor.save_pretrained(out)
    return out


def image_processor_class(architecture: str = "Idefics3"):
    """transformers' PIL/numpy image processor of the family (the default 'fast' one needs torchvision)."""
    if architecture == "SmolVLM":
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil
        return SmolVLMImageProcessorPil
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    return Idefics3ImageProcessorPil


def vision_checkpoint(tmp_path_factory, architecture: str = "Idefics3") -> Path:
    """The tiny checkpoint of a vision family, built once per run (tests/conftest.py's built_once)."""
    from tests.conftest import built_once, load_script
    maker = load_script("make_tiny_checkpoint")
    return built_once(tmp_path_factory, f"tiny-{architecture.lower()}", architecture,
                      lambda out: make_idefics3_checkpoint(out, maker, architecture=architecture))


def noise_image(width: int, height: int, seed: int = 0, mode: str = "RGB"):
    """A random image (PIL) of that size: noise, so that every pixel matters."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    data = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(data[..., 0] if channels == 1 else data, mode)


def png_bytes(image) -> bytes:
    import io
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


# -- Gemma 3 (Gemma3ForConditionalGeneration): SigLIP 32x32 of 8x8 patches (16), avg-pooled to 4 tokens --
GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
GEMMA3_MM_TOKENS = 4  # mm_tokens_per_image: the 4x4 patch grid pooled 2x2
GEMMA3_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("'<image>'", "'<start_of_image>'")  # as Gemma 3's own template writes


def make_gemma3_checkpoint(out: Path, maker, seed: int = 0) -> Path:
    """Two text layers (one sliding over 8 tokens, one global) behind the vision tower; the image processor
    resizes to 32x32 (no pan-and-scan, its default)."""
    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    out.mkdir(parents=True, exist_ok=True)
    maker._write_tokenizer(out)
    tok = Tokenizer.from_str((out / "tokenizer.json").read_text())
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in GEMMA3_TOKENS.values()])
    (out / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg.update(chat_template=GEMMA3_CHAT_TEMPLATE, extra_special_tokens=GEMMA3_TOKENS)
    maker._dump_json(cfg_path, tok_cfg)
    vocab = -(-tok.get_vocab_size() // maker.VOCAB_MULTIPLE) * maker.VOCAB_MULTIPLE
    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
                query_pre_attn_scalar=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                bos_token_id=maker.BOS_ID, eos_token_id=maker.EOS_ID, pad_token_id=maker.PAD_ID)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=TILE,
                  patch_size=PATCH, layer_norm_eps=1e-6, vision_use_head=False)
    ids = {k: tok.token_to_id(v) for k, v in GEMMA3_TOKENS.items()}
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=GEMMA3_MM_TOKENS,
                                       boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
                                       image_token_index=ids["image_token"])
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    maker._reinit_(model, seed, 0.1)
    model.save_pretrained(out, safe_serialization=True)
    transformers.GenerationConfig(bos_token_id=maker.BOS_ID, eos_token_id=maker.EOS_ID,
                                  pad_token_id=maker.PAD_ID).save_pretrained(out)
    Gemma3ImageProcessorPil(size={"height": TILE, "width": TILE}).save_pretrained(out)
    return out


def gemma3_checkpoint(tmp_path_factory) -> Path:
    from tests.conftest import built_once, load_script
    maker = load_script("make_tiny_checkpoint")
    return built_once(tmp_path_factory, "tiny-gemma3-vision", "gemma3",
                      lambda out: make_gemma3_checkpoint(out, maker))
