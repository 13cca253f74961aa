"""Fixtures of the models' tests."""
from __future__ import annotations

from tests.devices import device  # noqa: F401  (the `device` fixture: cpu, and cuda marked `cuda`)
