"""The native decode step: every layer of a decode step in one C++ call (models/native/decode_step.cpp).

For calls whose items each add one token without LoRA or drafts (the same calls `--compile` takes), the
executor can run this instead of the PyTorch forward: on a CPU a decode step at small batch sizes is bound by
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
float32 only), a C++ compiler on the PATH (g++ by default; `CXX` overrides). `native_refusal` says why not otherwise, and
the executor falls back to the PyTorch step (or refuses `--decode-kernel native`). The library is compiled
once per source/compiler and kept in a cache directory (~2.5 s); concurrent executors share it safely.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import nn

from models.huge_pages import copy_to_huge_pages
from models.kv_cache import PagedKvCache, decode_block_table
from models.moe import SparseMoeBlock
from models.quantization import Fp16Weight, Int8Weight
from models.transformer import DecoderModel, Linear

SOURCE = Path(__file__).with_name("native") / "decode_step.cpp"
FLAGS = ("-O3", "-std=c++17", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-shared")
CPU_FLAGS = ("avx2", "fma", "f16c")
ABI_VERSION = 2
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "tandem" / "native"
KINDS = {torch.float32: 0, torch.float16: 1, torch.int8: 2, torch.bfloat16: 4}  # weight dtype -> TdLinear.kind
DTYPES = (torch.float32, torch.bfloat16)  # a model's --dtype the step runs (its activations: float32 either way)
INT8_DOT = 3  # int8 weights times int8 activations


class _Linear(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("unused", ctypes.c_int32), ("w", ctypes.c_void_p),
                ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("qkv", _Linear), ("o", _Linear), ("gate", _Linear), ("up", _Linear),
                ("down", _Linear), ("k_pool", ctypes.c_void_p), ("v_pool", ctypes.c_void_p)]


class _Model(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("inter", ctypes.c_int64), ("vocab", ctypes.c_int64),
                ("n_layers", ctypes.c_int64), ("block_size", ctypes.c_int64), ("eps", ctypes.c_float),
                ("attn_scale", ctypes.c_float), ("embed", ctypes.c_void_p), ("final_norm", ctypes.c_void_p),
                ("head", _Linear), ("layers", ctypes.POINTER(_Layer)), ("bf16", ctypes.c_int32),
                ("unused", ctypes.c_int32)]


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def compiler() -> str | None:
    """The C++ compiler the library is built with: $CXX, else g++ (None: neither on the PATH)."""
    return shutil.which(os.environ.get("CXX") or "g++")


def machine_refusal() -> str | None:
    """Why this machine cannot run the native step (its CPU, no compiler); None when it can."""
    missing = [f for f in CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    if compiler() is None:
        return "no C++ compiler (g++, or $CXX) on the PATH to build it"
    return None


def native_refusal(model: DecoderModel, kv: PagedKvCache) -> str | None:
    """Why this model (on this machine) cannot run the native step; None when it can."""
    weight = model.model.embed_tokens.weight
    if weight.device.type != "cpu":
        return f"it runs on CPUs; this model is on {weight.device.type}"
    if weight.dtype not in DTYPES or kv.k.dtype != weight.dtype:
        return f"it runs --dtype float32 or bfloat16 models, not {str(weight.dtype).removeprefix('torch.')}"
    if weight.dtype != torch.float32 and any(isinstance(m, Linear) and m.quant is not None for m in model.modules()):
        return "--quantization needs --dtype float32 in it"
    if any(isinstance(m, SparseMoeBlock) for m in model.modules()):
        return "MoE layers are not in the native step"
    if any(m.in_features % 8 for m in model.modules() if isinstance(m, Linear)):
        return "a linear layer's input size is not a multiple of 8"
    return machine_refusal()


def build_library(cache_dir: Path | None = None) -> Path:
    """Compiles decode_step.cpp (and the header it includes) once per (sources, compiler, flags) into cache_dir (default
    ~/.cache/tandem/native) and returns the library's path. Raises RuntimeError if the compiler fails."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, or $CXX) on the PATH")
    source = b"".join(f.read_bytes() for f in sorted(SOURCE.parent.iterdir()) if f.suffix in (".cpp", ".h"))
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256(source + repr((version, FLAGS)).encode()).hexdigest()[:16]
    directory = cache_dir or DEFAULT_CACHE_DIR
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: a private directory for this process
        directory = Path(tempfile.mkdtemp(prefix="tandem-native-"))
    target = directory / f"tandem_decode_step-{key}.so"
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        done = subprocess.run([cxx, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"compiling the native decode step failed:\n{done.stderr[-4000:]}")
        os.replace(tmp, target)  # atomic: executors building at once each install a whole library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class NativeDecode:
    """The native step over a model and its KV cache; `run` has the signature of CompiledDecode.run."""

    def __init__(self, model: DecoderModel, kv: PagedKvCache, cache_dir: Path | None = None,
                 huge_pages: str = "auto") -> None:
        """huge_pages: the --huge-pages mode of the quantized modes' weight copies (models/huge_pages.py)."""
        reason = native_refusal(model, kv)
        if reason:
            raise ValueError(f"the native decode kernel cannot run here: {reason}")
        self.lib = ctypes.CDLL(str(build_library(cache_dir)))
        if self.lib.tandem_abi_version() != ABI_VERSION:
            raise RuntimeError("the native decode library does not match this Tandem version")
        self.lib.tandem_decode_step.restype = ctypes.c_int
        self.lib.tandem_decode_step.argtypes = [
            ctypes.POINTER(_Model), ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        self.model, self.kv = model, kv
        self.huge_pages = huge_pages
        self._keep: list[torch.Tensor] = []  # every tensor a descriptor points into
        self._desc: _Model | None = None
        self._desc_of: tuple[torch.Tensor, int] | None = None  # (the K pool, the weights' version) described
        self._layers: ctypes.Array | None = None  # the layer descriptors _desc points into
        self.calls = 0  # decode steps that ran natively (read by tests and benchmarks)

    def _weights(self, m: Linear) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, bool]:
        """m's weight in the form the step reads, its scales and bias, and whether the weight is a copy
        (quantized weights are unpacked from FBGEMM's packing; float32 ones are read in place)."""
        q = m.quant
        if q is None:
            return m.weight.detach().contiguous(), None, m.bias, False
        if isinstance(q, Fp16Weight):
            w32, bias = torch.ops.quantized.linear_unpack_fp16(q._packed)
            return w32.to(torch.float16), None, bias, True
        if isinstance(q, Int8Weight):
            if q.qweight is not None:
                return q.qweight, q.scales, q.bias, False  # (the portable kernel's own int8 weight)
            qw, _ = torch.ops.quantized.linear_unpack(q._packed)
            return qw.int_repr(), qw.q_per_channel_scales(), q.bias, True
        raise ValueError(f"no native kernel for {type(q).__name__}")

    def _linears(self, mods: list[Linear]) -> list[_Linear]:
        """Descriptors of the modules' weights; the copies (quantized weights) share one huge-page arena."""
        raw = [self._weights(m) for m in mods]
        moved = iter(copy_to_huge_pages([w for w, _, _, copied in raw if copied], self.huge_pages))
        out = []
        for w, scale, bias, copied in raw:
            w = next(moved) if copied else w
            scale, bias = (None if t is None else t.detach().float().contiguous() for t in (scale, bias))
            self._keep.extend(t for t in (w, scale, bias) if t is not None)
            kind = KINDS[w.dtype]
            if kind == KINDS[torch.int8] and w.shape[1] % 32 == 0:
                kind = INT8_DOT  # integer dot products with two-digit int8 activations (the module docstring)
            out.append(_Linear(kind, 0, w.data_ptr(), _ptr(scale), _ptr(bias), w.shape[0], w.shape[1]))
        return out

    def _norm(self, norm: nn.Module | None) -> int | None:
        if norm is None:
            return None
        w = norm.weight.detach().float().contiguous()  # (a copy for a bfloat16 model: the step reads float32)
        self._keep.append(w)
        return w.data_ptr()

    def _describe(self) -> _Model:
        """The descriptors (built once; again if the cache's pools were replaced or the weights changed)."""
        if self._desc is not None and self._desc_of[0] is self.kv.k and self._desc_of[1] == self.model.weights_version:
            return self._desc
        model, cfg = self.model, self.model.config
        self._keep = []
        layers = (_Layer * cfg.num_layers)()
        mods = [m for layer in model.model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                            layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]
        linears = self._linears(mods + [model.lm_head])
        for i, layer in enumerate(model.model.layers):
            att = layer.self_attn
            k_pool, v_pool = self.kv.k[i], self.kv.v[i]  # [blocks, block_size, kv_heads, d] views
            layers[i] = _Layer(self._norm(layer.input_layernorm), self._norm(layer.post_attention_layernorm),
                               self._norm(att.q_norm), self._norm(att.k_norm), *linears[5 * i:5 * i + 5],
                               k_pool.data_ptr(), v_pool.data_ptr())
        embed = model.model.embed_tokens.weight.detach()
        self._layers = layers
        self._desc = _Model(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                            cfg.vocab_size, cfg.num_layers, self.kv.block_size, cfg.rms_norm_eps,
                            cfg.head_dim ** -0.5, embed.data_ptr(), self._norm(model.model.norm), linears[-1],
                            layers, int(embed.dtype == torch.bfloat16), 0)
        self._keep.append(embed)
        self._desc_of = (self.kv.k, self.model.weights_version)
        return self._desc

    @torch.inference_mode()
    def run(self, token_ids: Sequence[int], tables: Sequence[Sequence[int]], pasts: Sequence[int]) -> torch.Tensor:
        """One decode step: item i feeds token_ids[i] at position pasts[i] of the cache whose blocks are
        tables[i] (already reserved for it). Returns float32 logits [B, vocab]."""
        desc = self._describe()
        rows, bs = len(token_ids), self.kv.block_size
        vocab = self.model.config.vocab_size
        if rows == 0:
            return torch.empty(0, vocab, dtype=torch.float32)
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.min() < 0 or ids.max() >= vocab:  # the C++ step reads embed[id] unchecked
            raise ValueError(f"token ids must be in [0, {vocab})")
        table = decode_block_table(tables, pasts, bs, rows)
        width = table.shape[1]
        positions = np.asarray(pasts, dtype=np.int64)
        cos, sin = self.model.rotary.cos_sin(torch.from_numpy(positions), torch.float32)  # [B, head_dim] each
        cos, sin = cos.contiguous(), sin.contiguous()
        logits = torch.empty(rows, vocab, dtype=torch.float32)
        failed = self.lib.tandem_decode_step(ctypes.byref(desc), rows, ids.ctypes.data, positions.ctypes.data,
                                             table.ctypes.data, width, cos.data_ptr(), sin.data_ptr(),
                                             logits.data_ptr(), torch.get_num_threads())
        if failed:
            raise torch.OutOfMemoryError("the native decode step could not allocate its scratch memory")
        self.calls += 1
        return logits
