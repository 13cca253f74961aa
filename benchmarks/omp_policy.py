"""--omp-wait-policy: libgomp reads OMP_WAIT_POLICY once, when torch is imported, so the flag is applied from
argv before anything imports torch (this module must not). The server subprocesses inherit the environment."""
from __future__ import annotations

import os

OMP_WAIT_POLICIES = ("passive", "active", "unset")
applied: str | None = None  # what apply() found in argv; None: the environment's policy stands


def requested(argv: list[str]) -> str | None:
    """The value given to --omp-wait-policy in argv, lower-cased (None without the flag)."""
    for i, a in enumerate(argv):
        if a == "--omp-wait-policy" and i + 1 < len(argv):
            return argv[i + 1].lower()
        if a.startswith("--omp-wait-policy="):
            return a.split("=", 1)[1].lower()
    return None


def apply(argv: list[str]) -> None:
    """Sets (or, for `unset`, removes) OMP_WAIT_POLICY as argv asks; no flag, or a bad one (argparse reports
    it later), leaves the environment's policy."""
    global applied
    applied = requested(argv)
    if applied == "unset":
        os.environ.pop("OMP_WAIT_POLICY", None)
    elif applied in OMP_WAIT_POLICIES:
        os.environ["OMP_WAIT_POLICY"] = applied.upper()


def current() -> str:
    return os.environ.get("OMP_WAIT_POLICY") or "unset"
