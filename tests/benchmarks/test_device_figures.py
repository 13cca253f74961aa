"""`python -m benchmarks device` (scripts/gpu_check's figures stage; its whole run on the CPU is rehearsed in
tests/scripts/test_gpu_bundle.py): what it refuses before loading anything."""
from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def device(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks", "device", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_one_of_model_and_shape():
    for args in ((), ("--shape", "smollm2-135m", "--model", str(ROOT))):
        proc = device(*args)
        assert proc.returncode == 2 and "give one of --model DIR and --shape NAME" in proc.stderr, proc.stderr


def test_cuda_graphs_need_cuda():
    proc = device("--shape", "smollm2-135m", "--graphs", "on")
    assert proc.returncode == 2 and "--graphs: CUDA graphs need --device cuda" in proc.stderr, proc.stderr
