"""Served models' shapes as GGUF files (the quantized benchmark's inputs): a random float32 checkpoint of a shape
(benchmarks/shapes.py SHAPES) written straight to an F32 GGUF file, then quantized by llama.cpp's own
`llama-quantize`, both cached in a work directory under names keyed by shape, seed and type (a file is renamed
into place once whole, so a cached name is a finished file).

The file is what llama.cpp's convert_hf_to_gguf.py writes for the model: its metadata keys, tensor names, Llama
q/k rows permuted (models/gguf/tensors.py), tied embeddings (no output.weight). Weights: normal (std 0.02, seeded
per tensor), norms 1. Tensors are generated and written one at a time (a 1.7B F32 file is ~7 GB).

The tokenizer is the SmolLM2 one of the shipped SmolLM2-135M GGUF (49152 tokens, byte-level BPE, pre "smollm"),
copied field by field; a larger vocabulary (Qwen3's 151936) is padded with `[PADn]` tokens of type UNUSED, which
is how convert_hf_to_gguf fills ids a vocabulary lacks (Qwen's own files end with such padding): llama.cpp and
Tandem load it, and random prompts draw from the real tokens only.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from benchmarks.shapes import SHAPES

DEFAULT_WORK_DIR = Path.home() / ".cache" / "tandem" / "bench-quantized"
WEIGHT_STD = 0.02
GGUF_ARCH = {"LlamaConfig": "llama", "Qwen3Config": "qwen3"}
# our type name -> llama-quantize's type argument
QUANT_TYPES = {"Q4_K_M": "Q4_K_M", "Q4_0": "Q4_0", "Q8_0": "Q8_0"}
_LAYER = (("attn_norm", "norm"), ("attn_q", "q"), ("attn_k", "k"), ("attn_v", "v"), ("attn_output", "o"),
          ("attn_q_norm", "qn"), ("attn_k_norm", "kn"), ("ffn_norm", "norm"), ("ffn_gate", "gate"),
          ("ffn_up", "up"), ("ffn_down", "down"))


def shape_config(shape: str) -> tuple[str, dict[str, Any]]:
    """(GGUF architecture, the shape's config keyword arguments)."""
    config_class, config = SHAPES[shape]
    return GGUF_ARCH[config_class], config


def head_dim(config: dict[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def tensor_shapes(arch: str, config: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape [rows, columns]) of every tensor, in convert_hf_to_gguf's order (tied: no output)."""
    hidden, inter, d = config["hidden_size"], config["intermediate_size"], head_dim(config)
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    sizes = {"norm": (hidden,), "q": (q, hidden), "k": (kv, hidden), "v": (kv, hidden), "o": (hidden, q),
             "qn": (d,), "kn": (d,), "gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    yield "token_embd.weight", (config["vocab_size"], hidden)
    for layer in range(config["num_hidden_layers"]):
        for name, kind in _LAYER:
            if kind in ("qn", "kn") and arch != "qwen3":
                continue
            yield f"blk.{layer}.{name}.weight", sizes[kind]
    yield "output_norm.weight", (hidden,)
    if not config.get("tie_word_embeddings"):
        yield "output.weight", (config["vocab_size"], hidden)


def random_tensor(name: str, shape: tuple[int, ...], index: int, seed: int, arch: str,
                  config: dict[str, Any]) -> np.ndarray:
    """Tensor `index` of the file: ones for a norm, else normal(0, WEIGHT_STD) from its own seeded stream, Llama
    q/k rows permuted as convert_hf_to_gguf permutes them."""
    if len(shape) == 1:
        return np.ones(shape, dtype=np.float32)
    w = np.random.default_rng([seed, index]).standard_normal(shape, dtype=np.float32)
    w *= np.float32(WEIGHT_STD)
    if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
        from models.gguf.tensors import permute_rope_rows  # numpy only
        heads = config["num_attention_heads" if ".attn_q." in name else "num_key_value_heads"]
        w = permute_rope_rows(w, heads)
    return w


def add_metadata(writer: Any, arch: str, config: dict[str, Any], name: str) -> None:
    """The model keys convert_hf_to_gguf writes for a Llama / Qwen3 model (F32 file)."""
    import gguf
    d = head_dim(config)
    writer.add_name(name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if arch == "qwen3" or "head_dim" in config:
        writer.add_key_length(d)
        writer.add_value_length(d)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch == "llama":
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(d)


def add_tokenizer(writer: Any, source: Path, vocab_size: int) -> None:
    """Every tokenizer.* field of GGUF file `source`, the token list (and its types and scores, if any) padded to
    `vocab_size` with UNUSED `[PADn]` tokens."""
    import gguf
    reader = gguf.GGUFReader(source)
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        value = field.contents()
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        if field.name in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            if len(value) > vocab_size:
                raise ValueError(f"{source}: {len(value)} tokens, more than the shape's vocabulary {vocab_size}")
            pad = {"tokenizer.ggml.tokens": [f"[PAD{i}]" for i in range(len(value), vocab_size)],
                   "tokenizer.ggml.token_type": [int(gguf.TokenType.UNUSED)] * (vocab_size - len(value)),
                   "tokenizer.ggml.scores": [-1000.0] * (vocab_size - len(value))}[field.name]
            value = list(value) + pad
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)


def write_shape_gguf(out: Path, shape: str, seed: int, tokenizer_source: Path,
                     config: dict[str, Any] | None = None, log: Callable[[str], None] = lambda _: None) -> Path:
    """The F32 GGUF file of `shape` (or of `config`, a SHAPES-style dict of the shape's architecture: the tests'
    tiny sizes) at `out`, written to `out`.tmp one tensor at a time, then renamed. Returns `out`."""
    import gguf
    arch, shape_cfg = shape_config(shape)
    config = config or shape_cfg
    tmp = out.with_name(out.name + ".tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(tmp, arch)
    add_metadata(writer, arch, config, f"random {shape}")
    add_tokenizer(writer, tokenizer_source, config["vocab_size"])
    tensors = list(tensor_shapes(arch, config))
    for name, shp in tensors:
        writer.add_tensor_info(name, shp, np.dtype(np.float32), int(np.prod(shp)) * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for i, (name, shp) in enumerate(tensors):
        writer.write_tensor_data(random_tensor(name, shp, i, seed, arch, config))
        if i % 50 == 0:
            log(f"{out.name}: tensor {i + 1}/{len(tensors)}")
    writer.close()
    os.replace(tmp, out)
    return out


def f32_path(work_dir: Path, shape: str, seed: int) -> Path:
    return work_dir / f"{shape}-seed{seed}-F32.gguf"


def quantized_path(work_dir: Path, shape: str, seed: int, qtype: str) -> Path:
    return work_dir / f"{shape}-seed{seed}-{qtype}.gguf"


def ensure_f32(work_dir: Path, shape: str, seed: int, tokenizer_source: Path,
               log: Callable[[str], None] = lambda _: None) -> Path:
    """The cached F32 file of (shape, seed), written first if missing."""
    out = f32_path(work_dir, shape, seed)
    if not out.is_file():
        log(f"writing {out} (random weights, seed {seed})")
        write_shape_gguf(out, shape, seed, tokenizer_source, log=log)
    return out


def quantize(quantize_bin: str, source: Path, out: Path, qtype: str, threads: int) -> Path:
    """llama.cpp's `llama-quantize source out TYPE threads` into out.tmp, renamed once it succeeded."""
    tmp = out.with_name(out.name + ".tmp")
    proc = subprocess.run([quantize_bin, str(source), str(tmp), QUANT_TYPES[qtype], str(threads)],
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama-quantize {qtype} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    os.replace(tmp, out)
    return out


def ensure_quantized(work_dir: Path, shape: str, seed: int, qtype: str, f32: Path, quantize_bin: str | None,
                     threads: int, log: Callable[[str], None] = lambda _: None) -> Path | None:
    """The cached `qtype` file of (shape, seed), quantized from `f32` if missing (None: missing and no
    llama-quantize to make it)."""
    if qtype == "F32":
        return f32
    out = quantized_path(work_dir, shape, seed, qtype)
    if out.is_file():
        return out
    if quantize_bin is None:
        log(f"no llama-quantize: {out.name} cannot be made, its rows are skipped")
        return None
    log(f"llama-quantize {f32.name} -> {qtype}")
    return quantize(quantize_bin, f32, out, qtype, threads)
