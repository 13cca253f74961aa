"""The real argparse parsers of `python -m executor_service` and `python -m scheduler`, for checking
command lines written elsewhere (Kubernetes manifests, scripts/serve.py) against the flags the servers really accept.

Neither CLI exposes its ArgumentParser: each module has a `parse_args(argv)` that builds one and parses at
once. We call it with ArgumentParser.parse_args patched to hand the parser back instead of parsing.
Importing executor_service/__main__.py imports torch (~3 s on a busy 2-core machine), so the parser
function is first run on its own, compiled from the module's source with only the standard library in
scope; if it needs more of its module than that, the module is imported after all (correct, just slower).
"""
from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import os
import sys
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
# Names a module may give the function that builds its parser, in the order they are tried: a pure
# builder if the CLI grows one, else today's parse_args(argv).
BUILDER_NAMES = ("build_parser", "make_parser", "create_parser", "get_parser", "parse_args")
# `-m MODULE` of a container command -> the package whose __main__ holds the CLI (console scripts too).
CLI_MODULES = {"executor_service": "executor_service", "tandem-executor": "executor_service",
               "scheduler": "scheduler", "tandem-scheduler": "scheduler"}


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("parser captured")
        self.parser = parser


def _grab(self, *_args, **_kwargs):
    raise _Captured(self)


def _call_for_parser(fn) -> argparse.ArgumentParser:
    """Runs a builder (no required arguments) or parse_args(argv=[]) and returns the parser it made."""
    needs_argv = any(p.default is inspect.Parameter.empty
                     and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                     for p in inspect.signature(fn).parameters.values())
    with mock.patch.object(argparse.ArgumentParser, "parse_args", _grab), \
            mock.patch.object(argparse.ArgumentParser, "parse_known_args", _grab):
        try:
            made = fn([]) if needs_argv else fn()
        except _Captured as captured:
            return captured.parser
    if isinstance(made, argparse.ArgumentParser):
        return made
    raise AssertionError(f"{fn.__module__}.{fn.__name__} neither returned nor used an ArgumentParser")


def _builder_source(package: str) -> tuple[str, ast.Module] | None:
    path = ROOT / package / "__main__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    name = next((n for n in BUILDER_NAMES if n in functions), None)
    if name is None:
        return None
    future = [node for node in tree.body if isinstance(node, ast.ImportFrom) and node.module == "__future__"]
    return name, ast.Module(body=[*future, functions[name]], type_ignores=[])


def _parser_without_import(package: str) -> argparse.ArgumentParser | None:
    found = _builder_source(package)
    if found is None:
        return None
    name, module = found
    scope = {"__name__": f"{package}.__main__", "argparse": argparse, "Path": Path, "os": os, "sys": sys}
    try:
        exec(compile(module, str(ROOT / package / "__main__.py"), "exec"), scope)  # noqa: S102 (our own source)
        return _call_for_parser(scope[name])
    except NameError:  # the function uses module-level names: import the module instead
        return None


def _parser_by_import(package: str) -> argparse.ArgumentParser:
    module = importlib.import_module(f"{package}.__main__")
    for name in BUILDER_NAMES:
        fn = getattr(module, name, None)
        if callable(fn):
            return _call_for_parser(fn)
    raise AssertionError(f"{package}/__main__.py has none of {BUILDER_NAMES}: update tests/cli_parsers.py")


def cli_parser(package: str) -> argparse.ArgumentParser:
    """The ArgumentParser of `python -m <package>` (executor_service or scheduler)."""
    return _parser_without_import(package) or _parser_by_import(package)


def known_flags(parser: argparse.ArgumentParser) -> set[str]:
    return set(parser._option_string_actions)  # every spelling: --port, -h, ...
