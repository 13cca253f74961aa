"""Random PEFT LoRA adapters of a model for the LoRA benchmark: made with peft itself (lora_B random too, so
every adapter changes the outputs), reused when a kept directory already holds matching ones, and the
size of their low-rank matrices."""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

ADAPTER_PREFIX = "lora-"


def adapter_name(i: int) -> str:
    return f"{ADAPTER_PREFIX}{i}"


def _matches(path: Path, model_dir: Path, args: argparse.Namespace) -> bool:
    """True when path holds a saved PEFT LoRA adapter with this run's rank, alpha, targets and base model."""
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file() or not any(path.glob("adapter_model.*")):
        return False
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError):
        return False
    return (cfg.get("peft_type") == "LORA" and cfg.get("r") == args.rank
            and float(cfg.get("lora_alpha", -1)) == float(args.alpha)
            and sorted(cfg.get("target_modules") or []) == sorted(args.target_list)
            and Path(str(cfg.get("base_model_name_or_path", ""))).resolve() == model_dir.resolve())


def make_adapters(model_dir: Path, root: Path, args: argparse.Namespace, log: Callable[[str], None]
                  ) -> dict[str, Any]:
    """Creates (or reuses) args.num_adapters random LoRA adapters under root; returns timing info."""
    paths = {adapter_name(i): root / adapter_name(i) for i in range(args.num_adapters)}
    todo = [name for name, path in paths.items() if not _matches(path, model_dir, args)]
    info: dict[str, Any] = {"root": str(root), "paths": {k: str(v) for k, v in paths.items()},
                            "created": todo, "reused": [n for n in paths if n not in todo],
                            "import_s": None, "base_load_s": None, "per_adapter_s": {}, "total_s": 0.0}
    if not todo:
        log(f"reusing {len(paths)} adapters from {root}")
        return info
    t_total = time.perf_counter()
    t0 = time.perf_counter()
    import warnings

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)  # peft calls deprecated transformers helpers
    info["import_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    info["base_load_s"] = time.perf_counter() - t0
    for name in todo:
        t0 = time.perf_counter()
        torch.manual_seed(args.seed * 1000 + int(name.removeprefix(ADAPTER_PREFIX)) + 1)
        config = LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=list(args.target_list),
                            lora_dropout=0.0, bias="none", init_lora_weights=False, task_type="CAUSAL_LM")
        peft_model = get_peft_model(base, config)
        path = paths[name]
        if path.exists():
            shutil.rmtree(path)
        peft_model.save_pretrained(path)
        # Record the base model as the directory it came from (peft writes name_or_path), then take the
        # LoRA layers out again (unload: no merge) so the next adapter starts from the plain base model.
        cfg_file = path / "adapter_config.json"
        cfg = json.loads(cfg_file.read_text())
        cfg["base_model_name_or_path"] = str(model_dir.resolve())
        cfg_file.write_text(json.dumps(cfg, indent=2) + "\n")
        base = peft_model.unload()
        info["per_adapter_s"][name] = time.perf_counter() - t0
    del base
    info["total_s"] = time.perf_counter() - t_total
    log(f"created {len(todo)} LoRA adapters (r={args.rank}, alpha={args.alpha:g}, {len(args.target_list)} target "
        f"modules) in {root} in {info['total_s']:.1f}s (peft/transformers import {info['import_s']:.1f}s, base "
        f"model load {info['base_load_s']:.1f}s, per adapter "
        f"{statistics.fmean(info['per_adapter_s'].values()):.2f}s)")
    return info


def lora_params(path: Path) -> tuple[int, int]:
    """(parameters of the adapter's LoRA matrices, targeted linear layers) from its saved weights."""
    from safetensors import safe_open
    files = sorted(path.glob("adapter_model.safetensors"))
    if not files:
        return 0, 0
    total, layers = 0, 0
    with safe_open(str(files[0]), framework="pt") as f:
        for key in f.keys():
            shape = f.get_slice(key).get_shape()
            n = 1
            for d in shape:
                n *= d
            total += n
            layers += "lora_A" in key
    return total, layers
