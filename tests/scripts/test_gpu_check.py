"""scripts/gpu_check on a machine without CUDA: says so, runs the CPU-runnable parity tests, prints its table
and exits 0 (on a GPU it runs the CUDA-marked tests and bench_decode; docs/cuda.md)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU gpu_check runs the benchmarks (minutes)")
def test_gpu_check_without_cuda_says_so_and_exits_0():
    script = ROOT / "scripts" / "gpu_check"
    assert os.access(script, os.X_OK)
    proc = subprocess.run([str(script), "--quick"], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no CUDA device here" in proc.stdout
    assert "parity (CPU)" in proc.stdout and " ok " in proc.stdout, proc.stdout


def test_gpu_check_help_and_unknown_arguments():
    script = str(ROOT / "scripts" / "gpu_check")
    shown = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0 and "--shape NAME" in shown.stdout and "--keep DIR" in shown.stdout, shown.stdout
    refused = subprocess.run([script, "--bogus"], capture_output=True, text=True, timeout=30)
    assert refused.returncode == 2 and "unknown argument --bogus" in refused.stderr, refused.stderr
