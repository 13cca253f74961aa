"""The executor's model stack: the model loaded, quantized and laid out for the device, the paged KV pool
sized beside it, the decode step chosen, and the batch runner over them. `build_model_stack` does every
step of that, in its order, once; the Executor (executor_service/executor.py) only serves operations on
what it built.

Order matters: quantize before packing (packing skips quantized weights) and before huge pages (the arena
lives as long as any weight in it); pack before huge pages (the packed layout replaces the plain weights, which
then stay out of the arena) and before sizing the KV pool, so that the pool's share of free memory accounts
for them; the decode step is chosen last, over the model and the pool it runs on.

One resident copy of each weight: the loader maps the checkpoint and releases what it copies, and so do the
huge-page arena and the packed layout (models/memory/mapped_pages.py). A GGUF file's block weights stay in
their blocks (models/quant/blocks.py), views of the mapped file until the huge-page arena copies them. The packed layout replaces the plain weights,
which the native and compiled decode steps read: weights are packed only where decode steps will run the
eager forward (`--decode-kernel torch`, or a model or machine the native step refuses).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from executor_service.config import ExecutorConfig
from executor_service.kv.sizing import build_kv_pool
from executor_service.step.batch import BatchRunner
from executor_service.step.decode_choice import (choose_decode, flag_refusal, keeps_plain_int8, model_flag_refusal,
                                                 runs_eager)
from executor_service.types import KvPoolSizing
from models.attention.backend import AttentionBuilder, choose_backend
from models.config import GenerationDefaults, ModelConfig, read_generation_defaults
from models.decode.compiled import CompiledDecode
from models.decode.step import DecodeStep
from models.half_upcast import MIN_ROWS as HALF_UPCAST_MIN_ROWS
from models.memory.huge_pages import move_parameters_to_huge_pages
from models.kv.paged_cache import PagedKvCache
from models.kv.dtype import kv_dtype_name, resolve_kv_dtype
from models.loader import load_model
from models.memory.mapped_pages import trim_heap
from models.native.library import NativeBuild
from models.quant.blocks import (block_ops_available, block_weights, move_blocks_to_huge_pages, repack_block_weights,
                                 weight_format, weights_summary)
from models.quant.linear import move_int8_to_huge_pages
from models.transformer import DecoderModel

log = logging.getLogger("tandem.executor")


@dataclass(frozen=True)
class ModelStack:
    """What build_model_stack built. The objects themselves are live (the runner keeps LoRA stacks, the pool
    its blocks); the stack only fixes which ones they are."""

    device: torch.device
    model: DecoderModel
    model_config: ModelConfig
    generation: GenerationDefaults  # stopping ids from generation_config.json (else config.json)
    quantization_kernel: str | None  # the kernel of --quantization; None: weights as loaded
    kv: PagedKvCache
    kv_pool: KvPoolSizing  # how the pool was sized, and why
    decode_step: DecodeStep | None  # all-decode batches run it; None: the eager forward
    runner: BatchRunner
    attention_backend: str = "gathered"  # the eager forward's paged attention (models/attention/backend.py)
    decode_capabilities: tuple[str, ...] = ()  # GetInfo capabilities of the decode choice (step/decode_choice.py)
    weight_format: str = "float"  # "float" or a GGUF file's block formats kept ("gguf-blocks:Q4_K+Q6_K")

    @property
    def compiled(self) -> CompiledDecode | None:
        """The decode step when it is the torch.compile'd one (--compile)."""
        return self.decode_step if isinstance(self.decode_step, CompiledDecode) else None

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (of the LM head: quantized linears keep it as their output dtype)."""
        return self.model.lm_head.weight.dtype

    @property
    def kv_dtype(self) -> str:
        """The KV pool's dtype, as --kv-dtype spells it (GetInfoResponse.kv_dtype)."""
        return kv_dtype_name(self.kv.k.dtype)


