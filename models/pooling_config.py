"""What a checkpoint says about turning its hidden states into one embedding: sentence-transformers' modules.json
and its Pooling module's config.json (mean or last-token pooling, a Normalize module), else last-token pooling
(decoder embedders such as Qwen3-Embedding ship no modules.json, or one that says last token); and whether it
was trained for Matryoshka truncation (config.json's is_matryoshka / matryoshka_dimensions, as vLLM reads them).

A configuration this server cannot reproduce (cls, max or weighted-mean pooling, a Dense projection after the
pooling) gives no default: embedding requests must then name a pooling (the executor's --pooling), and the
`source` says why."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.errors import CheckpointError

POOLINGS = ("last", "mean")
_MODES = {  # 1_Pooling/config.json flags -> our name (None: not served)
    "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last", "pooling_mode_cls_token": None,
    "pooling_mode_max_tokens": None, "pooling_mode_mean_sqrt_len_tokens": None,
    "pooling_mode_weightedmean_tokens": None,
}
_ST = "sentence_transformers.models."
_SERVED_MODULES = {f"{_ST}Transformer", f"{_ST}Pooling", f"{_ST}Normalize"}


@dataclass(frozen=True)
class PoolingConfig:
    default: str | None  # "last" | "mean"; None: the checkpoint asks for a pooling not served (source says)
    source: str  # where the default comes from, for people
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()


def read_pooling_config(model_dir: str | Path, override: str | None = None) -> PoolingConfig:
    """override: the executor's --pooling (last | mean), which wins over the checkpoint's."""
    model_dir = Path(model_dir)
    matryoshka, dims = _matryoshka(model_dir)
    if override is not None:
        if override not in POOLINGS:
            raise ValueError(f"--pooling {override!r}: choose one of {', '.join(POOLINGS)}")
        return PoolingConfig(override, f"--pooling {override}", matryoshka, dims)
    default, source = _from_modules(model_dir) if model_dir.is_dir() else ("last", "not a model directory: last token")
    return PoolingConfig(default, source, matryoshka, dims)


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path.name}: cannot read it as JSON: {exc}") from exc


def _from_modules(model_dir: Path) -> tuple[str | None, str]:
    modules_path = model_dir / "modules.json"
    if not modules_path.is_file():
        return "last", "no sentence-transformers modules.json: last token"
    modules = _read(modules_path)
    if not isinstance(modules, list):
        raise CheckpointError("modules.json: expected a list of modules")
    pooling = [m for m in modules if isinstance(m, dict) and m.get("type") == f"{_ST}Pooling"]
    other = [m.get("type") for m in modules if isinstance(m, dict) and m.get("type") not in _SERVED_MODULES]
    if other:
        return None, f"modules.json has {other[0]!r} after the transformer, which this server does not apply"
    if not pooling:
        return "last", "modules.json has no Pooling module: last token"
    path = model_dir / str(pooling[0].get("path") or "") / "config.json"
    if not path.is_file():
        raise CheckpointError(f"modules.json names a Pooling module at {pooling[0].get('path')!r} without config.json")
    cfg = _read(path)
    on = [k for k in _MODES if cfg.get(k)]
    where = f"{pooling[0].get('path')}/config.json"
    if len(on) != 1:
        return None, f"{where} sets {on or 'no pooling mode'}; this server serves exactly one of mean or last token"
    mode = _MODES[on[0]]
    if mode is None:
        return None, f"{where}: {on[0]} is not served (mean tokens or last token are)"
    return mode, f"{where}: {on[0]}"


def _matryoshka(model_dir: Path) -> tuple[bool, tuple[int, ...]]:
    path = model_dir / "config.json"
    raw = _read(path) if path.is_file() else {}
    dims = raw.get("matryoshka_dimensions") or ()
    if not isinstance(dims, list) or not all(isinstance(d, int) and d > 0 for d in dims):
        dims = ()
    return bool(dims) or bool(raw.get("is_matryoshka")), tuple(sorted(dims))
