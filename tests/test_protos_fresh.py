"""The committed protos/*_pb2*.py* match what scripts/gen_protos generates from protos/*.proto today."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSION_LINE = "# Protobuf Python Version"  # the generator's runtime version stamp: allowed to differ


def _normalised(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if not line.startswith(VERSION_LINE)]


def test_generated_protos_are_fresh(tmp_path):
    protos = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "protos").glob("*.proto"))
    assert protos, "no .proto files under protos/"
    # Exactly scripts/gen_protos's command, with the outputs redirected to tmp_path.
    cmd = [sys.executable, "-m", "grpc_tools.protoc", "-I.", f"--python_out={tmp_path}",
           f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}", *protos]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"protoc failed:\n{run.stderr}"

    generated = sorted((tmp_path / "protos").glob("*_pb2*.py*"))
    assert generated, "protoc generated nothing"
    expected_names = {f"{Path(p).stem}{suffix}" for p in protos
                      for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")}
    assert {g.name for g in generated} == expected_names
    stale = []
    for fresh in generated:
        committed = ROOT / "protos" / fresh.name
        if not committed.exists() or _normalised(committed) != _normalised(fresh):
            stale.append(fresh.name)
    assert not stale, (f"protos/{', protos/'.join(stale)} are stale or missing relative to protos/*.proto: "
                       "run scripts/gen_protos and commit the result")
    # No generated module is left behind for a .proto that no longer exists.
    committed_generated = {p.name for p in (ROOT / "protos").glob("*_pb2*.py*")}
    assert committed_generated <= expected_names, f"orphaned: {sorted(committed_generated - expected_names)}"
