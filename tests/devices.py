"""The devices a test whose subject runs on a device is parametrized by (the `device` fixture, tests/conftest.py):
the CPU always, in float32; CUDA marked `cuda` (skipped without a CUDA device; scripts/gpu_check runs them on a
GPU), in bfloat16, the executor's default there. References stay on the CPU in float32, so a CUDA run is compared
to them within bfloat16's tolerance (tests/device_tolerances.py)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.device_tolerances import Tolerance, tolerance


@dataclass(frozen=True)
class Device:
    name: str  # the torch device the subject runs on: "cpu" | "cuda"
    dtype: torch.dtype  # the weights' and activations' dtype there

    @property
    def dtype_name(self) -> str:  # as --dtype / ExecutorConfig.dtype spell it
        return str(self.dtype).removeprefix("torch.")

    @property
    def tol(self) -> Tolerance:
        return tolerance(self.dtype)

    @property
    def exact(self) -> bool:
        """float32: two runs of the same arithmetic in another order agree to the token (the CPU's promise)."""
        return self.dtype == torch.float32

    def __str__(self) -> str:
        return self.name


CPU = Device("cpu", torch.float32)
CUDA = Device("cuda", torch.bfloat16)
NO_CUDA = "needs a CUDA device (scripts/gpu_check runs the cuda parameters on a GPU)"
CUDA_MARKS = (pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA))
DEVICES = (pytest.param(CPU, id="cpu"), pytest.param(CUDA, id="cuda", marks=CUDA_MARKS))


@pytest.fixture(scope="module", params=DEVICES)
def device(request) -> Device:
    """The device the test's subject runs on: cpu in float32, and cuda in bfloat16 (marked `cuda`, skipped without
    one: a collection-time cost on the CPU). Module-scoped, so module fixtures (a model, an executor) can take it
    too. Offered to tests/executor and tests/models by their conftest.py (imported there, so that the scheduler's
    tests never import torch)."""
    return request.param
