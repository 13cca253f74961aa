"""Model shapes people serve, as random checkpoints: `--shape smollm2-1.7b | qwen3-1.7b` of the decode benchmark.

A shape is transformers' own config class (LlamaConfig / Qwen3Config) with the real model's sizes; the tensor names
and shapes are those of transformers' model built from it on the meta device (nothing allocated, nothing
downloaded). The weights are random (normal, std 0.02; norms 1), written once per (shape, dtype) into a cache
directory as sharded safetensors, one shard in memory at a time, with the tiny test tokenizer
(scripts/make_tiny_checkpoint.py). Decode speed and memory depend on the sizes, not on the values.

Also what a run of one measures: the machine's memory bandwidth (a STREAM-like read and copy, torch), to set a
decode step's achieved bandwidth (weight bytes read per step x steps/s) against, and a server's resident memory.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch


DEFAULT_CACHE = Path.home() / ".cache" / "tandem" / "shapes"
SHARD_BYTES = 1 << 30
# name -> (transformers config class, its keyword arguments: the released model's config.json sizes)
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    # the default model's sizes, for a machine that cannot take its 98 MB GGUF along (a lent GPU: scripts/gpu_check)
    "smollm2-135m": ("LlamaConfig", dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, bos_token_id=1, eos_token_id=2)),
    # the same widths and vocabulary, 2 of its 30 layers: every path of the 135M at a fraction of the time
    # (scripts/gpu_check --quick without CUDA: a CPU box, the rehearsal of tests/scripts/test_gpu_bundle.py)
    "smollm2-135m-2l": ("LlamaConfig", dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, bos_token_id=1, eos_token_id=2)),
    "smollm2-1.7b": ("LlamaConfig", dict(
        vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
        num_key_value_heads=32, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 130000.0}, bos_token_id=1, eos_token_id=2)),
    "qwen3-1.7b": ("Qwen3Config", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=1, eos_token_id=2)),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_checkpoint(out: Path, config_class: str, config: dict[str, Any], dtype: str = "float32",
                    seed: int = 0, device: str = "cpu") -> Path:
    """A random checkpoint of transformers' `config_class(**config)` in `out` (config.json, safetensors shards
    with their index, tokenizer). Returns `out`. device: where the values are drawn (a GPU draws a 1.7B shape's in
    a second, a CPU core in about a minute; other values, the same sizes)."""
    import transformers
    from safetensors.torch import save_file
    cfg = getattr(transformers, config_class)(**config, dtype=dtype)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    cfg.architectures = [type(model).__name__]
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    cfg.to_json_file(str(out / "config.json"))
    gen = torch.Generator(device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    files = 0

    def flush() -> None:
        nonlocal files
        files += 1
        name = f"model-{files:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    for name, shape in shapes.items():
        t = (torch.ones(shape, dtype=DTYPES[dtype]) if len(shape) == 1 else
             torch.randn(shape, generator=gen, device=device).mul_(0.02).to(DTYPES[dtype]).cpu())
        if shard and sum(v.nbytes for v in shard.values()) + t.nbytes > SHARD_BYTES:
            flush()
        shard[name] = t
    flush()
    total = sum(torch.Size(s).numel() * DTYPES[dtype].itemsize for s in shapes.values())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=1))
    import make_tiny_checkpoint  # scripts/ (on sys.path: benchmarks/__init__.py)
    make_tiny_checkpoint._write_tokenizer(out)
    return out


def shape_checkpoint(shape: str, dtype: str = "float32", cache_dir: Path | None = None, device: str = "cpu") -> Path:
    """The random checkpoint of a named shape (SHAPES), made once into the cache (a finished one has its index)."""
    out = (cache_dir or DEFAULT_CACHE) / f"{shape}-{dtype}"
    if not (out / "model.safetensors.index.json").is_file():
        config_class, config = SHAPES[shape]
        make_checkpoint(out, config_class, config, dtype, device=device)
    return out


def parameter_counts(model_dir: Path) -> tuple[int, int]:
    """(every parameter, those of the embedding table) of a safetensors checkpoint, read from its headers."""
    from safetensors import safe_open
    total = embedding = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                n = torch.Size(h.get_slice(name).get_shape()).numel()
                total += n
                embedding += n if name.endswith("embed_tokens.weight") else 0
    return total, embedding


def weight_bytes(model_dir: Path) -> int:
    """The checkpoint's tensor bytes (a tied LM head once)."""
    from safetensors import safe_open
    total = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            sizes = {"F32": 4, "BF16": 2, "F16": 2}
            total += sum(torch.Size(h.get_slice(n).get_shape()).numel() * sizes[h.get_slice(n).get_dtype()]
                         for n in h.keys())
    return total


def bytes_read_per_step(model_dir: Path, tied: bool, bytes_per_weight: float) -> float:
    """Weight bytes one decode step reads (once for its whole batch): every parameter but an untied embedding
    table (a step reads one row of it), at `bytes_per_weight`."""
    total, embedding = parameter_counts(model_dir)
    return (total - (0 if tied else embedding)) * bytes_per_weight


def memory_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> dict[str, float]:
    """Bytes/s of a read (a sum over nbytes) and of a copy (nbytes read + nbytes written), the best of `repeats`,
    with torch's threads: the limit a decode step that streams its weights can approach."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = {"read": 0.0, "copy": 0.0}
    for _ in range(repeats):
        t0 = time.perf_counter()
        src.sum()
        t1 = time.perf_counter()
        dst.copy_(src)
        t2 = time.perf_counter()
        best["read"] = max(best["read"], nbytes / (t1 - t0))
        best["copy"] = max(best["copy"], 2 * nbytes / (t2 - t1))
    return best
