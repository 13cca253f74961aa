#!/usr/bin/env python
"""Decode-step latency, in-process vs over gRPC: the command line of benchmarks/executor_step.py (its docstring
and --help say more)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: benchmarks/ and Tandem's packages

from benchmarks import omp_policy  # noqa: E402

omp_policy.apply(sys.argv[1:])  # --omp-wait-policy acts only if set before torch is imported

from benchmarks import executor_step  # noqa: E402

if __name__ == "__main__":
    sys.exit(executor_step.main())
