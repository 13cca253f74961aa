"""Loads a GGUF file (`--model FILE.gguf`) into a DecoderModel, as models/loader.py loads an HF directory.

The metadata becomes the HF config dict the same model would have (models/gguf/config.py) and goes through
the one config parser. Then each weight:

- a linear layer's matrix (the LM head and the embedding table included) stored in a block format Tandem
  computes on (models/quant/block_formats.py FORMATS: Q4_0 ... Q8_0, Q4_K, Q5_K, Q6_K) stays in its blocks
  (models/quant/blocks.py): a view of the memory-mapped file, resident once, in the page cache; Llama q/k
  rows un-permuted and a fused q/k/v's same-format neighbours joined are copies, and their file pages are
  released (models/memory/mapped_pages.py). The layer's `weight` is a stand-in of its shape and dtype.
- everything else (norms, biases, F32/F16/BF16 matrices, formats without a kernel such as Q2_K, Q3_K, IQ*;
  every tensor with `dequantize`, the --gguf-dequantize flag, or on a device other than the CPU, where the
  block kernels do not run) is dequantized, un-permuted / un-shifted to its HF value (models/gguf/tensors.py),
  converted to the executor's dtype and assigned into the model built on the meta device: one float32 tensor
  (one layer's q/k/v while fused) is the only transient copy.

`--quantization int8 | fp16` then quantizes the linear layers that are float (models/quant/linear.py).
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from models.config import ModelConfig
from models.gguf.config import hf_config
from models.gguf.file import GgufFile
from models.gguf.tensors import ROPE_FREQS, HfTensors
from models.layers import Linear
from models.memory.mapped_pages import release_file_pages
from models.quant.block_formats import FORMATS, BlockFormat
from models.quant.blocks import BlockWeight, QuantEmbedding, from_mapped, stand_in
from models.transformer import DecoderModel
from tandem.errors import CheckpointError

log = logging.getLogger("tandem.models")
_EMBEDDING = "model.embed_tokens.weight"


def read_gguf_config(path: str | Path) -> tuple[GgufFile, dict, ModelConfig]:
    """The open file, its HF config dict and the ModelConfig parsed from it."""
    gguf = GgufFile(path)
    rope_freqs = gguf.tensor(ROPE_FREQS) if ROPE_FREQS in gguf.tensor_shapes else None
    raw = hf_config(gguf.metadata, gguf.tensor_shapes, gguf.tensor_types, str(gguf.path), rope_freqs)
    return gguf, raw, ModelConfig.from_hf(raw, source=str(gguf.path))


def load_gguf_model(path: str | Path, device: torch.device, dtype_of: Callable[[ModelConfig], torch.dtype],
                    fused_parts: dict[str, tuple[str, ...]], progress: bool = True,
                    dequantize: bool = False) -> DecoderModel:
    """Called by models/loader.py load_model, which hands over its rules: dtype_of(cfg) -> the weights' dtype
    (--dtype), fused_parts: our fused parameter suffix -> the HF tensors concatenated into it; dequantize:
    every weight to float (--gguf-dequantize)."""
    gguf, raw, cfg = read_gguf_config(path)
    torch_dtype = dtype_of(cfg)
    tensors = HfTensors(gguf, raw)
    with torch.device("meta"):
        model = DecoderModel(cfg)
    if cfg.num_experts:
        raise CheckpointError(f"{gguf.path}: mixture-of-experts models are not supported from GGUF")
    keep_blocks = not dequantize and device.type == "cpu"
    if not dequantize and device.type != "cpu" and any(t in FORMATS for t in gguf.tensor_types.values()):
        log.info("%s: the block kernels run on CPUs; on %s the weights are dequantized to %s", gguf.path.name,
                 device.type, str(torch_dtype).removeprefix("torch."))
    wanted = dict(model.state_dict())
    tied = cfg.tie_word_embeddings
    if tied:
        wanted.pop("lm_head.weight")
    used: set[str] = set()

    def read(name: str) -> torch.Tensor:
        used.add(name)
        out = torch.from_numpy(tensors.read(name))
        release_file_pages([from_mapped(gguf.raw(tensors.names[name]))])  # copied: its file pages go
        return out

    def read_blocks(name: str) -> tuple[BlockFormat, np.ndarray]:
        used.add(name)
        rows, source = tensors.read_blocks(name), gguf.raw(tensors.names[name])
        if not np.may_share_memory(rows, source):  # un-permuted: a copy, its file pages go
            release_file_pages([from_mapped(source)])
        return FORMATS[tensors.type_of(name)], rows

    state: dict[str, torch.Tensor] = {}
    blocks: dict[str, list[tuple[BlockFormat, torch.Tensor]]] = {}  # parameter -> its parts, kept as blocks
    bar = tqdm(wanted.items(), desc=f"loading {gguf.path.name}", unit="tensor", file=sys.stderr,
               disable=not progress, leave=False)
    for name, meta in bar:
        prefix, _, suffix = name.partition("layers.")
        layer_no, _, rest = suffix.partition(".")
        fused = fused_parts.get(rest) if suffix else None
        parts = [f"{prefix}layers.{layer_no}.{part}" for part in fused] if fused else [name]
        if keep_blocks and _is_matrix(model, name) and all(p in tensors and tensors.type_of(p) in FORMATS
                                                           for p in parts):
            blocks[name] = _joined([read_blocks(p) for p in parts])
            shape = (sum(b.shape[0] for _, b in blocks[name]), *{tensors.shape(p)[-1] for p in parts})
            tensor = stand_in(shape, torch_dtype)  # (a shape from the file: checked below)
        else:
            tensor = torch.cat([read(p) for p in parts], dim=0) if fused else read(name)
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
    _attach_blocks(model, blocks, torch_dtype)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
        if isinstance(model.model.embed_tokens, QuantEmbedding):  # one copy of the table serves both
            model.lm_head.quant = model.model.embed_tokens.blocks
    # the header's pages (the tokenizer's arrays, walked at open) are not read again
    release_file_pages([from_mapped(gguf.header.data[:min(t.offset for t in gguf.header.tensors.values())])])
    model.init_rotary(device)
    return model.eval()


def _is_matrix(model: nn.Module, name: str) -> bool:
    """Whether parameter `name` is a linear layer's weight or the embedding table (what blocks can be)."""
    owner, _, leaf = name.rpartition(".")
    return leaf == "weight" and (name == _EMBEDDING or isinstance(model.get_submodule(owner), Linear))


