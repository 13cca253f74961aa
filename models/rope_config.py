"""RopeConfig: a model's rotary embedding settings as config.json states them (read by models/families/,
computed by models/rope.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings. `kind` is transformers' rope_type: default, linear, dynamic, yarn, llama3,
    longrope."""

    theta: float = 10000.0
    kind: str = "default"
    params: dict[str, Any] = field(default_factory=dict)  # factor, low_freq_factor, beta_fast, ...
