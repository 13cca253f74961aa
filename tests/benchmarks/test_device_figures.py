"""`python -m benchmarks device` (scripts/gpu_check's figures stage; its whole run on the CPU is rehearsed in
tests/scripts/test_gpu_bundle.py): what it refuses before loading anything. In this process, through the entry
point's own main (tests/benchmarks/test_entry_point.py runs the `python -m benchmarks` spawn; one interpreter per
refusal here cost ~3.5 s of CPU each, mostly importing torch)."""
from __future__ import annotations

import pytest

from benchmarks import __main__ as entry_point
from tests.conftest import ROOT


def device(capsys, *args: str) -> str:
    """The refusal's stderr; fails unless the benchmark exited 2 (argparse's usage error) before running."""
    with pytest.raises(SystemExit) as ended:
        entry_point.main(["device", *args])
    err = capsys.readouterr().err
    assert ended.value.code == 2, err
    return err


def test_one_of_model_and_shape(capsys):
    for args in ((), ("--shape", "smollm2-135m", "--model", str(ROOT))):
        assert "give one of --model DIR and --shape NAME" in device(capsys, *args)


def test_cuda_graphs_need_cuda(capsys):
    assert "--graphs: CUDA graphs need --device cuda" in device(capsys, "--shape", "smollm2-135m", "--graphs", "on")
