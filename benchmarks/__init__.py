"""Tandem's benchmarks: `python -m benchmarks NAME [args]` (benchmarks/__main__.py lists the NAMEs; docs/benchmarks.md
says what each measures). Benchmark-only; never imported by the servers."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"

# scripts/ is not a package: make_tiny_checkpoint (the MoE benchmark's synthetic checkpoint) is imported by name.
if str(SCRIPTS) not in sys.path:
    sys.path.append(str(SCRIPTS))
