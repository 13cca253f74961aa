"""Fixtures of the benchmark smoke tests: each runs `python -m benchmarks NAME ...` as a user would."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

from tests.conftest import ROOT


@pytest.fixture
def run_bench(tmp_path) -> Callable[..., tuple[subprocess.CompletedProcess, Any]]:
    """run_bench("forward", *args, timeout=120) -> (the finished process, its JSON results); fails the test (with
    the benchmark's output) unless it exited 0. The JSON goes under tmp_path (a folder that does not exist yet:
    the benchmark creates it) unless args give --out."""
    def run(name: str, *args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, Any]:
        given = "--out" in args
        out = Path(args[args.index("--out") + 1]) if given else tmp_path / "results" / f"{name}.json"
        extra = [] if given else ["--out", str(out)]
        proc = subprocess.run([sys.executable, "-m", "benchmarks", name, *args, *extra], cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        return proc, (json.loads(out.read_text()) if out.is_file() else None)
    return run
