"""Fixtures of the executor's tests."""
from __future__ import annotations

import pytest


@pytest.fixture
def stub(server):
    """The ExecutorService stub of the test file's `server` fixture (a real executor process)."""
    return server.stub