def build_model_stack(config: ExecutorConfig) -> ModelStack:
    """Loads the model of config.model_dir onto config's device and builds everything a batch runs on.
    Raises ValueError for a combination that cannot run (the CLI exits 2 with the message)."""
    device = config.resolve_device()
    if reason := flag_refusal(config):
        raise ValueError(reason)  # before loading: the flags alone refuse it
    model = load_model(config.model_dir, device, config.dtype, progress=config.progress,
                       gguf_dequantize=config.gguf_dequantize)
    # (int8 where the native step runs decode: the plain int8 weights it reads in place, not FBGEMM's copy)
    kernel = model.quantize(config.quantization, force_dequant=keeps_plain_int8(config, model))  # before packing
    if reason := model_flag_refusal(config, model):
        raise ValueError(reason)  # weights in block formats (a GGUF file's, --quantization int4) refuse the flags
    prepare_block_weights(model, NativeBuild(config.native_cache_dir))  # (GGUF blocks and --quantization int4)
    if kernel:
        log.info("linear weights quantized to %s (%s kernel)", config.quantization, kernel)
    # CPU float32 with the eager decode step: the linear weights in oneDNN's packed layout instead of the plain
    # one. Before the KV pool is sized, so that the pool's share of free memory accounts for them.
    if config.cpu_packed_weights and runs_eager(config, model):
        model.pack_cpu_weights()
    if device.type == "cpu":  # (after quantizing: the arena lives as long as any weight in it)
        move_parameters_to_huge_pages(model, config.huge_pages)
        # GGUF blocks too (else views of the mapped file): measured on SmolLM2 Q4_1, 2 cores, the eager
        # forward's decode step ~20% faster (p10 88 -> 71 ms), the same RSS (the file's pages released)
        move_blocks_to_huge_pages(model, config.huge_pages)
        move_int8_to_huge_pages(model, config.huge_pages)  # (plain int8 weights, which the native step reads)
    repack_for_kernels(model)  # (after the arena: rewritten in place there)
    if model.upcast_cpu_half_linears():  # bf16/fp16 on a CPU without oneDNN support for it
        log.info("%s weights on a CPU without oneDNN support for them: linear calls of %d+ rows (prefill) "
                 "multiply in float32", str(model.lm_head.weight.dtype).removeprefix("torch."),
                 HALF_UPCAST_MIN_ROWS)
    cfg, dtype = model.config, model.lm_head.weight.dtype
    kv_dtype = resolve_kv_dtype(config.kv_dtype, dtype)  # another than the weights': converted (models/kv/dtype.py)
    both_ways = cfg.vision is not None and cfg.vision.bidirectional_images  # (Gemma 3's images: gathered only)
    backend = choose_backend(config.attention_backend, device, cfg.attention_sinks, kv_dtype != dtype,
                             config.block_size, both_ways)  # ValueError
    kv, kv_pool = build_kv_pool(config, device, cfg, kv_dtype)  # sized, logged there
    choice = choose_decode(config, model, kv, AttentionBuilder(  # ValueError: a refused combination
        backend, kv, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, device, config.attention_bound(), dtype=dtype))
    trim_heap()  # the copies' sources freed under glibc's mmap threshold stay in its heap otherwise
    return ModelStack(device=device, model=model, model_config=cfg,
                      generation=read_generation_defaults(config.model_dir, cfg), quantization_kernel=kernel,
                      kv=kv, kv_pool=kv_pool, decode_step=choice.step, runner=choice.runner,
                      attention_backend=backend, decode_capabilities=choice.capabilities,
                      weight_format=weight_format(model))


def repack_for_kernels(model: DecoderModel) -> None:
    """Q4_0 / Q4_K / Q6_K rows repacked 8 by 8 for the native block kernels (in place: one copy), logged."""
    start = time.monotonic()
    if moved := repack_block_weights(model):
        log.info("%.0f MiB of Q4_0 / Q4_K / Q6_K weights repacked 8 rows by 8 for the block kernels in %.1f s",
                 moved / (1 << 20), time.monotonic() - start)


def prepare_block_weights(model: DecoderModel, build: NativeBuild) -> None:
    """With weights in GGUF block formats: loads their native kernels (built on a first start) and logs what
    the weights are and what runs them."""
    blocks = block_weights(model)
    if blocks:
        native = block_ops_available(build)
        log.info("weights: %s; block weights run %s", weights_summary(model),
                 "the native block kernels" if native else "the numpy dequantizer (slow)")

