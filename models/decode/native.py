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

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from models.memory.huge_pages import copy_to_huge_pages
from models.kv.paged_cache import PagedKvCache, decode_block_table
from models.moe import SparseMoeBlock
from models.quant.linear import Fp16Weight, Int8Weight
from models.transformer import DecoderModel, Linear

log = logging.getLogger("tandem.native")

SOURCE_DIR = Path(__file__).resolve().parent.parent / "native"  # models/native/
SOURCES = ("decode_step.cpp", "op.cpp")  # (+ the headers they include: every .h in SOURCE_DIR)
NAME = "tandem_decode_step"
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")  # cpp_extension adds -fPIC, -std and torch's own
LDFLAGS = ("-fopenmp",)  # libgomp.so.1: at run time the one torch has loaded (the same soname)
CPU_FLAGS = ("avx2", "fma", "f16c")
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "tandem" / "native"
BUILD_SECONDS = 30  # the log line's estimate of a first build (measured 22-30 s on 2 busy cores)
BUILD_TIMEOUT_S = 900  # a build that has not finished by then failed (and a lock file that old is stale)
DTYPES = (torch.float32, torch.bfloat16)  # a model's --dtype the step runs (its activations: float32 either way)


@dataclass(frozen=True)
class NativeBuild:
    """How the kernel is built: into cache_dir (None: ~/.cache/tandem/native), with the C++ compiler cxx (a
    name on the PATH or a path; None: $CXX, else g++)."""
    cache_dir: Path | None = None
    cxx: str | None = None

    def compiler_name(self) -> str:
        return self.cxx or os.environ.get("CXX") or "g++"

    def compiler(self) -> str | None:
        """The compiler's path (None: not found)."""
        return shutil.which(self.compiler_name())


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _ninja_dir() -> str | None:
    """The directory of the ninja that cpp_extension runs: the PATH's, else the `ninja` package's (a venv's
    bin/ is not on the PATH of a server started as .venv/bin/python)."""
    found = shutil.which("ninja")
    if found:
        return os.path.dirname(found)
    try:
        import ninja  # the PyPI package (a runtime dependency)
    except ImportError:
        return None
    return ninja.BIN_DIR if os.path.exists(os.path.join(ninja.BIN_DIR, "ninja")) else None


