"""Output: plain-text tables, the JSON results file and the machine / model header they carry."""
from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch


def fmt(value: Any, digits: int = 2) -> str:
    """A table cell: None -> '-', floats with `digits` decimals (3 significant digits when tiny)."""
    if value is None:
        return "-"
    if isinstance(value, float) and not (math.isnan(value) or math.isinf(value)):
        return f"{value:.3g}" if value != 0 and abs(value) < 10 ** -digits else f"{value:.{digits}f}"
    return str(value)


def format_table(rows: Iterable[dict[str, Any]], columns: Sequence[tuple]) -> str:
    """columns: (key, header) or (key, header, decimals). Text columns are left-aligned, numbers right."""
    rows = list(rows)
    cols = [(c[0], c[1], c[2] if len(c) > 2 else 2) for c in columns]
    cells = [[fmt(r.get(key), digits) for key, _, digits in cols] for r in rows]
    numeric = [all(isinstance(r.get(key), (int, float)) or r.get(key) is None for r in rows) for key, _, _ in cols]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, (_, h, _) in enumerate(cols)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    return "\n".join([line([h for _, h, _ in cols]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells])


def table(rows: list[dict[str, Any]], digits: int = 2) -> str:
    """A table whose headers are its rows' keys (the first row's order)."""
    return format_table(rows, [(k, k, digits) for k in rows[0]]) if rows else "(no rows)"


def write_json(path: str | Path, payload: Any) -> Path:
    """Creates the parent directory and writes indented JSON."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def machine_info(device: torch.device | str = "cpu") -> dict[str, Any]:
    """CPU model and count, torch version and threads, device: the JSON header of every benchmark (machines
    are noisy and differ: results are read as ratios, with the CPU they ran on)."""
    device = torch.device(device)
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "processor": _cpu_model(), "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
        "device": str(device), "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    try:
        import transformers
        info["transformers_version"] = transformers.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        info.update(device_name=torch.cuda.get_device_name(device), cuda_version=torch.version.cuda)
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def model_line(model_dir: Path, cfg: Any) -> str:
    """`model: NAME  (architecture, layers, hidden, heads, vocab)`; cfg: the executor's ModelConfig."""
    return (f"model: {model_dir.name}  ({cfg.architecture}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
            f"{cfg.num_heads} heads / {cfg.num_kv_heads} kv, vocab {cfg.vocab_size})")


def model_json(model_dir: Path, cfg: Any) -> dict[str, Any]:
    """The JSON `model` entry: directory, name and shape."""
    return {"dir": str(model_dir), "name": model_dir.name, "architecture": cfg.architecture,
            "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "num_heads": cfg.num_heads,
            "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size}
