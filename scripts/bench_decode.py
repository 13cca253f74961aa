#!/usr/bin/env python
"""Decode-speed benchmark: the command line of benchmarks/decode.py (its docstring and --help say more)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: benchmarks/ and Tandem's packages

from benchmarks import decode  # noqa: E402

if __name__ == "__main__":
    sys.exit(decode.main())
