"""Loads an HF model directory (config.json + safetensors, single or sharded) into a DecoderModel (a GGUF
file goes to models/gguf/loader.py).

The model is built on the meta device and each parameter is assigned straight from the file: a weight used
as stored stays a view of the mapped file (resident once, in the page cache). A weight made from others (q/k/v
fused into one tensor, stacked experts, another dtype) is a copy, and its sources' pages are released once it
is made (models/memory/mapped_pages.py), so that memory holds one copy of each weight.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from safetensors import safe_open
from tqdm import tqdm

from models.config import ModelConfig
from models.memory.mapped_pages import file_mappings, release_file_pages
from models.families import CHECKPOINT_LAYOUTS
from models.quant.prequantized import PrequantizedLinears, scheme_of
from tandem.errors import CheckpointError
from tandem.model_path import is_gguf
from models.transformer import DecoderModel
from models.moe import SparseMoeBlock
from models.vision.load import load_vision_tower

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Our parameter name suffix -> the HF tensors concatenated (along dim 0) to make it.
_FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "self_attn.qkv_proj.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
}
# Our stacked expert parameter (suffix after "layers.N.") -> the per-expert HF tensors concatenated (dim 0)
# for each expert e, read from "mlp.experts.{e}.<part>".
_EXPERTS = {
    "mlp.experts_gate_up": ("gate_proj.weight", "up_proj.weight"),  # [E, 2*I, H]
    "mlp.experts_down": ("down_proj.weight",),  # [E, H, I]
}
# Tensors some checkpoints carry that carry no weights we need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(name: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 on CUDA (float16 on a GPU without bf16; docs/cuda.md) and float32 on CPU (where
    bf16/fp16 matmuls are slow)."""
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def _tensor_files(model_dir: Path) -> tuple[dict[str, Path], Path]:
    """Maps every tensor name to the file holding it; also returns the file to name in errors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return {name: model_dir / fname for name, fname in weight_map.items()}, index
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(
            f"{model_dir}: no model.safetensors or model.safetensors.index.json (only safetensors are loaded)")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}, single


def load_model(model_dir: str | Path, device: str | torch.device = "cpu", dtype: str = "auto",
               progress: bool = True, on_layer: Callable[[nn.Module], None] | None = None,
               gguf_dequantize: bool = False) -> DecoderModel:
    """on_layer: called with each decoder layer once its weights are in place, before the next layer's are read
    (tensor parallelism cuts the layer there, so that no more than one layer's fused or stacked weights are ever
    whole: models/tensor_parallel.shard_layer). gguf_dequantize: a GGUF file's block-quantized weights
    dequantized to float too (--gguf-dequantize; by default they stay in their blocks: models/gguf/loader.py)."""
    model_dir = Path(model_dir)
    if is_gguf(model_dir):  # a GGUF file (llama.cpp's format): models/gguf/loader.py
        from models.gguf.loader import load_gguf_model  # (it imports nothing from here: given what it shares)
        model = load_gguf_model(model_dir, torch.device(device),
                                lambda cfg: resolve_dtype(dtype, cfg, torch.device(device)), _FUSED, progress,
                                gguf_dequantize)
        for layer in model.model.layers if on_layer is not None else ():  # (loaded whole, then cut)
            on_layer(layer)
        return model
    device = torch.device(device)
    cfg = ModelConfig.from_dir(model_dir)
    if cfg.vision is not None and on_layer is not None:
        raise CheckpointError(f"{model_dir}: a vision-language model is not split into ranks; run it on one")
    torch_dtype = resolve_dtype(dtype, cfg, device)
    with torch.device("meta"):
        model = DecoderModel(cfg)
    files, source = _tensor_files(model_dir)
    # -- pre-quantized checkpoints (AWQ, GPTQ, compressed-tensors): their quantized linear layers load as blocks,
    # everything else as below (models/quant/prequantized.py). --
    scheme = scheme_of(model_dir)
    prequantized = PrequantizedLinears(scheme, str(source), files, _FUSED, torch_dtype, device) if scheme else None
    if prequantized is not None and on_layer is not None:
        raise CheckpointError(f"{source}: a pre-quantized checkpoint's blocks are not cut into ranks; run it on one")
    wanted = dict(model.state_dict())
    tied = cfg.tie_word_embeddings
    if tied:
        wanted.pop("lm_head.weight")
    handles: dict[Path, object] = {}
    read_names: set[str] = set()  # every checkpoint tensor read (the rest are reported unused)
    sources: list[torch.Tensor] = []  # what the parameter being made was read from
    # file_mappings() once a shard is opened, not once a weight: the sources lie in the shards' mappings, which
    # stay while `handles` holds them (read again after each new shard)
    spans: list[list[tuple[int, int]]] = []

    def read(name: str, as_named: bool = False) -> torch.Tensor:
        """as_named: the checkpoint's own name (the vision tower's); else ours, mapped to the text tower's."""
        prefix = cfg.checkpoint_text_prefix
        if prefix and not as_named and name.startswith("model."):
            name = prefix + name[len("model."):]
        read_names.add(name)
        path = files.get(name)
        if path is None:
            raise CheckpointError(f"{source}: missing tensor {name!r} required by {cfg.architecture}")
        if path not in handles:
            if not path.is_file():
                raise CheckpointError(f"{source}: names shard {path.name} for {name!r}, but it does not exist")
            handles[path] = safe_open(str(path), framework="pt")
            spans.clear()
        sources.append(handles[path].get_tensor(name))
        return sources[-1]

    state: dict[str, torch.Tensor] = {}
    loaded: set[str] = set()
    used_expert_tensors: set[str] = set()
    layer: str | None = None  # the decoder layer whose tensors are being read (on_layer)

    def assign(done: str | None) -> None:  # what was read so far into the model, then (on_layer) the layer cut
        # (not strict: every wanted tensor is read into `state` on the way, so nothing can be missing)
        model.load_state_dict(state, strict=False, assign=True)
        loaded.update(state)
        state.clear()
        if done is not None:
            on_layer(model.model.layers[int(done)])

    bar = tqdm(wanted.items(), desc=f"loading {model_dir.name}", unit="tensor", file=sys.stderr,
               disable=not progress, leave=False)
    for name, meta in bar:  # (state_dict order: a layer's tensors are adjacent)
        sources.clear()
        prefix, _, suffix = name.partition("layers.")
        layer_no, _, rest = suffix.partition(".")
        if on_layer is not None and (layer_no or None) != layer:
            assign(layer)
            layer = layer_no or None
        fused = _FUSED.get(rest) if suffix else None
        experts = _EXPERTS.get(rest) if suffix else None
        layout = CHECKPOINT_LAYOUTS.get(cfg.architecture)  # the family's own names (models/families/)
        tensor = layout(name, tuple(meta.shape), read, cfg) if layout else None
        if tensor is not None:
            pass
        elif prequantized is not None and (tensor := prequantized.weight(name, tuple(meta.shape), read)) is not None:
            pass  # (a stand-in: the blocks are attached below)
        elif fused:
            base = f"{prefix}layers.{layer_no}."
            tensor = torch.cat([read(base + part) for part in fused], dim=0)
        elif experts:  # one tensor per expert in the checkpoint -> one stacked [E, ...] parameter
            base = f"{prefix}layers.{layer_no}.mlp.experts."
            tensor = torch.stack([torch.cat([read(f"{base}{e}.{part}") for part in experts], dim=0)
                                  for e in range(meta.shape[0])])
            used_expert_tensors.update(f"{base}{e}.{part}" for e in range(meta.shape[0]) for part in experts)
        else:
            tensor = read(name)
        if tuple(tensor.shape) != tuple(meta.shape):
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, config.json implies {tuple(meta.shape)}")
        state[name] = tensor.to(device=device, dtype=torch_dtype)
        if not any(state[name].data_ptr() == t.data_ptr() for t in sources):  # a copy: the file's pages go
            if not spans:
                spans.append(file_mappings())
            release_file_pages(sources, spans[0])
    sources.clear()
    bar.close()
    assign(layer)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    if cfg.vision is not None:  # the vision tower (models/vision/), in the activations' dtype
        model.vision = load_vision_tower(cfg.vision, lambda n: read(n, as_named=True), device, torch_dtype,
                                         lambda n: n in files)
    if prequantized is not None:
        prequantized.attach(model)  # -- pre-quantized: each such layer's BlockWeight --
    _warn_unused(files, loaded | used_expert_tensors | read_names, tied)
    model.init_rotary(device)
    for m in model.modules():  # non-persistent buffers were built on the meta device
        if isinstance(m, SparseMoeBlock):  # (counts of every expert, those of other ranks too)
            m.expert_tokens = torch.zeros(getattr(m, "total_experts", 0) or m.num_experts, dtype=torch.int64,
                                          device=device)
    return model.eval()


def _warn_unused(files: dict[str, Path], used: set[str], tied: bool) -> None:
    fused_parts = {part for parts in _FUSED.values() for part in parts}
    unused = [n for n in files if n not in used and not n.endswith(_IGNORED_SUFFIXES)
              and not any(n.endswith(p) for p in fused_parts) and not (tied and n == "lm_head.weight")]
    if unused:
        print(f"[tandem] warning: {len(unused)} checkpoint tensors are not used, e.g. {unused[:3]}", file=sys.stderr)
