"""How the executor's decode calls run, decided once at start: the step (models/decode/), the batch runner over it
and the GetInfo capabilities that follow from them, logged once with the reason.

A decode call is one whose items each add one token (the native steps: plus any drafts) without LoRA;
executor_service/step/batch.py sends every other call through the eager PyTorch forward on the same KV cache.

The choice, in order:
- `--deterministic`: every call (not only decode calls) through the row-invariant native step, each row
  sampled alone (DeterministicRunner, docs/deterministic.md); refused where the native step cannot run.
- `--compile`: the torch.compile'd forward (models/decode/compiled.py), compiled before READY.
- `--decode-kernel native | auto`: the C++ step (models/decode/native.py), built at the first start where its
  cache lacks it. native: refused, with the reason, where it cannot run or its build fails; auto: the eager
  forward then, and the log says why.
- the eager forward; on CUDA it replays CUDA graphs (models/decode/cuda_graphs.py) unless --no-cuda-graphs, a
  mixture-of-experts model (data-dependent routing) or a CPU refuses them (--cuda-graphs: refused instead).

What the flags alone refuse is one table, CONFLICTS, read before the model loads (and by the CLI before any
tensor-parallel rank starts); what the model and machine refuse is the native step's own table
(models/decode/native.py `native_refusal`: device, dtype, family features (M-RoPE among them), KV dtype, CPU,
compiler), the compiled step's (models/decode/compiled.py `compile_refusal`), the CUDA-graph rows here
(`_graph_refusal`) and BLOCK_CONFLICTS: the flags that do not combine with weights kept in GGUF block formats
(models/quant/blocks.py), known once the file is loaded (`model_flag_refusal`).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from executor_service.config import ExecutorConfig
from executor_service.step.batch import BatchRunner
from executor_service.step.deterministic import DeterministicRunner
from models.attention.backend import AttentionBuilder
from models.decode.compiled import CompiledDecode, set_compile_cache_dir
from models.decode.cuda_graphs import CudaGraphDecode
from models.decode.deterministic import RowInvariantStep
from models.decode.native import NativeBuild, NativeDecode, model_refusal, native_refusal
from models.decode.step import DecodeStep
from models.kv.paged_cache import PagedKvCache
from models.kv.dtype import resolve_kv_dtype
from models.quant.blocks import block_weights
from models.transformer import DecoderModel
from tandem import capabilities as caps

log = logging.getLogger("tandem.executor")

DECODE_KERNELS = ("auto", "native", "torch")


def _tp(c: ExecutorConfig) -> bool:
    return c.tensor_parallel_size > 1


def _lora(c: ExecutorConfig) -> bool:
    return bool(c.adapters) or c.adapter_root is not None


@dataclass(frozen=True)
class Conflict:
    """A flag (`flag`, asked when `asked`) that does not combine with the rest of the configuration when
    `clashes`; the refusal reads "<flag>: <reason>"."""

    flag: str
    asked: Callable[[ExecutorConfig], bool]
    clashes: Callable[[ExecutorConfig], bool]
    reason: str


_DET: Callable[[ExecutorConfig], bool] = lambda c: c.deterministic  # noqa: E731
_COMPILE: Callable[[ExecutorConfig], bool] = lambda c: c.compile  # noqa: E731
CONFLICTS: tuple[Conflict, ...] = (
    Conflict("--deterministic", _DET, _COMPILE,
             "--compile runs decode steps through the eager (compiled) forward; drop one of them"),
    Conflict("--deterministic", _DET, lambda c: c.decode_kernel == "torch",
             "--decode-kernel torch runs the eager forward; --deterministic needs the native step (auto or native)"),
    Conflict("--deterministic", _DET, _tp,
             "--tensor-parallel-size > 1 sums each matrix product over the ranks (an all-reduce whose order is the "
             "collective's) in the eager forward; run it on one rank"),
    Conflict("--deterministic", _DET, _lora,
             "LoRA adapters (--adapter, --adapter-root) run in the eager forward, whose matrix kernels reduce in an "
             "order that depends on the batch; serve adapters from an executor without --deterministic"),
    Conflict("--compile", _COMPILE, lambda c: c.decode_kernel == "native",
             "--compile is the torch decode step; it does not combine with --decode-kernel native"),
    Conflict("--cuda-graphs", lambda c: c.cuda_graphs is True, _COMPILE,
             "--compile runs decode steps through torch.compile'd code"),
    # Tensor parallelism runs the eager forward with the gathered paged attention on every rank (whole-weight
    # steps cannot run sharded), with the KV pool of this rank's heads.
    Conflict("--tensor-parallel-size", _tp, _COMPILE,
             "--compile (the compiled decode step) does not run sharded; tensor parallelism runs the eager forward"),
    Conflict("--tensor-parallel-size", _tp, lambda c: c.decode_kernel == "native",
             "--decode-kernel native reads whole weights; tensor parallelism runs the eager forward"),
    Conflict("--tensor-parallel-size", _tp, _lora,
             "LoRA adapters (--adapter, --adapter-root) are not sharded by rank yet"),
    Conflict("--tensor-parallel-size", _tp, lambda c: bool(c.kv_tiers.host_gb) or c.kv_tiers.disk_dir is not None,
             "KV tiers (--kv-host-gb, --kv-disk-dir) would hold rank 0's KV heads only"),
    Conflict("--tensor-parallel-size", _tp, lambda c: c.attention_backend not in ("auto", "gathered"),
             "the ranks run the gathered paged attention only (--attention-backend auto or gathered)"),
    Conflict("--tensor-parallel-size", _tp, lambda c: c.kv_dtype != "auto",
             "--kv-dtype other than auto is not sharded yet"),
)


# Flags that do not combine with block weights: (flag, asked, reason); the refusal names --gguf-dequantize.
BLOCK_CONFLICTS: tuple[tuple[str, Callable[[ExecutorConfig], bool], str], ...] = (
    ("--compile", _COMPILE, "torch.compile does not trace the block kernels (or their numpy fallback)"),
)


def model_flag_refusal(config: ExecutorConfig, model: DecoderModel) -> str | None:
    """Why the flags of `config` do not combine with this loaded model's weights ("<flag>: <reason>"); None
    when they do. Asked once the model is loaded (a GGUF file's tensor types decide it)."""
    blocks = block_weights(model)
    if not blocks:
        return None
    formats = "+".join(sorted({f for w in blocks for f in w.formats}))
    way_out = ("pass --quantization int8 or none instead" if config.quantization == "int4" else
               "pass --gguf-dequantize to load them as float")
    for flag, asked, reason in BLOCK_CONFLICTS:
        if asked(config):
            return f"{flag}: the model's weights are in llama.cpp block formats ({formats}): {reason}; {way_out}"

    return None


def flag_refusal(config: ExecutorConfig) -> str | None:
    """Why the flags of `config` do not combine ("<flag>: <reason>", the first row of CONFLICTS that applies);
    None when they do. Asked before the model loads."""
    if config.decode_kernel not in DECODE_KERNELS:
        return f"unknown --decode-kernel {config.decode_kernel!r}; choose {', '.join(DECODE_KERNELS)}"
    for row in CONFLICTS:
        if row.asked(config) and row.clashes(config):
            return f"{row.flag}: {row.reason}"
    return None


def keeps_plain_int8(config: ExecutorConfig, model: DecoderModel) -> bool:
    """Whether --quantization int8 keeps its plain int8 weights (which the native step reads in place) instead of
    FBGEMM's packed ones, so that the weights are held once: where the native step will run the decode calls
    (every call with --deterministic). Not with LoRA adapters, whose decode rows run the eager forward (FBGEMM's
    kernel, and the step's own copy: two copies), nor for a model the native step refuses quantized (not
    float32). Asked before quantizing (model: still float)."""
    if config.quantization != "int8":
        return False
    if config.deterministic:
        return True
    if config.compile or _lora(config) or model.lm_head.weight.dtype != torch.float32:
        return False
    return not runs_eager(config, model)


def runs_eager(config: ExecutorConfig, model: DecoderModel) -> bool:
    """Whether decode calls will run the eager forward (asked before the KV pool exists, to pack weights for it
    only; a native step whose build then fails falls back to the eager forward unpacked, and says so)."""
    if config.compile or config.deterministic:
        return False
    if resolve_kv_dtype(config.kv_dtype, model.lm_head.weight.dtype) != model.lm_head.weight.dtype:
        return True  # the native step reads a pool in the weights' dtype only
    return config.decode_kernel == "torch" or model_refusal(model, NativeBuild(config.native_cache_dir)) is not None


@dataclass(frozen=True)
class DecodeChoice:
    step: DecodeStep | None  # what decode calls run; None: the eager forward
    runner: BatchRunner
    capabilities: tuple[str, ...]  # GetInfo capabilities that follow from the step
    reason: str  # what runs them and why, as logged


def choose_decode(config: ExecutorConfig, model: DecoderModel, kv: PagedKvCache,
                  attention: AttentionBuilder | None = None, build: NativeBuild | None = None) -> DecodeChoice:
    """The step, runner and capabilities for this configuration, model and pool (the steps built, compiled or
    captured now, before READY), logged in one line. attention: the eager forward's paged attention; build: how
    the native kernel is built (default: into config.native_cache_dir with $CXX or g++). Raises ValueError for a
    combination that cannot run (the CLI exits 2 with the message)."""
    choice = _choose(config, model, kv, attention, build or NativeBuild(config.native_cache_dir))
    log.info("decode calls run %s", choice.reason)
    return choice


def _choose(config: ExecutorConfig, model: DecoderModel, kv: PagedKvCache, attention: AttentionBuilder | None,
            build: NativeBuild) -> DecodeChoice:
    why = flag_refusal(config) or model_flag_refusal(config, model)
    if why is not None:
        raise ValueError(why)
    graphs_refused = None if config.cuda_graphs is False else _graph_refusal(model, kv)
    if config.cuda_graphs and graphs_refused is not None:
        raise ValueError(f"--cuda-graphs cannot run here: {graphs_refused}")
    start = time.monotonic()
    if config.deterministic:
        step, _ = _native(RowInvariantStep, model, kv, build, config.huge_pages, "--deterministic")
        return DecodeChoice(step, DeterministicRunner(model, kv, step),
                            capabilities=(caps.NATIVE_DECODE, caps.DETERMINISTIC),
                            reason="the row-invariant native step (--deterministic: every call, each row sampled "
                                   f"alone; ready in {time.monotonic() - start:.1f} s)")
    runner = lambda s: BatchRunner(model, kv, config.attention_bound(), s, attention)  # noqa: E731
    if config.compile:
        compiled = _compile(config, model, kv)
        return DecodeChoice(compiled, runner(compiled), capabilities=(caps.COMPILED_DECODE,),
                            reason=f"the torch.compile'd forward (--compile; compiled in "
                                   f"{time.monotonic() - start:.1f} s)")
    eager = "--decode-kernel torch"
    if config.decode_kernel != "torch":
        native, eager = _native(NativeDecode, model, kv, build, config.huge_pages,
                                "--decode-kernel native" if config.decode_kernel == "native" else None)
        if native is not None:
            return DecodeChoice(native, runner(native), capabilities=(caps.NATIVE_DECODE,),
                                reason=f"the native kernel (ready in {time.monotonic() - start:.1f} s)")
    if config.cuda_graphs is False or graphs_refused is not None:
        graphs = "--no-cuda-graphs" if graphs_refused is None else f"no CUDA graphs: {graphs_refused}"
        return DecodeChoice(None, runner(None), capabilities=(), reason=f"the PyTorch forward ({eager}; {graphs})")
    captured = _capture(config, model, kv)
    return DecodeChoice(captured, runner(captured), capabilities=(caps.CUDA_GRAPHS,),
                        reason=f"CUDA graphs of the PyTorch forward ({eager}; {len(captured.captured)} of "
                        f"{len(captured.buckets)} batch-size buckets up to {config.cuda_graph_max_batch} rows "
                        f"captured in {time.monotonic() - start:.1f} s)")


def _native(kind: type[NativeDecode], model: DecoderModel, kv: PagedKvCache, build: NativeBuild, huge_pages: str,
            required_by: str | None) -> tuple[NativeDecode | None, str]:
    """The native step (kind: plain or row-invariant), or None and why where it cannot run and nothing requires
    it. required_by: the flag that needs it, named in the ValueError raised instead."""
    reason = native_refusal(model, kv, build)
    if reason is None:
        try:
            return kind(model, kv, build, huge_pages), ""
        except (RuntimeError, OSError) as exc:  # the build failed, or the library would not load
            reason = f"the native kernel could not be built or loaded: {exc}"
            if required_by:
                raise ValueError(f"{required_by}: {reason}") from exc
            log.warning("%s", reason)
            return None, reason
    if required_by:
        raise ValueError(f"{required_by}: the native step cannot run here: {reason}")
    return None, f"the native kernel does not apply: {reason}"


def _compile(config: ExecutorConfig, model: DecoderModel, kv: PagedKvCache) -> CompiledDecode:
    """Compiles the decode step now (before the server reports READY), logging how long it took."""
    if config.compile_cache_dir is not None:
        set_compile_cache_dir(config.compile_cache_dir)
    compiled = CompiledDecode(model, kv)  # ValueError: the combination is refused
    log.info("compiling the decode step (one graph for every batch size; minutes on a small CPU)...")
    compiled.warm_up()
    return compiled


def _graph_refusal(model: DecoderModel, kv: PagedKvCache) -> str | None:
    """Why the eager decode forward cannot be captured into CUDA graphs here (None: it can)."""
    if kv.k.device.type != "cuda":
        return f"the device is {kv.k.device.type}, not CUDA"
    if model.config.num_experts:
        return "a mixture-of-experts model routes tokens data-dependently, which a graph cannot capture"
    if model.config.mrope_section:
        return "M-RoPE positions (three per token, from the sequence's images) are computed per call, not captured"
    return None


def _capture(config: ExecutorConfig, model: DecoderModel, kv: PagedKvCache) -> CudaGraphDecode:
    """The graphs captured now, within models/decode/cuda_graphs.py's start-up budget (buckets it leaves
    uncaptured run eagerly, and the log names them)."""
    if config.cuda_graph_max_batch < 1:
        raise ValueError(f"--cuda-graph-max-batch must be >= 1, got {config.cuda_graph_max_batch}")
    graphs = CudaGraphDecode(model, kv, config.cuda_graph_max_batch)
    graphs.capture()
    return graphs
