"""Fixtures of the executor's tests."""
from __future__ import annotations

import pytest

from tests.devices import device  # noqa: F401  (the `device` fixture: cpu, and cuda marked `cuda`)


@pytest.fixture
def stub(server):
    """The ExecutorService stub of the test file's `server` fixture (a real executor process)."""
    return server.stub
