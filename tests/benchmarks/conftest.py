"""Fixtures of the benchmark smoke tests: each runs a scripts/bench_*.py command line as a user would."""
from __future__ import annotations

import subprocess
import sys
from typing import Callable

import pytest

from tests.conftest import ROOT


@pytest.fixture
def run_bench() -> Callable[..., subprocess.CompletedProcess]:
    """run_bench("bench_forward", *args, timeout=120) -> the finished process; fails the test (with the script's
    output) unless it exited 0."""
    def run(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / f"{script}.py"), *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        return proc
    return run
