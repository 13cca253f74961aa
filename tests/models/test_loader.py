"""Loading HF directories: rope scaling kinds, shards, dtypes, and clear errors for bad checkpoints."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tandem.errors import CheckpointError
from models.loader import load_model
from tests.executor_driver import greedy_run, make_executor
from tests.hf_reference import HfReference, rel_err
from tests.executor.test_executor_parity import prompt_of


@pytest.mark.parametrize("kind", ["linear", "llama3", "dynamic", "yarn"])
def test_rope_scaling_matches_transformers(tiny_checkpoint, kind):
    model_dir = tiny_checkpoint("llama", rope_scaling=kind)
    hf = HfReference(model_dir)
    prompt = prompt_of(90, seed=7)  # past the 64-token original length the llama3/yarn settings use
    ref_tokens, ref_logits = hf.greedy(prompt, 8)
    _, tokens, logits = greedy_run(make_executor(model_dir), prompt, 8)
    assert tokens == ref_tokens
    assert max(rel_err(o, r) for o, r in zip(logits, ref_logits)) < 1e-4


def test_sharded_checkpoint(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("qwen2")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, tmp_path / name)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    prompt = prompt_of(12, seed=8)
    hf = HfReference(tmp_path)
    _, tokens, logits = greedy_run(make_executor(tmp_path), prompt, 4)
    ref_tokens, ref_logits = hf.greedy(prompt, 4)
    assert tokens == ref_tokens and rel_err(logits[0], ref_logits[0]) < 1e-4


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_transformers(tiny_checkpoint, dtype):
    model_dir = tiny_checkpoint("qwen3")
    torch_dtype = getattr(torch, dtype)
    ex = make_executor(model_dir, dtype=dtype)
    assert ex.info().dtype == dtype and ex.kv.k.dtype == torch_dtype
    prompt = prompt_of(16, seed=9)
    _, _, logits = greedy_run(ex, prompt, 2)
    ref = HfReference(model_dir, dtype=torch_dtype).last_logits(prompt)
    assert rel_err(logits[0], ref) < 3e-2  # half-precision rounding, not a parity claim


def copy_dir(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture(tiny_checkpoint, tmp_path):
    d = copy_dir(tiny_checkpoint("llama"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config.json.*MambaForCausalLM.*LlamaForCausalLM"):
        load_model(d, progress=False)


def test_missing_tensor_names_file_and_tensor(tiny_checkpoint, tmp_path):
    d = copy_dir(tiny_checkpoint("qwen2"), tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model.safetensors.*model.layers.1.self_attn.k_proj.bias"):
        load_model(d, progress=False)


def test_wrong_shape_is_reported(tiny_checkpoint, tmp_path):
    d = copy_dir(tiny_checkpoint("llama"), tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(7)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model.norm.weight.*\(7,\)"):
        load_model(d, progress=False)


def test_no_weights_file(tiny_checkpoint, tmp_path):
    d = copy_dir(tiny_checkpoint("llama"), tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(d, progress=False)


def test_weights_are_not_held_twice(tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama"), progress=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, one tensor
    assert not any(p.is_meta for p in model.parameters())
