"""The native decode step: every layer of a decode step in one C++ call (models/native/decode_step.cpp).

For calls whose items each add one token without LoRA, plus any drafts to verify (rows of the item's sequence
at the positions after its token: a drafted step stays on this path), the executor can run this instead of
the PyTorch forward: on a CPU a decode step at small batch sizes is bound by
reading the weights once, and the eager step spent about half of its time elsewhere (hundreds of small ops,
the Python between them, a gathered copy of each item's K/V). The C++ step runs one OpenMP team (torch's own
runtime, the executor's --threads) through every phase of every layer, streams each weight matrix once per
step for the whole batch, writes K/V into the paged cache and reads them through the block table in place.

Weights: float32, or the `--quantization` modes' own bytes: fp16 (converted to float32 in registers) and
per-channel int8. For int8 the step writes each activation row as two int8 digits per block of 32 values
(~15 bits, one float32 scale per block) and multiplies in integers: converting the int8 weights to float32
instead made the step compute-bound at ~2x the time its memory traffic needs on AVX2, and one digit (llama.cpp's
q8_0 way) measured 4x the NLL increase of the int8 weights alone on SmolLM2. A layer whose input size is not a
multiple of 32 keeps float32 activations. The quantized modes keep FBGEMM's packed copy for prefill, so the
native step holds a second copy of their weights (float16 or int8, made from the packed one here; float32
weights are shared, not copied).

A bfloat16 model (--dtype bfloat16) runs with its bfloat16 weights, embedding and K/V cache read in place and
widened in registers; its activations are float32 inside the step (the eager bfloat16 forward rounds every
op's output to bfloat16; K/V are rounded when written, as there), so its tokens may differ from the eager
step's at near-ties, at bfloat16's own noise.

Where it runs: x86-64 CPUs with AVX2, FMA and F16C, float32 or bfloat16 models without MoE layers (quantized:
float32 only), with a C++ compiler (g++ by default; `NativeBuild.cxx`, else `CXX`, overrides) and ninja to build
it. `native_refusal` says why not otherwise, and the executor falls back to the PyTorch step (or refuses
`--decode-kernel native`).

How it is built and called: models/native/ (decode_step.cpp, the step; op.cpp, its torch binding) is built with
torch.utils.cpp_extension into a library that registers the op `torch.ops.tandem.decode_step` and the class
`torch.classes.tandem.DecodeModel` (TORCH_LIBRARY), linked against torch and its OpenMP runtime. The tensors
are the only description of the layout: a DecodeModel, made once from the weight and KV-pool tensors, checks
them in C++ and holds them; each step passes the step's tensors (token ids, positions, block tables, rotary),
which the op checks too. The library is built once per (sources, compiler, torch, flags) into a cache
directory (~/.cache/tandem/native by default; the image prebuilds it: `python -m models.decode.native`), by
`torch.utils.cpp_extension.load` in a child process (its compiler comes through the child's environment, and
one process loads one library of the op), and installed there atomically; concurrent executors share it.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from models.memory.huge_pages import copy_to_huge_pages
from models.kv.paged_cache import PagedKvCache, decode_block_table
from models.moe import SparseMoeBlock
from models.native.library import (BUILD_SECONDS, DEFAULT_CACHE_DIR, DTYPES, NativeBuild,  # noqa: F401
                                   build_library, load_kernel, machine_refusal)
from models.quant.linear import Fp16Weight, Int8Weight
from models.transformer import DecoderModel, Linear



def native_refusal(model: DecoderModel, kv: PagedKvCache, build: NativeBuild | None = None) -> str | None:
    """Why this model and KV cache (on this machine, built as `build` says) cannot run the native step; None
    when they can."""
    reason = model_refusal(model, build)
    if reason is None and kv.k.dtype != model.model.embed_tokens.weight.dtype:
        return f"its KV cache is {str(kv.k.dtype).removeprefix('torch.')}, not the model's dtype"
    return reason


def model_refusal(model: DecoderModel, build: NativeBuild | None = None) -> str | None:
    """Why this model (on this machine, built as `build` says) cannot run the native step whatever its KV
    cache; None when it can (asked before the cache is made: the executor packs weights only for the eager
    step)."""
    weight = model.model.embed_tokens.weight
    if weight.device.type != "cpu":
        return f"it runs on CPUs; this model is on {weight.device.type}"
    if weight.dtype not in DTYPES:
        return f"it runs --dtype float32 or bfloat16 models, not {str(weight.dtype).removeprefix('torch.')}"
    if weight.dtype != torch.float32 and any(isinstance(m, Linear) and m.quant is not None for m in model.modules()):
        return "--quantization needs --dtype float32 in it"
    if any(isinstance(m, SparseMoeBlock) for m in model.modules()):
        return "MoE layers are not in the native step"
    if model.config.native_decode_refusal is not None:  # (sliding windows, soft-capping, sinks, other layouts)
        return f"{model.config.native_decode_refusal} is not in the native step"
    if any(m.in_features % 8 for m in model.modules() if isinstance(m, Linear)) or model.config.head_dim % 8:
        return "a linear layer's input size or the head size is not a multiple of 8"
    return machine_refusal(build)


class NativeDecode:
    """The native step over a model and its KV cache; `run` has the signature of CompiledDecode.run."""

    def __init__(self, model: DecoderModel, kv: PagedKvCache, build: NativeBuild | None = None,
                 huge_pages: str = "auto") -> None:
        """Builds (first start) and loads the kernel, and describes the model to it. huge_pages: the
        --huge-pages mode of the quantized modes' weight copies (models/memory/huge_pages.py). Raises ValueError where
        it cannot run (native_refusal's reason, or a layout op.cpp refuses), RuntimeError if the build fails."""
        reason = native_refusal(model, kv, build)
        if reason:
            raise ValueError(f"the native decode kernel cannot run here: {reason}")
        self.library = load_kernel(build)
        self.step = torch.ops.tandem.decode_step.default  # (tests replace it to inject a failure)
        self.model, self.kv = model, kv
        self.huge_pages = huge_pages
        self._desc: torch.ScriptObject | None = None  # a tandem.DecodeModel: holds every tensor it points into
        self._desc_of: tuple[torch.Tensor, int] | None = None  # (the K pool, the weights' version) described
        self.calls = 0  # decode steps that ran natively (read by tests and benchmarks)
        # Adjacent rows of one sequence in one call (an item's drafts, verified: its table repeated, positions
        # following each other), each attending over the rows before it.
        self.takes_drafts = True
        self._describe()  # now: a layout the kernel refuses fails the start, not the first step

    def _weights(self, m: Linear) -> tuple[list[tuple[torch.Tensor, int]], torch.Tensor | None,
                                           torch.Tensor | None, bool]:
        """m's weight in the form the step reads, as (tensor, kind) parts (kind 0: the tensor's dtype says; a
        block format's kind, models/quant/block_formats.py: its rows of blocks), its scales and bias, and whether
        the weight is a copy (FBGEMM's packed weights are unpacked; float32 and block weights are read in place)."""
        q = m.quant
        if q is None:
            return [(m.weight.detach().contiguous(), 0)], None, m.bias, False
        if isinstance(q, Fp16Weight):
            w32, bias = torch.ops.quantized.linear_unpack_fp16(q._packed)
            return [(w32.to(torch.float16), 0)], None, bias, True
        if isinstance(q, Int8Weight):
            if q.qweight is not None:
                return [(q.qweight, 0)], q.scales, q.bias, False  # (the portable kernel's own int8 weight)
            qw, _ = torch.ops.quantized.linear_unpack(q._packed)
            return [(qw.int_repr(), 0)], qw.q_per_channel_scales(), q.bias, True
        parts = getattr(q, "parts", None)  # a BlockWeight (models/quant/blocks.py)
        if parts is not None:
            return [(blocks, fmt.kind) for fmt, blocks in parts], None, q.bias, False
        raise ValueError(f"no native kernel for {type(q).__name__}")

    def _linears(self, mods: list[Linear]) -> tuple[list[torch.Tensor], list[int], list[int],
                                                    list[torch.Tensor | None], list[torch.Tensor | None]]:
        """The modules' weight tensors (every part, in order), their kinds, the number of parts of each module,
        and each module's scales and bias, as the kernel reads them; the copies (FBGEMM's unpacked weights)
        share one huge-page arena."""
        raw = [self._weights(m) for m in mods]
        moved = iter(copy_to_huge_pages([w for parts, _, _, copied in raw if copied for w, _ in parts],
                                        self.huge_pages))
        weights, kinds, counts, scales, biases = [], [], [], [], []
        for parts, scale, bias, copied in raw:
            for w, kind in parts:
                weights.append(next(moved) if copied else w)
                kinds.append(kind)
            counts.append(len(parts))
            scales.append(_float(scale))
            biases.append(_float(bias))
        return weights, kinds, counts, scales, biases

    def _describe(self) -> torch.ScriptObject:
        """The model as the kernel reads it (made once; again if the cache's pools were replaced or the weights
        changed)."""
        if self._desc is not None and self._desc_of[0] is self.kv.k and self._desc_of[1] == self.model.weights_version:
            return self._desc
        model, cfg = self.model, self.model.config
        layers = model.model.layers
        mods = [m for layer in layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]
        weights, kinds, counts, scales, biases = self._linears(mods + [model.lm_head])
        norms = [_float(n.weight) for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        qk_norms = [None if n is None else _float(n.weight) for layer in layers
                    for n in (layer.self_attn.q_norm, layer.self_attn.k_norm)]
        embed, embed_kind = model.model.embed_tokens.weight.detach(), 0
        table = getattr(model.model.embed_tokens, "blocks", None)  # a QuantEmbedding's BlockWeight
        if table is not None:
            (fmt, embed), = table.parts
            embed_kind = fmt.kind
        self._desc = torch.classes.tandem.DecodeModel(
            embed, embed_kind, _float(model.model.norm.weight), norms, qk_norms, weights, kinds, counts, scales,
            biases, self.kv.k, self.kv.v, cfg.num_heads, cfg.rms_norm_eps, cfg.head_dim ** -0.5)
        self._desc_of = (self.kv.k, self.model.weights_version)
        return self._desc

    @torch.inference_mode()
    def run(self, token_ids: Sequence[int], tables: Sequence[Sequence[int]], pasts: Sequence[int],
            head_rows: Sequence[int] | None = None) -> torch.Tensor:
        """One decode step: row i feeds token_ids[i] at position pasts[i] of the cache whose blocks are
        tables[i] (already reserved for it; adjacent rows of one sequence at consecutive positions each see
        the ones before them). Returns float32 logits [B, vocab], or [len(head_rows), vocab] of those rows
        (ascending) only: the LM head is the costliest matrix of a row, and a prompt chunk wants one row's
        logits; a row's logits are the same bits either way. Raises ValueError for a token id or position the
        kernel refuses (nothing written), torch.OutOfMemoryError if its scratch memory could not be allocated."""
        desc = self._describe()
        rows = len(token_ids)
        if rows == 0:
            return torch.empty(0, self.model.config.vocab_size, dtype=torch.float32)
        ids = torch.from_numpy(np.asarray(token_ids, dtype=np.int64))  # (numpy: a third of torch.tensor's time)
        positions = np.asarray(pasts, dtype=np.int64)
        table = torch.from_numpy(decode_block_table(tables, pasts, self.kv.block_size, rows))  # [B, width] int64
        cos, sin = self._cos_sin(positions)  # [B, head_dim] float32 each, contiguous
        head = None if head_rows is None else torch.from_numpy(np.asarray(head_rows, dtype=np.int64))
        logits = self.step(desc, ids, torch.from_numpy(positions), table, cos, sin, head)
        self.calls += 1
        return logits

    def _cos_sin(self, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B] int64 -> the rotary cos, sin [B, head_dim] float32 (the row-invariant step overrides
        where they come from)."""
        cos, sin = self.model.rotary.cos_sin(torch.from_numpy(positions), torch.float32)
        return cos.contiguous(), sin.contiguous()

def _float(t: torch.Tensor | None) -> torch.Tensor | None:
    """t as float32, contiguous (a copy only where it is not already: a bfloat16 model's norms, say)."""
    return None if t is None else t.detach().float().contiguous()


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m models.decode.native [--cache-dir DIR] [--cxx CXX]`: builds the kernel into the cache (an
    image build runs it, so that executors start with it built) and prints the library's path."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m models.decode.native", description=main.__doc__)
    ap.add_argument("--cache-dir", type=Path, default=None, help=f"default {DEFAULT_CACHE_DIR}")
    ap.add_argument("--cxx", default=None, help="the C++ compiler (default $CXX, else g++)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(build_library(NativeBuild(args.cache_dir, args.cxx)))
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
