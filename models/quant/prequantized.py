"""Checkpoints already quantized by AWQ, GPTQ or compressed-tensors: config.json's `quantization_config` read
into a Scheme (or refused, naming what does not map onto llama.cpp's blocks), and the loader's hook that turns each
quantized linear layer's packed tensors into blocks held by a BlockWeight (models/quant/blocks.py), so that
such a checkpoint runs on the block kernels with its weights as quantized, never widened to floats.

What maps (the unpacking and the formats: models/quant/packed_int4.py):
- AWQ (AutoAWQ, quant_method "awq"): 4 bits, version "gemm", zero points -> Q4_1.
- GPTQ (quant_method "gptq"): 4 bits -> Q4_0 when sym (zero points all 8), else Q4_1; 8 bits sym -> Q8_0;
  checkpoint_format "gptq" (v1: zeros stored minus one) or "gptq_v2".
- compressed-tensors: one weights scheme of type "int", 4 or 8 bits, strategy "group" or "channel", format
  "pack-quantized", "int-quantized" or "naive-quantized": symmetric 4-bit -> Q4_0, asymmetric 4-bit -> Q4_1,
  symmetric 8-bit -> Q8_0. Input activation schemes are ignored: activations stay float (finer than the int8
  ones the checkpoint was calibrated with).
Each needs groups of a multiple of 32 inputs (a block never spans two groups). Refused, with the reason: act-order
(desc_act, g_idx reordering groups, actorder "group"), other bit widths, 8 bits with zero points, other packings
(AWQ gemv / marlin / exllama / ipex, GPTQ marlin, compressed-tensors' float and sparse formats), quantized
KV caches, quantized MoE experts.

Layers the scheme left float (AWQ's modules_to_not_convert, compressed-tensors' ignore, the LM head) are found
by their tensors: a layer is quantized where its packed tensors are in the checkpoint.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from models.quant.blocks import BlockWeight
from models.quant.block_formats import BlockFormat
from models.quant.packed_int4 import (Unpacked, as_symmetric, check_plain_groups, to_blocks, unpack_awq,
                                      unpack_compressed, unpack_gptq)
from models.quant.block_quantize import BLOCK
from tandem.errors import CheckpointError

METHODS = ("awq", "gptq", "compressed-tensors")
_CT_FORMATS = {"pack-quantized": True, "int-quantized": False, "naive-quantized": False}  # -> packed


@dataclass(frozen=True)
class Scheme:
    """How a checkpoint's linear weights are quantized (what the loader needs of quantization_config)."""

    method: str  # one of METHODS
    bits: int
    group: int | None  # inputs per scale; None: one scale per output row (channel-wise)
    symmetric: bool  # no zero points (the middle code is zero)
    zero_offset: int = 0  # added to stored zeros (GPTQ v1 stores zero - 1)
    packed: bool = False  # compressed-tensors: weight_packed int32 (else weight int8)

    @property
    def marker(self) -> str:
        """The tensor suffix that marks a quantized layer in the checkpoint."""
        if self.method != "compressed-tensors":
            return ".qweight"
        return ".weight_packed" if self.packed else ".weight_scale"


def read_scheme(qc: dict[str, Any], source: str) -> Scheme:
    """config.json's quantization_config -> Scheme. Raises CheckpointError naming what does not map."""
    method = qc.get("quant_method")
    readers = {"awq": _awq, "gptq": _gptq, "compressed-tensors": _compressed}
    if method not in readers:
        raise CheckpointError(f"{source}: quantization_config.quant_method={method!r} is not loaded (pre-quantized "
                              f"checkpoints: {', '.join(METHODS)}; or load float weights and use --quantization)")
    scheme = readers[method](qc, lambda why: CheckpointError(f"{source}: {method} checkpoint: {why}"))
    if scheme.group is not None and scheme.group % BLOCK:
        raise CheckpointError(f"{source}: {method} checkpoint: group_size {scheme.group} is not a multiple of {BLOCK} "
                              "(a block of llama.cpp's formats would span two groups)")
    return scheme


def _group(value: Any) -> int | None:
    return None if value in (None, -1, 0) else int(value)


def _awq(qc: dict[str, Any], refuse: Callable[[str], CheckpointError]) -> Scheme:
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    version = str(qc.get("version", "gemm")).lower()
    if bits != 4:
        raise refuse(f"bits={bits}: only 4-bit AWQ maps to blocks")
    if version != "gemm":
        raise refuse(f"version={version!r}: only AutoAWQ's 'gemm' packing is read (gemv, marlin, exllama and ipex "
                     "pack differently)")
    if qc.get("backend") not in (None, "autoawq"):
        raise refuse(f"backend={qc['backend']!r}: only AutoAWQ's packing is read")
    if not qc.get("zero_point", True):
        raise refuse("zero_point=false: AutoAWQ's gemm layout always stores zero points; this is another layout")
    return Scheme("awq", 4, _group(qc.get("group_size", qc.get("q_group_size", 128))), symmetric=False)


