"""Which paged-attention implementation the eager forward uses (`--attention-backend`), and the builder of each
batch's attention metadata for it.

- gathered (models/attention/paged.py): each item's K/V gathered through its block table into a dense copy, one
  SDPA call per bucket. The tested reference.
- flex (models/attention/flex.py): FlexAttention over the pool in place, a BlockMask listing each item's
  blocks; compiled with torch.compile (the eager form scores every key of the pool: a reference only).
- flashinfer (models/attention/flashinfer.py): FlashInfer's paged prefill kernel; CUDA with flashinfer
  installed only, untested on this project's machines.

A model whose image tokens attend to each other both ways (Gemma 3: VisionConfig.bidirectional_images) runs
gathered, the one backend whose masks apply that; auto picks it, the others are refused.

auto: on CUDA, flashinfer where importable (and the model has no sinks), else flex compiled; on CPU, gathered,
measured faster for prefill than flex (SmolLM2, 512-token prompt, 2 cores: table in docs/cuda.md). On CPU the
decode step stays the native one (executor_service/step/decode_choice.py) whatever the backend.
"""
from __future__ import annotations

import importlib.util
from typing import Sequence

import torch

from models.attention.paged import AttentionMetadata, ItemLayout
from models.attention.flex import FlexMetadata
from models.kv.paged_cache import PagedKvCache

BACKENDS = ("auto", "flex", "flashinfer", "gathered")

Metadata = AttentionMetadata | FlexMetadata  # (FlashInferMetadata has the same interface)


def flashinfer_importable() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def choose_backend(requested: str, device: torch.device, has_sinks: bool = False, kv_converted: bool = False,
                   block_size: int = 16, bidirectional_images: bool = False) -> str:
    """The backend to run for --attention-backend `requested` on `device` (kv_converted: the KV pool's dtype is
    not the activations', --kv-dtype; bidirectional_images: an image's tokens see each other both ways, Gemma 3).
    Raises ValueError for one that cannot run there."""
    if requested not in BACKENDS:
        raise ValueError(f"--attention-backend must be one of {', '.join(BACKENDS)}, got {requested!r}")
    if bidirectional_images:  # only the gathered masks carry ItemLayout.bidirectional (models/attention/paged.py)
        if requested not in ("auto", "gathered"):
            raise ValueError(f"--attention-backend {requested} does not let an image's tokens attend to each other "
                             "both ways, as this model's images need (Gemma 3): use gathered (or auto)")
        return "gathered"
    cuda = device.type == "cuda"
    # compiled flex on CUDA: Triton's key tile (16 at the least) must divide the KV block (models/attention/flex.py)
    flex_fits = not cuda or block_size % 16 == 0
    if requested == "flex" and not flex_fits:
        raise ValueError(f"--attention-backend flex on CUDA needs a --block-size that is a multiple of 16, got "
                         f"{block_size}")
    if requested == "flashinfer":
        if not cuda or not flashinfer_importable():
            raise ValueError("--attention-backend flashinfer needs a CUDA device and the flashinfer-python package")
        if has_sinks:
            raise ValueError("--attention-backend flashinfer does not take attention sinks (GPT-OSS): use flex")
        if kv_converted:  # (its kv_data_type and k/v scales wait for a GPU to be tested on, docs/cuda.md)
            raise ValueError("--attention-backend flashinfer reads a KV pool in the weights' dtype only: use flex "
                             "or gathered with this --kv-dtype")
        return requested
    if requested != "auto":
        return requested
    if cuda and flashinfer_importable() and not has_sinks and not kv_converted:
        return "flashinfer"
    return "flex" if cuda and flex_fits else "gathered"


class AttentionBuilder:
    """Builds one batch's attention metadata for the chosen backend (BatchRunner calls it once per batch)."""

    def __init__(self, backend: str, kv: PagedKvCache, heads: int, kv_heads: int, head_dim: int,
                 device: torch.device, max_elements: int | None = None, compile_flex: bool | None = None,
                 dtype: torch.dtype | None = None) -> None:
        if backend not in BACKENDS[1:]:
            raise ValueError(f"no attention backend {backend!r} (choose_backend resolves auto)")
        self.backend, self.kv, self.device = backend, kv, device
        self.dtype = kv.k.dtype if dtype is None else dtype  # the activations' (the pool's may differ: --kv-dtype)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.max_elements = max_elements
        # flex compiled on CUDA (eager flex scores every key of the pool); on CPU eager unless told, see
        # models/flex_attention.compiled_flex.
        self.compile_flex = device.type == "cuda" if compile_flex is None else compile_flex

    def __call__(self, items: Sequence[ItemLayout]) -> Metadata:
        kv = self.kv
        if self.backend == "flex":
            return FlexMetadata(items, kv.block_size, kv.k.shape[1], self.device,
                                kv.null_block if kv.window is not None else None, self.compile_flex,
                                converted=kv.k.dtype != self.dtype)
        if self.backend == "flashinfer":
            from models.attention.flashinfer import FlashInferMetadata  # noqa: PLC0415 (imports flashinfer)
            return FlashInferMetadata(items, kv.block_size, self.heads, self.kv_heads, self.head_dim,  # type: ignore[return-value]
                                      self.device, kv.k.dtype)
        return AttentionMetadata(items, kv.block_size, self.heads // self.kv_heads, self.device, self.dtype,
                                 self.max_elements)
