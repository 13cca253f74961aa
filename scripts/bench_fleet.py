#!/usr/bin/env python
"""Fleet benchmark (one scheduler, several executors: scaling and failover): the command line of
benchmarks/fleet.py (its docstring and --help say more)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: benchmarks/ and Tandem's packages

from benchmarks import fleet  # noqa: E402

if __name__ == "__main__":
    sys.exit(fleet.main())