def _gptq(qc: dict[str, Any], refuse: Callable[[str], CheckpointError]) -> Scheme:
    bits, sym = int(qc.get("bits", 4)), bool(qc.get("sym", True))
    fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
    if bits not in (4, 8):
        raise refuse(f"bits={bits}: 4- and 8-bit GPTQ map to blocks; 2- and 3-bit have no block format here")
    if bits == 8 and not sym:
        raise refuse("bits=8 with sym=false: 8-bit weights with zero points have no block format (Q8_0 is symmetric)")
    if qc.get("desc_act"):
        raise refuse("desc_act=true (act-order): g_idx reorders the inputs' groups, so a block of 32 consecutive "
                     "inputs would mix groups")
    if fmt not in ("gptq", "gptq_v2"):
        raise refuse(f"checkpoint_format={fmt!r}: only the 'gptq' and 'gptq_v2' packings are read")
    return Scheme("gptq", bits, _group(qc.get("group_size", 128)), sym, zero_offset=1 if fmt == "gptq" else 0)


def _compressed(qc: dict[str, Any], refuse: Callable[[str], CheckpointError]) -> Scheme:
    if qc.get("kv_cache_scheme"):
        raise refuse("kv_cache_scheme: a quantized KV cache is not loaded")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format") not in (None, "dense"):
        raise refuse(f"sparsity format {sparsity.get('format')!r}: sparse weights are not loaded")
    groups = list((qc.get("config_groups") or {}).values())
    weights = [g.get("weights") for g in groups if g.get("weights")]
    if not weights:
        raise refuse("no config_groups with weights")
    if any(w != weights[0] for w in weights):
        raise refuse("config_groups quantize weights in different ways; one scheme for every layer is loaded")
    w = weights[0]
    fmts = {g.get("format") or qc.get("format") for g in groups}
    fmt = fmts.pop() if len(fmts) == 1 else None
    bits, strategy = int(w.get("num_bits", 0)), w.get("strategy")
    if fmt not in _CT_FORMATS:
        raise refuse(f"format={fmt!r}: only {', '.join(_CT_FORMATS)} are read")
    if w.get("type", "int") != "int":
        raise refuse(f"weights of type {w.get('type')!r}: only integer weights map to blocks")
    if bits not in (4, 8):
        raise refuse(f"num_bits={bits}: 4- and 8-bit weights map to blocks")
    if strategy not in ("group", "channel"):
        raise refuse(f"strategy={strategy!r}: per-group and per-channel scales map to blocks")
    if w.get("actorder") == "group":
        raise refuse("actorder='group': g_idx reorders the inputs' groups, so a block would mix groups")
    if w.get("dynamic"):
        raise refuse("dynamic weight quantization has no stored scales")
    symmetric = bool(w.get("symmetric", True))
    if bits == 8 and not symmetric:
        raise refuse("8-bit weights with zero points have no block format (Q8_0 is symmetric)")
    group = _group(w.get("group_size")) if strategy == "group" else None
    if strategy == "group" and group is None:
        raise refuse("strategy='group' without group_size")
    return Scheme("compressed-tensors", bits, group, symmetric, packed=_CT_FORMATS[fmt])


def scheme_of(model_dir: Path) -> Scheme | None:
    """The Scheme of model_dir's config.json; None where it has no quantization_config of METHODS (GPT-OSS's
    MXFP4 experts are its family's own: models/families/gpt_oss.py)."""
    config = model_dir / "config.json"
    qc = json.loads(config.read_text()).get("quantization_config") if config.is_file() else None
    if not qc or qc.get("quant_method") not in METHODS:
        return None
    return read_scheme(qc, str(config))


