"""What a --model path names, decided one way by both processes: a GGUF file (llama.cpp's format: the
executor loads its tensors, the scheduler its tokenizer) or else a checkpoint directory."""
from __future__ import annotations

from pathlib import Path

GGUF_SUFFIX = ".gguf"


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF file, by its suffix in any case (the magic is checked when it is opened:
    models/gguf/file.py)."""
    return Path(path).suffix.lower() == GGUF_SUFFIX