def machine_refusal(build: NativeBuild | None = None) -> str | None:
    """Why this machine cannot run the native step (its CPU, no compiler or ninja); None when it can."""
    build = build or NativeBuild()
    missing = [f for f in CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    if build.compiler() is None:
        return f"no C++ compiler ({build.compiler_name()}) on the PATH to build it"
    if _ninja_dir() is None:
        return "no ninja (pip install ninja) to build it"
    return None


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


def _key(cxx: str) -> str:
    """What the library depends on: its sources, the compiler, torch (its headers and ABI), Python and flags."""
    source = b"".join(f.read_bytes() for f in sorted(SOURCE_DIR.iterdir()) if f.suffix in (".cpp", ".h"))
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    facts = (os.path.realpath(cxx), version, torch.__version__, sys.version_info[:2], CFLAGS, LDFLAGS)
    return hashlib.sha256(source + repr(facts).encode()).hexdigest()[:16]


# The child's build: torch.utils.cpp_extension.load (ninja, torch's include and library paths and flags);
# loading the library there checks it links.
_BUILD = """
import json, sys
from torch.utils import cpp_extension
try:
    cpp_extension.load(**json.loads(sys.argv[1]), verbose=False, is_python_module=False)
except Exception as exc:  # the reason (a compiler's errors are in its message), not a traceback
    sys.exit(f"{type(exc).__name__}: {exc}")
"""


def build_library(build: NativeBuild | None = None) -> Path:
    """Builds the kernel once per (sources, compiler, torch, flags) into the cache directory and returns the
    library's path (already there: no build). Raises RuntimeError if the build fails or takes over
    BUILD_TIMEOUT_S."""
    build = build or NativeBuild()
    cxx = build.compiler()
    if cxx is None:
        raise RuntimeError(f"no C++ compiler ({build.compiler_name()}) on the PATH")
    key = _key(cxx)
    directory = build.cache_dir or DEFAULT_CACHE_DIR
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: a private directory for this process
        directory = Path(tempfile.mkdtemp(prefix="tandem-native-"))
    target = directory / f"{NAME}-{key}.so"
    if target.exists():
        return target
    work = directory / f"build-{key}"  # cpp_extension's build directory (ninja file, objects, its lock)
    work.mkdir(exist_ok=True)
    lock = work / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > BUILD_TIMEOUT_S:
        lock.unlink(missing_ok=True)  # left by a build that was killed: cpp_extension would wait on it forever
    log.info("building the native decode step (first start, ~%d s)...", BUILD_SECONDS)
    start = time.monotonic()
    env = dict(os.environ, CXX=cxx, PATH=os.pathsep.join(filter(None, (_ninja_dir(), os.environ.get("PATH")))))
    spec = {"name": NAME, "sources": [str(SOURCE_DIR / s) for s in SOURCES], "extra_cflags": list(CFLAGS),
            "extra_ldflags": list(LDFLAGS), "build_directory": str(work)}
    args = [sys.executable, "-c", _BUILD, json.dumps(spec)]
    child = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)  # its own process group: a timeout stops ninja and g++ too
    try:
        output, _ = child.communicate(timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        raise RuntimeError(f"building the native decode step took over {BUILD_TIMEOUT_S} s") from None
    if child.returncode != 0:
        raise RuntimeError(f"building the native decode step failed: {output.strip()[-4000:]}")
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        shutil.copyfile(work / f"{NAME}.so", tmp)
        os.replace(tmp, target)  # atomic: executors building at once each install a whole library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built the native decode step in %.1f s (%s)", time.monotonic() - start, target)
    return target


_loaded: Path | None = None  # the library whose op this process runs (one: TORCH_LIBRARY registers once)
_load_lock = threading.Lock()


def load_kernel(build: NativeBuild | None = None) -> Path:
    """Builds the kernel (if its cache lacks it) and loads it into this process once; returns the library the
    process runs. A later call with another cache directory builds there but keeps the loaded op (the same
    sources: another library would register torch.ops.tandem a second time)."""
    global _loaded
    with _load_lock:
        path = build_library(build)
        if _loaded is None:
            torch.ops.load_library(str(path))
            _loaded = path
        return _loaded


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

    def _linears(self, mods: list[Linear]) -> tuple[list[torch.Tensor], list[torch.Tensor | None],
                                                    list[torch.Tensor | None]]:
        """The modules' weights, scales and biases as the kernel reads them; the copies (quantized weights)
        share one huge-page arena."""
        raw = [self._weights(m) for m in mods]
        moved = iter(copy_to_huge_pages([w for w, _, _, copied in raw if copied], self.huge_pages))
        weights, scales, biases = [], [], []
        for w, scale, bias, copied in raw:
            weights.append(next(moved) if copied else w)
            scales.append(_float(scale))
            biases.append(_float(bias))
        return weights, scales, biases

    def _describe(self) -> torch.ScriptObject:
        """The model as the kernel reads it (made once; again if the cache's pools were replaced or the weights
        changed)."""
        if self._desc is not None and self._desc_of[0] is self.kv.k and self._desc_of[1] == self.model.weights_version:
            return self._desc
        model, cfg = self.model, self.model.config
        layers = model.model.layers
        mods = [m for layer in layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]
        weights, scales, biases = self._linears(mods + [model.lm_head])
        norms = [_float(n.weight) for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        qk_norms = [None if n is None else _float(n.weight) for layer in layers
                    for n in (layer.self_attn.q_norm, layer.self_attn.k_norm)]
        self._desc = torch.classes.tandem.DecodeModel(
            model.model.embed_tokens.weight.detach(), _float(model.model.norm.weight), norms, qk_norms, weights,
            scales, biases, self.kv.k, self.kv.v, cfg.num_heads, cfg.rms_norm_eps, cfg.head_dim ** -0.5)
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
