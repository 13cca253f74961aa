#!/usr/bin/env python
"""Structured-output benchmark: the command line of benchmarks/structured.py (its docstring and --help say more)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: benchmarks/ and Tandem's packages

from benchmarks import structured  # noqa: E402

if __name__ == "__main__":
    sys.exit(structured.main())
