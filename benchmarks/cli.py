"""Command-line pieces the benchmarks share: flags worded once, --quick presets, comma lists, the log line."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

from benchmarks.runtime import DTYPES

MODEL_HELP = "HF model directory (default: SmolLM2-135M-Instruct via scripts/prepare_default_model.py)"


def make_log(benchmark: str) -> Callable[[str], None]:
    """A function printing `[benchmark] message` to stderr (stdout holds the tables)."""
    def log(msg: str) -> None:
        print(f"[{benchmark}] {msg}", file=sys.stderr, flush=True)
    return log


def parser(doc: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A parser described by the docstring's first paragraph, kept as written."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)


def add_model_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", type=Path, default=None, help=MODEL_HELP)


def add_batch_args(ap: argparse.ArgumentParser, defaults: dict[str, Any]) -> None:
    """--batches and --context of a decode benchmark (defaults: the preset the help quotes)."""
    ap.add_argument("--batches", default=None, help=f"decode batch sizes (default {defaults['batches']})")
    ap.add_argument("--context", type=int, default=None,
                    help=f"tokens per sequence before decoding (default {defaults['context']})")


def add_process_args(ap: argparse.ArgumentParser, executor_note: str) -> None:
    """--executor-args, --scheduler-args and --request-timeout of a benchmark that starts real servers.
    executor_note: what the benchmark's own executor flags are (the extra ones come after them)."""
    ap.add_argument("--executor-args", default="",
                    help="extra arguments for `python -m executor_service`, one shell-quoted string given with '=' "
                         f"(--executor-args='--max-batch-tokens 4096'); {executor_note}")
    ap.add_argument("--scheduler-args", default="",
                    help="extra arguments for `python -m scheduler`, one shell-quoted string given with '=', e.g. "
                         "--scheduler-args='--max-batch-tokens 2048 --max-running 64' (default: none, the "
                         "scheduler's defaults)")
    ap.add_argument("--request-timeout", type=float, default=600.0,
                    help="gRPC deadline of each Generate call in seconds (default 600)")


def add_device_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="default cpu")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="default float32")


def add_out_args(ap: argparse.ArgumentParser, benchmark: str, quick_help: str) -> None:
    """--out (bench_results/<benchmark>.json) and --quick (a smoke run's preset)."""
    ap.add_argument("--out", type=Path, default=Path(f"bench_results/{benchmark}.json"), help="JSON results file")
    ap.add_argument("--quick", action="store_true", help=quick_help)


def parse_with_preset(ap: argparse.ArgumentParser, argv: list[str] | None, quick: dict[str, Any],
                      defaults: dict[str, Any]) -> argparse.Namespace:
    """Parses argv, then fills the flags left unset from the --quick or the default preset."""
    args = ap.parse_args(argv)
    apply_preset(args, quick if args.quick else defaults)
    return args


def apply_preset(args: argparse.Namespace, preset: dict[str, Any], keep_unset: tuple[str, ...] = ()) -> None:
    """Fills the flags left unset (None) from the --quick or default preset; explicit flags win."""
    for key, value in preset.items():
        if getattr(args, key, None) is None and key not in keep_unset:
            setattr(args, key, value)


def int_list(text: str, flag: str) -> list[int]:
    """Parses a comma-separated list of positive integers given to `flag`, or exits with a message."""
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{flag}: expected comma-separated integers, got {text!r}")
    if not values or any(v < 1 for v in values):
        raise SystemExit(f"{flag}: expected positive integers, got {text!r}")
    return values
