"""The fuzz suite's option: `--fuzz-examples N` (examples per property; default a few dozen, sized to keep
the whole file well under a minute on 2 cores). Long runs, for benchmarks or before a release:

    .venv/bin/python -m pytest -q tests/fuzz --fuzz-examples 2000

The option is this directory's (give tests/fuzz, or a file in it, on the command line). The default run is
derandomized (the same examples every time, as CI wants); a long run draws new ones."""
from __future__ import annotations

import pytest

DEFAULT_EXAMPLES = 30


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fuzz-examples", type=int, default=None, metavar="N",
                     help=f"examples per fuzz property in tests/fuzz (default {DEFAULT_EXAMPLES}, derandomized; "
                          "any N draws fresh random examples)")


@pytest.fixture(scope="session")
def fuzz_examples(request) -> tuple[int, bool]:
    """(examples per property, derandomize)."""
    n = request.config.getoption("--fuzz-examples", default=None)
    return (DEFAULT_EXAMPLES, True) if n is None else (n, False)
