#!/usr/bin/env python
"""Serving-workload benchmark, in-process: the command line of benchmarks/step_profile.py (its docstring and
--help say more)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: benchmarks/ and Tandem's packages

from benchmarks import step_profile  # noqa: E402

if __name__ == "__main__":
    sys.exit(step_profile.main())
