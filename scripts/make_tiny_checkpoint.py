#!/usr/bin/env python
"""Builds a tiny, random, deterministic Hugging Face checkpoint (config + safetensors + tokenizer).

Tests compare Tandem's model implementation against transformers loaded from the same directory, so
the directory uses the standard HF layout and is written by transformers itself (save_pretrained).
No network access: the tokenizer is trained here on a built-in corpus.

    python scripts/make_tiny_checkpoint.py qwen3 /tmp/tiny-qwen3 --seed 1 --rope-scaling yarn

Test/preparation only (needs transformers + tokenizers); never imported by the servers.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

ARCHS: dict[str, tuple[str, str]] = {  # arch -> (config class, architectures[0])
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}

# transformers >= 5 spells RoPE settings as `rope_parameters` (rope_type + rope_theta + scaling keys);
# the old top-level `rope_scaling` / `rope_theta` keys are only accepted on load for compatibility.
ROPE_SCALINGS: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}
ROPE_THETA = 10000.0

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 (pad, bos, eos)
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                     r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")  # Qwen2's
TOKENIZER_VOCAB_TARGET = 400  # ~141 merges; padded to 448 so ids 400..447 have no token
VOCAB_MULTIPLE = 64
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Init scales. HF's default init (std 0.02, unit norms, zero biases) yields near-flat logits whose
# argmax flips on 1e-6 noise and hides bias/norm bugs. With hidden 64, std 0.2 gives each projection
# output ~0.2*sqrt(fan_in) ~ 1.6 per unit-RMS input, i.e. logit std ~1.5-3 across the vocab, clear
# top-1/top-2 gaps, and router logits spread enough that tokens choose different experts.
WEIGHT_STD = 0.2
BIAS_STD = 0.1
NORM_JITTER = 0.5  # norm weights ~ 1 + U(-0.5, 0.5)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A serving stack reads a prompt, splits it into tokens,
and runs the model one step at a time until it reaches the end of the answer or a length limit.
Each step produces a score for every token in the vocabulary, and the sampler picks the next one.

Once upon a time there was a small town by the sea. In the morning the fishermen went out with
their boats, and in the evening they came back with baskets full of silver fish. The children ran
along the beach, the old men talked about the weather, and the baker sold warm bread to everyone.

Hello! How are you today? I am fine, thank you. What would you like to know about the weather,
the history of the town, or the best way to cook a fish? Please ask me anything, and I will try to
answer in a short and helpful way. Numbers such as 0, 1, 2, 3, 42, 100 and 2024 also appear here.

Cache memory is shared between requests. When a new request arrives, the scheduler checks whether
there is enough room for its prompt; if there is not, it waits in the queue until another request
finishes and frees its blocks. Long prompts are split into chunks so that short requests still run.

def add(a, b):
    return a + b

for i in range(10):
    print("step", i, add(i, i))
"""


@functools.lru_cache(maxsize=1)
def _train_tokenizer_json() -> str:
    """Trains the byte-level BPE once per process (it does not depend on the seed)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers

    tok = Tokenizer(models.BPE())
    # Qwen2-style pipeline (NFC + split regex + ByteLevel without its own regex), as in released Qwen
    # tokenizer.json files. It must be this one: for model_type "qwen2", transformers 5's AutoTokenizer
    # ignores tokenizer_class and rebuilds Qwen2Tokenizer with exactly this pipeline around our
    # vocab/merges; any other pre-tokenizer would make HF's ids differ from tokenizer.json's.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_TARGET,
        min_frequency=1,  # tiny corpus: allow rare merges so the vocab target is actually reached
        special_tokens=SPECIAL_TOKENS,  # listed first -> ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: any text encodes
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, f"special token {t} not at id {i}"
    return tok.to_str()


def _write_tokenizer(out: Path) -> int:
    """Writes tokenizer.json + configs; returns the tokenizer's vocab size."""
    tok_json = _train_tokenizer_json()
    (out / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    vocab_size = len(json.loads(tok_json)["model"]["vocab"])
    special = {"bos_token": SPECIAL_TOKENS[BOS_ID], "eos_token": SPECIAL_TOKENS[EOS_ID],
               "pad_token": SPECIAL_TOKENS[PAD_ID], "unk_token": SPECIAL_TOKENS[PAD_ID]}
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "add_bos_token": False,
               "add_eos_token": False, "clean_up_tokenization_spaces": False, "model_max_length": 256,
               "chat_template": CHAT_TEMPLATE}
    _dump_json(out / "tokenizer_config.json", tok_cfg)
    _dump_json(out / "special_tokens_map.json", special)
    return vocab_size


