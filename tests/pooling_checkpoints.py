"""Tiny random checkpoints for embeddings and scoring, written by transformers itself (as scripts/
make_tiny_checkpoint.py writes the causal ones): a sentence-transformers folder (modules.json + 1_Pooling/
config.json with mean pooling + 2_Normalize) over a tiny Qwen3, a Qwen3-Reranker-style yes/no scorer (a tiny
Qwen3 whose directory name says "Reranker" and whose vocabulary has the token "yes"), and a
`*ForSequenceClassification` checkpoint with a `score` head. The last-token embedder is a plain tiny Qwen3
(no modules.json: last token, as Qwen3-Embedding)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.conftest import load_script

ST_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
]
MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")


def write_sentence_transformers(model_dir: Path, mode: str, hidden: int) -> None:
    """modules.json, 1_Pooling/config.json (pooling_mode_<mode> on), 2_Normalize/ and the ST configs."""
    (model_dir / "modules.json").write_text(json.dumps(ST_MODULES, indent=2))
    (model_dir / "1_Pooling").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": hidden, **{f"pooling_mode_{m}": m == mode for m in MODES},
               "include_prompt": True}
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    (model_dir / "2_Normalize").mkdir(exist_ok=True)
    (model_dir / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": False}))
    (model_dir / "config_sentence_transformers.json").write_text(json.dumps(
        {"__version__": {"sentence_transformers": "6.2.0"}, "prompts": {}, "default_prompt_name": None,
         "similarity_fn_name": "cosine"}))


def make_mean_embedder(out: Path) -> Path:
    """A tiny Qwen3 as a sentence-transformers model with mean pooling, normalised, trained (it says) for
    Matryoshka dimensions 16 and 32."""
    maker = load_script("make_tiny_checkpoint")
    maker.make_tiny_checkpoint("qwen3", out, seed=3, config_overrides={"matryoshka_dimensions": [16, 32]})
    write_sentence_transformers(out, "mean_tokens", 64)
    return out


def make_reranker(out: Path) -> Path:
    """A tiny Qwen3 named like Qwen3-Reranker (the scheduler's auto rerank mode reads the name), with "yes"
    given the unused id 400 (the tiny tokenizer's training text has "no" but not "yes" as a token)."""
    maker = load_script("make_tiny_checkpoint")
    model_dir = out / "tiny-Qwen3-Reranker"
    maker.make_tiny_checkpoint("qwen3", model_dir, seed=5)
    path = model_dir / "tokenizer.json"
    tok = json.loads(path.read_text())
    assert "yes" not in tok["model"]["vocab"]
    tok["model"]["vocab"]["yes"] = len(tok["model"]["vocab"])
    path.write_text(json.dumps(tok, ensure_ascii=False))
    return model_dir


def make_classifier(out: Path, arch: str = "qwen2", num_labels: int = 1) -> Path:
    """A tiny Qwen2ForSequenceClassification / LlamaForSequenceClassification (random `score` head)."""
    import torch
    import transformers

    maker = load_script("make_tiny_checkpoint")
    maker.make_tiny_checkpoint(arch, out, seed=7)  # tokenizer, generation config, and the decoder's config
    config_cls, causal = maker.ARCHS[arch]
    raw = json.loads((out / "config.json").read_text())
    for name in ("model.safetensors", "config.json"):
        (out / name).unlink()
    config = getattr(transformers, config_cls).from_dict({**raw, "num_labels": num_labels})
    head = causal.replace("ForCausalLM", "ForSequenceClassification")
    config.architectures = [head]
    torch.manual_seed(7)
    model = getattr(transformers, head)(config).eval()
    maker._reinit_(model, 7, maker.WEIGHT_STD)
    model.save_pretrained(out, safe_serialization=True)
    return out


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
