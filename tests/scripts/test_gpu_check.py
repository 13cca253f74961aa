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


def test_a_missing_dependency_is_named_before_anything_runs(tmp_path):
    """The first lent GPU lost a benchmark to a dependency its Python lacked (fastapi's opentelemetry-api): the
    script now imports what it runs first and names what is missing."""
    shadow = tmp_path / "fastapi"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'opentelemetry'\")\n")
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    proc = subprocess.run([str(ROOT / "scripts" / "gpu_check"), "--quick"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "cannot import what the checks run: ModuleNotFoundError: No module named 'opentelemetry'" in proc.stderr
    assert "parity" not in proc.stdout  # nothing ran
