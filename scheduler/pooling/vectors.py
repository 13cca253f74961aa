"""What a client gets of an embedding: cut to `dimensions` and normalised again (Matryoshka models only, as
vLLM allows it), and written as floats or as base64 of little-endian float32 (OpenAI's encoding_format)."""
from __future__ import annotations

import base64
from typing import Sequence

import numpy as np

from scheduler.executor.info import PoolingFacts
from scheduler.pooling.inputs import FieldError


def check_dimensions(dimensions: int | None, facts: PoolingFacts, hidden_size: int, model: str) -> None:
    if dimensions is None:
        return
    if not facts.matryoshka:
        raise FieldError("dimensions", f"model {model!r} does not support dimensions: its config.json does not say it "
                         "was trained for Matryoshka truncation (is_matryoshka or matryoshka_dimensions), so a cut "
                         f"embedding would be meaningless; leave dimensions out (embeddings have {hidden_size} values)")
    if facts.matryoshka_dimensions and dimensions not in facts.matryoshka_dimensions:
        raise FieldError("dimensions", f"model {model!r} takes dimensions in {list(facts.matryoshka_dimensions)} "
                         f"(its matryoshka_dimensions), got {dimensions}")
    if not 1 <= dimensions <= hidden_size:
        raise FieldError("dimensions", f"must be in 1..{hidden_size} (the model's embedding size), got {dimensions}")


def shaped(values: Sequence[float], dimensions: int | None) -> np.ndarray:
    """float32 values, cut to `dimensions` and L2-normalised again when given (the executor normalised the
    whole vector; renormalising its prefix is the same as normalising the raw prefix)."""
    vec = np.asarray(values, dtype=np.float32)
    if dimensions is None:
        return vec
    vec = vec[:dimensions]
    norm = float(np.linalg.norm(vec))
    return vec / norm if norm > 0 else vec


def encoded(vec: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
    return vec.astype(np.float64).tolist()
