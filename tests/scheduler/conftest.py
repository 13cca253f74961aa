"""Fixtures of the scheduler's unit tests."""
from __future__ import annotations

import pytest

from scheduler.text.tokenizer import ModelTokenizer


@pytest.fixture(scope="session")
def tok(smollm2_dir) -> ModelTokenizer:
    """SmolLM2's tokenizer (tokenizer.json and chat template), as the scheduler loads it."""
    return ModelTokenizer(smollm2_dir)
