"""scripts/check_contract: the .proto contract passes `buf lint` (STANDARD + COMMENTS) and `buf breaking` against
the committed v1 image, and each check really catches what it guards (a renumbered field, an undocumented one),
shown on a copy of protos/ so the tree is never touched."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT
SCRIPT = ROOT / "scripts" / "check_contract"
IMAGE = ROOT / "protos" / "tandem-v1.image.yaml"
EXECUTOR_PROTO = Path("tandem") / "executor" / "v1" / "executor.proto"


def _find_buf() -> str | None:
    """The buf the script would use: $BUF, else .venv/bin/buf, else buf on PATH."""
    for candidate in (os.environ.get("BUF"), str(ROOT / ".venv" / "bin" / "buf")):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return shutil.which("buf")


BUF = _find_buf()
pytestmark = pytest.mark.skipif(BUF is None, reason="no buf binary (.venv/bin/buf from buf-bin, or buf on PATH)")


def _check(protos: Path | None = None) -> subprocess.CompletedProcess:
    args = ["bash", str(SCRIPT)] + ([str(protos)] if protos else [])
    return subprocess.run(args, cwd=ROOT.parent, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "BUF": BUF or ""})


def _copy_protos(tmp_path: Path) -> Path:
    dst = tmp_path / "protos"
    shutil.copytree(ROOT / "protos", dst)
    return dst


def _edit(path: Path, pattern: str, repl: str) -> None:
    text = path.read_text()
    new, n = re.subn(pattern, repl, text, count=1, flags=re.S)
    assert n == 1, f"{pattern!r} not found in {path}: update this test to the contract"
    path.write_text(new)


def _line(out: str, check: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(check))


def test_contract_is_clean():
    assert IMAGE.is_file(), "the committed v1 image is missing"
    run = _check()
    assert run.returncode == 0, f"scripts/check_contract failed:\n{run.stdout}{run.stderr}"
    assert _line(run.stdout, "buf lint") == "buf lint: ok"
    assert _line(run.stdout, "buf breaking").endswith(": ok")


def test_renumbered_field_breaks_the_contract(tmp_path):
    protos = _copy_protos(tmp_path)
    _edit(protos / EXECUTOR_PROTO, r"(message UnifiedItem \{.*?string cache_id = )1;", r"\g<1>99;")
    run = _check(protos)
    assert run.returncode != 0, run.stdout
    assert _line(run.stdout, "buf lint") == "buf lint: ok"  # still documented: only breaking fails
    assert "FAILED" in _line(run.stdout, "buf breaking")
    assert re.search(r'field "1" with name "cache_id" on message "UnifiedItem"', run.stdout), run.stdout


def test_undocumented_field_fails_lint(tmp_path):
    protos = _copy_protos(tmp_path)
    # Drop the comment block above KvUsage.block_size.
    _edit(protos / EXECUTOR_PROTO, r"(message KvUsage \{\n)(?:  //[^\n]*\n)+(  uint32 block_size = 1;)", r"\1\2")
    run = _check(protos)
    assert run.returncode != 0, run.stdout
    assert "FAILED" in _line(run.stdout, "buf lint")
    assert 'Field "block_size" should have a non-empty comment' in run.stdout, run.stdout
    assert _line(run.stdout, "buf breaking").endswith(": ok")  # comments are not contract
