"""Which step runs the executor's decode calls: `--decode-kernel auto | native | torch` and `--compile`.

A decode call here is one whose items each add one token (the native step: plus any drafts) without LoRA
(executor_service/step/batch.py picks per call); everything else always runs the eager PyTorch forward on the same
KV cache.

- native: the C++ step (models/decode/native.py), built at the first start where its cache lacks it; refused,
  with the reason, where it cannot run (the CPU, the model, no compiler) or its build fails.
- torch: the eager PyTorch forward, or the torch.compile'd one with --compile (models/decode/compiled.py).
- auto (default): native where it can run (and builds) and --compile was not asked for, else torch; the log
  says which and why.
"""
from __future__ import annotations

import logging
import time
from typing import Protocol, Sequence

import torch

from executor_service.config import ExecutorConfig
from models.decode.compiled import CompiledDecode, set_compile_cache_dir
from models.kv_cache import PagedKvCache
from models.decode.native import NativeBuild, NativeDecode, native_refusal
from models.transformer import DecoderModel

log = logging.getLogger("tandem.executor")

DECODE_KERNELS = ("auto", "native", "torch")


class DecodeStep(Protocol):
    calls: int  # decode steps it ran
    takes_drafts: bool  # rows of one sequence at consecutive positions in one call (an item's drafts)

    def run(self, token_ids: Sequence[int], tables: Sequence[Sequence[int]],
            pasts: Sequence[int]) -> torch.Tensor: ...  # float32 logits [B, vocab]


def choose_decode_step(config: ExecutorConfig, model: DecoderModel, kv: PagedKvCache,
                       build: NativeBuild | None = None) -> DecodeStep | None:
    """The decode step for this configuration (None: the eager forward). build: how the native kernel is built
    (default: into config.native_cache_dir with $CXX or g++). Raises ValueError for a combination that cannot
    run (the CLI exits 2 with the message)."""
    kernel = config.decode_kernel
    if kernel not in DECODE_KERNELS:
        raise ValueError(f"unknown --decode-kernel {kernel!r}; choose {', '.join(DECODE_KERNELS)}")
    if config.compile:
        if kernel == "native":
            raise ValueError("--compile is the torch decode step; it does not combine with --decode-kernel native")
        return _compile(config, model, kv)
    if kernel == "torch":
        return None
    build = build or NativeBuild(config.native_cache_dir)
    reason = native_refusal(model, kv, build)
    if reason is not None:
        if kernel == "native":
            raise ValueError(f"--decode-kernel native cannot run here: {reason}")
        log.info("decode steps run the PyTorch forward (the native kernel does not apply: %s)", reason)
        return None
    start = time.monotonic()
    try:
        step = NativeDecode(model, kv, build, config.huge_pages)
    except (RuntimeError, OSError) as exc:  # the build failed, or the library would not load
        if kernel == "native":
            raise ValueError(f"--decode-kernel native: {exc}") from exc
        log.warning("decode steps run the PyTorch forward: the native kernel could not be built or loaded (%s)", exc)
        return None
    log.info("decode steps run the native kernel (ready in %.1f s)", time.monotonic() - start)
    return step


def _compile(config: ExecutorConfig, model: DecoderModel, kv: PagedKvCache) -> CompiledDecode:
    """Compiles the decode step now (before the server reports READY), logging how long it took."""
    if config.compile_cache_dir is not None:
        set_compile_cache_dir(config.compile_cache_dir)
    compiled = CompiledDecode(model, kv)  # ValueError: the combination is refused
    log.info("compiling the decode step (one graph for every batch size; minutes on a small CPU)...")
    log.info("decode step compiled in %.1f s", compiled.warm_up())
    return compiled
