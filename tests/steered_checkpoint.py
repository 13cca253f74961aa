"""A tiny Qwen3 checkpoint whose greedy output is chosen by the test: every layer's output projections are
zero, so the last hidden state is the (normed) embedding of the current token, and the LM head maps chosen
tokens to chosen successors (a bigram chain, logit SCALE for the successor, ~0 for the rest). Its tokenizer has
<think> and </think> as added tokens (not special, as Qwen3's), and its chat template is Qwen3's shape with the
enable_thinking switch. The executor loads it like any checkpoint; only the outputs are steered.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer

SCALE = 40.0
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
            "enable_thinking is false %}<think>\n\n</think>{% endif %}{% endif %}")  # (closed: the answer follows)


def steer(source: Path, out: Path, chains: list[list[str]]) -> dict[str, int]:
    """Copies the checkpoint at source to out with the tokenizer, template and weights above; each chain is a
    list of token texts, each followed by the next (the last by EOS). Returns the ids of the texts."""
    shutil.copytree(source, out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                    AddedToken("</think>", special=False, normalized=False)])
    tok.save(str(out / "tokenizer.json"))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    ids: dict[str, int] = {}
    for chain in chains:
        for text in chain:
            encoded = tok.encode(text, add_special_tokens=False).ids
            assert len(encoded) == 1, f"{text!r} is not one token: {encoded}"
            ids[text] = encoded[0]
    config = json.loads((out / "config.json").read_text())
    eos = config["eos_token_id"] if isinstance(config["eos_token_id"], int) else config["eos_token_id"][0]
    weights_path = next(out.glob("*.safetensors"))
    w = load_file(str(weights_path))
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = torch.zeros_like(w[name])
    emb = w["model.embed_tokens.weight"].float()
    hidden = emb * torch.rsqrt(emb.pow(2).mean(-1, keepdim=True) + config["rms_norm_eps"])
    hidden = hidden * w["model.norm.weight"].float()
    head = torch.zeros_like(w["lm_head.weight"], dtype=torch.float32)
    for chain in chains:
        for a, b in zip(chain, chain[1:] + [None]):
            h = hidden[ids[a]]
            head[eos if b is None else ids[b]] += SCALE * h / h.pow(2).sum()
    w["lm_head.weight"] = head.to(w["lm_head.weight"].dtype)
    save_file(w, str(weights_path), metadata={"format": "pt"})
    return ids
