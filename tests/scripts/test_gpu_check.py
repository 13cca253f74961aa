"""scripts/gpu_check on a machine without CUDA: says so, prints its table with a row per stage and exits 0 (on a
GPU it runs the CUDA-marked tests and the figures; docs/cuda.md). Its whole run, the CPU parity stage, figures
and serving included, is rehearsed through the bundle in test_gpu_bundle.py (which also checks that stage's row
and $OUT): here every stage is skipped, so the parity tests do not run twice in the suite."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU gpu_check runs the benchmarks (minutes)")
def test_gpu_check_without_cuda_says_so_and_exits_0(tmp_path):
    script = ROOT / "scripts" / "gpu_check"
    assert os.access(script, os.X_OK)
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([str(script), "--quick", "--skip", "tests,figures,serving"], cwd=ROOT, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "PYTHON": sys.executable, "OUT": str(out)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no CUDA device here" in proc.stdout
    rows = {line[:34].strip(): line[34:].split(maxsplit=1) for line in proc.stdout.splitlines()[-5:]}
    assert rows["CUDA tests"] == ["skipped", "--skip tests"], proc.stdout
    assert rows["figures smollm2-135m-2l"] == ["skipped", "--skip figures"], proc.stdout
    assert rows["serving"] == ["skipped", "--skip serving"], proc.stdout
    # $OUT: the table and the logs, as a lent machine returns them (plain names, two files)
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check_logs.tar.gz", "gpu_check_table.txt"]
    assert "CUDA tests" in (out / "gpu_check_table.txt").read_text()


def test_gpu_check_help_and_unknown_arguments():
    script = str(ROOT / "scripts" / "gpu_check")
    shown = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0 and "--skip LIST" in shown.stdout and "--keep DIR" in shown.stdout, shown.stdout
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


def test_the_rows_of_a_stage_killed_at_its_limit_keep_what_it_measured(tmp_path):
    """benchmarks/device_figures.py writes its JSON after each part: gpu_check formats the rows of a partial one."""
    partial = {"batch1_limit_tok_s": 16000.0, "bandwidth_Bps": 4.3e12, "step_bytes": 2.7e8, "device_name": "GPU",
               "attention_note": "flex (compiled): flashinfer-python is not importable here",
               "config": {"shape_name": "smollm2-135m"},
               "runs": [{"graphs": "on", "build_s": 9.0, "capture_s": 4.5, "attention_backend": "flex",
                         "decode": {"1": {"step_ms": 2.0, "tok_s": 500.0}, "64": {"step_ms": 3.2, "tok_s": 20000.0}},
                         "peak_memory_bytes": 2 ** 31, "prefill": {"512": {"first_s": 30.0, "s": 0.01, "tok_s": 51200.0}}},
                        {"graphs": "off"}]}
    path = tmp_path / "figures.json"
    path.write_text(json.dumps(partial))
    rows = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check_rows.py"), "device", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert rows.returncode == 0, rows.stderr
    assert "flex ran (auto here: flex (compiled): flashinfer-python is not importable here)" in rows.stdout
    assert "500 tok/s (2.00 ms/step); 3% of the limit, target >= 50%: BELOW" in rows.stdout, rows.stdout
    assert "20,000 tok/s (3.20 ms/step); target >= 20,000: ok" in rows.stdout, rows.stdout
    assert "capture 4.5 s; peak GPU memory 2.00 GiB" in rows.stdout and "prefill 512 tokens" in rows.stdout
    assert "executor, graphs off" in rows.stdout and "killed before its decode rows" in rows.stdout, rows.stdout