class PrequantizedLinears:
    """The loader's hook (models/loader.py) for a pre-quantized checkpoint: `weight` reads one quantized linear
    weight's tensors as blocks, handing the loader a stand-in for the float weight; `attach` then gives each such
    layer its BlockWeight (with its bias, read by then) and an empty weight, as --quantization leaves a layer."""

    def __init__(self, scheme: Scheme, source: str, names: Collection[str], fused: dict[str, tuple[str, ...]],
                 dtype: torch.dtype, device: torch.device) -> None:
        """names: every tensor in the checkpoint; fused: our fused parameter suffix -> the checkpoint's parts.
        Raises CheckpointError for quantized MoE experts, or where the block kernels are not in this build."""
        self.scheme, self.source, self.fused, self.dtype, self.device = scheme, source, fused, dtype, device
        self.names = set(names)
        self.quantized = {n.removesuffix(scheme.marker) for n in self.names if n.endswith(scheme.marker)}  # layers
        if device.type != "cpu":
            raise CheckpointError(f"{source}: a {scheme.method} checkpoint runs on the block kernels, which run on "
                                  f"CPUs; this executor's device is {device.type}")
        experts = sorted(n for n in self.quantized if ".experts." in n)
        if experts:
            raise CheckpointError(f"{source}: quantized MoE experts ({experts[0]}, ...) are not loaded; only dense "
                                  "linear layers map to blocks")
        self._block_weight = BlockWeight
        self._parts: dict[str, list[tuple[BlockFormat, torch.Tensor]]] = {}  # our module name -> blocks

    def weight(self, name: str, shape: tuple[int, ...], read: Callable[[str], torch.Tensor]) -> torch.Tensor | None:
        """Our parameter `name` (of `shape` [out, in]) as blocks, kept for attach; returns a stand-in of its
        shape (one element, expanded), or None where it is not a quantized layer's weight. Raises
        CheckpointError for tensors that do not unpack or map (naming them)."""
        if not name.endswith(".weight"):
            return None
        suffix = next((s for s in self.fused if name.endswith(s)), None)
        parts = [name[:-len(suffix)] + p for p in self.fused[suffix]] if suffix else [name]
        layers = [p.removesuffix(".weight") for p in parts]
        quantized = [layer in self.quantized for layer in layers]
        if not any(quantized):
            return None
        if not all(quantized):
            raise CheckpointError(f"{self.source}: {', '.join(layers)} are fused into one matrix here, but only some "
                                  "of them are quantized")
        blocks = [to_blocks(layer, self._unpack(layer, read)) for layer in layers]
        outs = [b.shape[0] for _, b in blocks]
        if sum(outs) != shape[0]:
            raise CheckpointError(f"{self.source}: {name} unpacks to {sum(outs)} rows; config.json implies {shape[0]}")
        merged: list[tuple[BlockFormat, torch.Tensor]] = []
        for fmt, b in blocks:  # adjacent parts of one format become one matrix (one kernel call)
            if merged and merged[-1][0] is fmt:
                merged[-1] = (fmt, torch.cat([merged[-1][1], b]))
            else:
                merged.append((fmt, b))
        self._parts[name.removesuffix(".weight")] = [(f, b.to(self.device)) for f, b in merged]
        return torch.zeros((), dtype=self.dtype, device=self.device).expand(shape)

    def _unpack(self, layer: str, read: Callable[[str], torch.Tensor]) -> Unpacked:
        """The checkpoint layer `layer`'s packed tensors, unpacked as its library packs them."""
        s = self.scheme
        if s.method == "compressed-tensors":
            weight = read(layer + (".weight_packed" if s.packed else ".weight"))
            scale = read(layer + ".weight_scale")
            out = scale.shape[0]
            columns = weight.shape[1] * (32 // s.bits if s.packed else 1)
            if layer + ".weight_shape" in self.names:  # (out, in) as stored: the packed width may be padded
                stored = tuple(int(v) for v in read(layer + ".weight_shape").tolist())
                if stored != (out, columns):
                    raise CheckpointError(f"{self.source}: {layer}.weight_shape is {stored}; its tensors are "
                                          f"({out}, {columns})")
            # (symmetric int-quantized checkpoints may store all-zero zero points anyway: checked, then dropped)
            zero = read(layer + ".weight_zero_point") if layer + ".weight_zero_point" in self.names else None
            if zero is None and not s.symmetric:
                raise CheckpointError(f"{self.source}: {layer} has no weight_zero_point; the scheme is asymmetric")
            if layer + ".weight_g_idx" in self.names:
                check_plain_groups(f"{layer}.weight_g_idx", read(layer + ".weight_g_idx"), columns, s.group or columns)
            w = unpack_compressed(layer, weight, scale, zero, s.bits, s.group, s.packed, out, columns)
            return as_symmetric(layer, w) if s.symmetric else w
        qweight, qzeros, scales = read(layer + ".qweight"), read(layer + ".qzeros"), read(layer + ".scales")
        out = scales.shape[1]
        if s.method == "awq":
            columns = qweight.shape[0]
            return unpack_awq(layer, qweight, qzeros, scales, s.group or columns, out, columns)
        columns = qweight.shape[0] * 32 // s.bits
        g_idx = read(layer + ".g_idx") if layer + ".g_idx" in self.names else None
        w = unpack_gptq(layer, qweight, qzeros, scales, g_idx, s.bits, s.group or columns, s.zero_offset, out, columns)
        return as_symmetric(layer, w) if s.symmetric else w

    def attach(self, model: nn.Module) -> int:
        """Every layer read by `weight` gets its BlockWeight (bias included) as `.quant`, and an empty float weight
        of the model's dtype; returns how many."""
        for module_name, parts in self._parts.items():
            m = model.get_submodule(module_name)
            m.quant = self._block_weight(parts, m.in_features, None if m.bias is None else m.bias.detach())
            m.weight = nn.Parameter(torch.empty(0, dtype=self.dtype, device=self.device), requires_grad=False)
        return len(self._parts)
