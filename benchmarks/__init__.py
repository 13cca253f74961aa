"""Tandem's benchmarks: shared workloads, transformers baselines, measurement and reporting, and one module per
benchmark (scripts/bench_*.py are their command lines). Test-only; never imported by the servers."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"

# scripts/ is not a package: make_tiny_checkpoint and prepare_default_model are imported from
# it by name, as the scripts themselves import them (python puts a script's folder on sys.path, an importer
# of this package does not).
if str(SCRIPTS) not in sys.path:
    sys.path.append(str(SCRIPTS))
