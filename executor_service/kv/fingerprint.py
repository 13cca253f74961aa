"""The KV fingerprint: what must be equal for KV blocks computed by one executor to be valid in another (or in
the same one after a restart): the model weights, the KV dtype, the block size and the KV layout. ExportKv
sends it in its header, ImportKv refuses a differing one, and the disk tier (kv_tier_disk.py) reopens its
index only under an equal one.

It is a readable `key=value;...` string rather than one opaque digest, so that a refusal can name what differs
("block_size: 16 here, 32 at the source"). The weights part is a digest of the model directory's files: each
weight file's name, size and first and last MiB (the safetensors/GGUF header, with every tensor's name, shape
and offset, is at the start), and config.json whole — cheap at start however big the model, and any re-export
or re-quantization of the weights changes it.
"""
from __future__ import annotations

import hashlib
import uuid
from pathlib import Path

from executor_service.config import ExecutorConfig
from executor_service.model_stack import ModelStack

WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")
_EDGE = 1 << 20  # bytes read at each end of a weight file


def weights_digest(model_path: Path) -> str:
    """16 hex characters identifying the model's weights (see the module docstring)."""
    h = hashlib.blake2b(digest_size=8)
    files = [model_path] if model_path.is_file() else sorted(
        p for p in model_path.iterdir() if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name == "config.json"))
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}\n".encode())
        with f.open("rb") as fh:
            if f.name == "config.json" or size <= 2 * _EDGE:
                h.update(fh.read())
            else:
                h.update(fh.read(_EDGE))
                fh.seek(size - _EDGE)
                h.update(fh.read(_EDGE))
    return h.hexdigest()


def kv_fingerprint(weights: str, weight_format: str, quantization: str, kv_dtype: str, block_size: int,
                   num_layers: int, num_kv_heads: int, head_dim: int, window: int | None) -> str:
    """weight_format: "float" or the GGUF block formats computed on ("gguf-blocks:Q4_K+Q6_K": the same file
    served with --gguf-dequantize computes other K and V); quantization: the linear weights' (it changes every K
    and V computed)."""
    return (f"weights={weights};weight_format={weight_format};quantization={quantization};kv_dtype={kv_dtype};"
            f"block_size={block_size};layout={num_layers}x{num_kv_heads}x{head_dim};window={window or 0}")


def fingerprint_of(config: ExecutorConfig, stack: ModelStack) -> str:
    """The fingerprint of an executor's KV pool (its model, dtype, block size and layout)."""
    kv = stack.kv
    layers, _, bs, heads, dim = kv.k.shape
    mine = kv_fingerprint(weights_digest(config.model_dir), stack.weight_format, config.quantization,
                          str(kv.k.dtype).removeprefix("torch."), bs, layers, heads, dim, kv.window)
    if config.tensor_parallel_size > 1:  # rank 0's pool holds only its KV heads: no transfer may match it
        mine += f";tensor_parallel={config.tensor_parallel_size} ranks, not transferable ({uuid.uuid4().hex[:8]})"
    if config.deterministic:  # its K/V came from the row-invariant step: another executor's are other bits
        mine += ";kernels=deterministic"  # (docs/deterministic.md)
    return mine


def parse(fingerprint: str) -> dict[str, str]:
    parts = (p.partition("=") for p in fingerprint.split(";") if p)
    return {k: v for k, _, v in parts}


def differences(mine: str, theirs: str) -> str:
    """What differs between two fingerprints, for people: "block_size: 16 here, 32 at the source"; "" when
    they are equal."""
    if mine == theirs:
        return ""
    a, b = parse(mine), parse(theirs)
    diffs = [f"{k}: {a.get(k, '(none)')} here, {b.get(k, '(none)')} at the source"
             for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return "; ".join(diffs) or f"{mine!r} here, {theirs!r} at the source"