def _joined(parts: list[tuple[BlockFormat, np.ndarray]]) -> list[tuple[BlockFormat, torch.Tensor]]:
    """Adjacent parts of one format joined into one (fewer kernel calls; a copy, whose file pages go), as
    tensors sharing the arrays' memory (a view of the file where nothing was joined or moved)."""
    runs: list[tuple[BlockFormat, list[np.ndarray]]] = []
    for fmt, rows in parts:
        if runs and runs[-1][0] == fmt:
            runs[-1][1].append(rows)
        else:
            runs.append((fmt, [rows]))
    out = []
    for fmt, arrays in runs:
        joined = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        if len(arrays) > 1:
            release_file_pages([from_mapped(a) for a in arrays])
        out.append((fmt, from_mapped(joined)))
    return out


def _attach_blocks(model: DecoderModel, blocks: dict[str, list[tuple[BlockFormat, torch.Tensor]]],
                   dtype: torch.dtype) -> None:
    """Each kept parameter's module computes on its blocks: a Linear through `quant`, the embedding as a
    QuantEmbedding."""
    for name, parts in blocks.items():
        owner = name.rpartition(".")[0]
        module = model.get_submodule(owner)
        if name == _EMBEDDING:
            model.model.embed_tokens = QuantEmbedding(BlockWeight(parts, module.embedding_dim, None), dtype)
        else:
            module.quant = BlockWeight(parts, module.in_features, module.bias)
