"""`python -m benchmarks`: --help lists every benchmark NAME (the old scripts/bench_NAME.py suffixes) with a
description, NAME --help gives its flags, an unknown NAME fails with the list."""
from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks import __main__ as entry_point
from tests.conftest import ROOT

NAMES = ["block_kernels", "decode", "device", "disagg", "draft", "executor", "fleet", "forward", "kv_restart", "lora",
         "overload", "prefix", "quantized", "serving", "spec", "startup", "structured", "tp", "vision"]


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_help_lists_every_benchmark_with_a_description():
    proc = bench("--help")
    assert proc.returncode == 0
    listed = [line.split()[0] for line in proc.stdout.split("benchmarks:\n", 1)[1].splitlines() if line.strip()]
    assert listed == NAMES
    assert all(len(line.split()) > 3 for line in proc.stdout.split("benchmarks:\n", 1)[1].splitlines())
    assert not list(ROOT.glob("scripts/bench_*.py"))  # the old wrappers are gone


@pytest.mark.parametrize("name", NAMES)
def test_each_benchmark_has_its_own_help(name, capsys):
    # In this process, through the entry point's own main (the `python -m` spawn is what the tests around this one
    # run; one interpreter per benchmark here would cost ~3 s of CPU each, mostly importing torch).
    with pytest.raises(SystemExit) as ended:
        entry_point.main([name, "--help"])
    out = capsys.readouterr().out
    assert ended.value.code == 0
    assert out.startswith(f"usage: python -m benchmarks {name}") and "--out" in out


def test_an_unknown_name_fails_with_the_list():
    proc = bench("nope")
    assert proc.returncode == 2 and "unknown benchmark 'nope'" in proc.stderr and "structured" in proc.stderr