def _dump_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _config_kwargs(arch: str, num_layers: int, vocab_size: int, rope_scaling: str | None) -> dict[str, Any]:
    rope = {"rope_type": "default"} if rope_scaling is None else dict(ROPE_SCALINGS[rope_scaling])
    rope["rope_theta"] = ROPE_THETA
    kw: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2,  # GQA: 2 query heads per KV head
        max_position_embeddings=256, rms_norm_eps=1e-6, rope_parameters=rope, hidden_act="silu",
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        tie_word_embeddings=arch == "llama",  # one tied and several untied archs: both paths tested
    )
    if arch == "qwen2":
        kw["use_sliding_window"] = False  # q/k/v bias is hard-wired on in Qwen2Attention
    if arch in ("qwen3", "qwen3_moe"):
        kw["head_dim"] = 32  # != hidden/heads (16): exercises q_norm/k_norm and the explicit head_dim path
    if arch == "qwen3_moe":
        kw.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                  decoder_sparse_step=1, mlp_only_layers=[])
    return kw


def _reinit_(model: Any, seed: int, std: float) -> None:
    """Re-initialises every parameter from a generator seeded with `seed` (order = named_parameters,
    which is deterministic and lists tied weights once)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                new = torch.randn(p.shape, generator=g) * BIAS_STD
            elif p.ndim == 1:  # RMSNorm weights (input/post-attention/final/q_norm/k_norm)
                new = 1.0 + (torch.rand(p.shape, generator=g) - 0.5) * (2 * NORM_JITTER)
            else:  # linear, embedding, router (mlp.gate) and packed 3-D expert weights
                new = torch.randn(p.shape, generator=g) * std
            p.copy_(new.to(p.dtype))


def make_tiny_checkpoint(arch: str, out_dir: str | Path, *, seed: int = 0, num_layers: int = 2,
                         rope_scaling: str | None = None, dtype: str = "float32",
                         config_overrides: dict | None = None) -> Path:
    """Writes a tiny random HF checkpoint for `arch` into `out_dir` and returns the directory."""
    import torch
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(ARCHS)}")
    if rope_scaling is not None and rope_scaling not in ROPE_SCALINGS:
        raise ValueError(f"unknown rope scaling {rope_scaling!r}; expected one of {sorted(ROPE_SCALINGS)}")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok_vocab = _write_tokenizer(out)
    # Real models pad the embedding table; the padded ids have no token, which tests should survive.
    vocab_size = -(-tok_vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    kwargs = _config_kwargs(arch, num_layers, vocab_size, rope_scaling)
    kwargs.update(config_overrides or {})  # applied last: any key wins
    cfg_cls_name, arch_name = ARCHS[arch]
    config = getattr(transformers, cfg_cls_name)(**kwargs)
    config.architectures = [arch_name]
    if config.vocab_size < tok_vocab:
        raise ValueError(f"vocab_size {config.vocab_size} < tokenizer vocab {tok_vocab}")

    torch.manual_seed(seed)  # construction draws from the global RNG; _reinit_ overwrites all of it anyway
    model = getattr(transformers, arch_name)(config).eval()
    _reinit_(model, seed, WEIGHT_STD)
    model = model.to(torch_dtype)  # init in fp32 then round: a bf16 checkpoint = rounded fp32 one
    model.config.dtype = torch_dtype
    model.save_pretrained(out, safe_serialization=True)
    gen = transformers.GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    gen.save_pretrained(out)

    if arch == "qwen3_moe":
        # transformers 5 writes the expert count under its internal name `num_local_experts`; released
        # Qwen3-MoE checkpoints use `num_experts`. Mirror it so the file looks like a real one (both
        # keys are accepted by transformers and agree).
        cfg_path = out / "config.json"
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        cfg["num_experts"] = cfg.get("num_local_experts", config.num_experts)
        _dump_json(cfg_path, cfg)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("arch", choices=sorted(ARCHS))
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rope-scaling", choices=sorted(ROPE_SCALINGS), default=None)
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    args = ap.parse_args(argv)
    out = make_tiny_checkpoint(args.arch, args.out_dir, seed=args.seed, num_layers=args.layers,
                               rope_scaling=args.rope_scaling, dtype=args.dtype)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
