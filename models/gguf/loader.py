"""Loads a GGUF file (`--model FILE.gguf`) into a DecoderModel, as models/loader.py loads an HF directory.

The metadata becomes the HF config dict the same model would have (models/gguf/config.py) and goes through
the one config parser; each tensor is dequantized from the memory-mapped file, un-permuted / un-shifted to
its HF value (models/gguf/tensors.py), converted to the executor's dtype and assigned into the model built on
the meta device: one float32 tensor (one layer's q/k/v while fused) is the only transient copy, so the
weights are never held twice. `--quantization int8` then quantizes the loaded model as for any checkpoint.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from models.config import ModelConfig
from models.gguf.config import hf_config
from models.gguf.file import GgufFile
from models.gguf.tensors import ROPE_FREQS, HfTensors
from models.transformer import DecoderModel
from tandem.errors import CheckpointError


def read_gguf_config(path: str | Path) -> tuple[GgufFile, dict, ModelConfig]:
    """The open file, its HF config dict and the ModelConfig parsed from it."""
    gguf = GgufFile(path)
    rope_freqs = gguf.tensor(ROPE_FREQS) if ROPE_FREQS in gguf.tensor_shapes else None
    raw = hf_config(gguf.metadata, gguf.tensor_shapes, gguf.tensor_types, str(gguf.path), rope_freqs)
    return gguf, raw, ModelConfig.from_hf(raw, source=str(gguf.path))


def load_gguf_model(path: str | Path, device: torch.device, dtype_of: Callable[[ModelConfig], torch.dtype],
                    fused_parts: dict[str, tuple[str, ...]], progress: bool = True) -> DecoderModel:
    """Called by models/loader.py load_model, which hands over its rules: dtype_of(cfg) -> the weights' dtype
    (--dtype), fused_parts: our fused parameter suffix -> the HF tensors concatenated into it."""
    gguf, raw, cfg = read_gguf_config(path)
    torch_dtype = dtype_of(cfg)
    tensors = HfTensors(gguf, raw)
    with torch.device("meta"):
        model = DecoderModel(cfg)
    if cfg.num_experts:
        raise CheckpointError(f"{gguf.path}: mixture-of-experts models are not supported from GGUF")
    wanted = dict(model.state_dict())
    tied = cfg.tie_word_embeddings
    if tied:
        wanted.pop("lm_head.weight")
    used: set[str] = set()

    def read(name: str) -> torch.Tensor:
        used.add(name)
        return torch.from_numpy(tensors.read(name))

    state: dict[str, torch.Tensor] = {}
    bar = tqdm(wanted.items(), desc=f"loading {gguf.path.name}", unit="tensor", file=sys.stderr,
               disable=not progress, leave=False)
    for name, meta in bar:
        prefix, _, suffix = name.partition("layers.")
        layer_no, _, rest = suffix.partition(".")
        fused = fused_parts.get(rest) if suffix else None
        if fused:
            base = f"{prefix}layers.{layer_no}."
            tensor = torch.cat([read(base + part) for part in fused], dim=0)
        else:
            tensor = read(name)
        if tuple(tensor.shape) != tuple(meta.shape):
            raise CheckpointError(f"{gguf.path}: tensor {name!r} has shape {tuple(tensor.shape)}, the metadata "
                                  f"implies {tuple(meta.shape)}")
        state[name] = tensor.to(device=device, dtype=torch_dtype)
        del tensor
    bar.close()
    unused = sorted(set(tensors.names) - used)
    if unused:  # a tensor the model has no place for (e.g. biases the config does not announce)
        raise CheckpointError(f"{gguf.path}: tensors {unused[:3]} have no place in a {cfg.architecture} model")
    model.load_state_dict(state, strict=not tied, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.init_rotary(device)
    return model.eval()
