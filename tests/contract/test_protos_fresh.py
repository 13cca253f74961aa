"""The committed contract modules (tandem/<service>/v1/*_pb2*.py*) match what scripts/gen_protos generates from
protos/tandem/**/*.proto today, and nothing generated is left behind for a .proto that no longer exists. The same
holds for the vendored protocols (protos_vendor/smg/*.proto -> tandem/vendor/smg/)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT
VERSION_LINE = "# Protobuf Python Version"  # the generator's runtime version stamp: allowed to differ


def _normalised(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if not line.startswith(VERSION_LINE)]


def _generated(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in (root / "tandem").rglob("*_pb2*.py*")}


def test_generated_protos_are_fresh(tmp_path):
    protos = sorted((ROOT / "protos").rglob("*.proto"))
    assert protos, "no .proto files under protos/"
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gen_protos"), str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHON": sys.executable})
    assert run.returncode == 0, f"scripts/gen_protos failed:\n{run.stderr}"

    fresh = _generated(tmp_path)
    vendored = sorted((ROOT / "protos_vendor" / "smg").glob("*.proto"))
    assert vendored, "no .proto files under protos_vendor/smg/"
    modules = [(p, p.relative_to(ROOT / "protos")) for p in protos] + \
              [(p, Path("tandem/vendor/smg") / p.name) for p in vendored]
    expected = {where.with_name(f"{p.stem}{suffix}").as_posix()
                for p, where in modules for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
                if suffix != "_pb2_grpc.py" or "\nservice " in p.read_text()}  # stubs only where a service is
    assert fresh == expected, "protoc generated other files than one module set per .proto"
    stale = [name for name in sorted(fresh)
             if not (ROOT / name).exists() or _normalised(ROOT / name) != _normalised(tmp_path / name)]
    assert not stale, (f"{', '.join(stale)} are stale or missing relative to protos/: run scripts/gen_protos and "
                       "commit the result")
    orphaned = _generated(ROOT) - expected
    assert not orphaned, f"generated modules without a .proto: {sorted(orphaned)}"
