#!/usr/bin/env python
"""MoE decode benchmark: the command line of benchmarks/moe.py (its docstring and --help say more)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: benchmarks/ and Tandem's packages

from benchmarks import moe  # noqa: E402

if __name__ == "__main__":
    sys.exit(moe.main())
