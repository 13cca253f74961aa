"""These tests read files and parse command lines: no torch, no servers."""
import pytest


@pytest.fixture(autouse=True, scope="session")
def _limit_threads() -> None:
    """Overrides tests/conftest.py's fixture of the same name, which imports torch (~2 s) to cap its
    threads for tests that start servers; nothing here does."""
