"""The previous release, pinned in one place: the mixed-version tests (tests/contract/test_mixed_versions.py,
tests/e2e/test_rolling_restart.py) run its executor beside this tree's scheduler and its scheduler beside this
tree's executor, each built from git into a temp dir at test time.

The repository has no tags: every landed session is a release, so "the previous release" is a commit.
To bump it when a session lands: set PREVIOUS_RELEASE to the full hash of the last commit of the release before
the one being landed (`git rev-parse <short hash>`), run `scripts/test tests/contract/test_mixed_versions.py
tests/e2e/test_rolling_restart.py`, and say in the landing note what changed between the two (`git diff
<old> <new> -- protos/ tandem/capabilities.py`). The old tree runs with this tree's virtual environment: a
release whose dependencies differ (pyproject.toml) needs them installed there first, and the tests say so.
"""
from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
from pathlib import Path

from tests.conftest import ROOT

PREVIOUS_RELEASE = "c79e15f7ecc42da08e7d34e9fa3faf0f103d4453"  # "docs/development.md: how the suite runs its servers" (stop 55)


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, timeout=60)


def unavailable_reason(commit: str = PREVIOUS_RELEASE) -> str | None:
    """Why the previous release cannot be built from git here (None: it can): no git, no repository (an
    unpacked source archive), or a history that lacks the commit (a shallow clone: CI runs a full one)."""
    if shutil.which("git") is None:
        return "git is not installed: the previous release is built from git history"
    if _git("rev-parse", "--git-dir").returncode != 0:
        return "not a git checkout: the previous release is built from git history"
    if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        shallow = _git("rev-parse", "--is-shallow-repository").stdout.decode().strip() == "true"
        return (f"the previous release {commit[:12]} is not in this clone's history"
                + (" (a shallow clone: fetch with --unshallow)" if shallow else ""))
    return None


def differs(path: str, commit: str = PREVIOUS_RELEASE) -> bool:
    """Whether `path` (a file or folder of the repository) differs between the commit and this working tree."""
    return _git("diff", "--quiet", commit, "--", path).returncode != 0


def extract(out: Path, commit: str = PREVIOUS_RELEASE) -> Path:
    """The commit's tree written to out (`git archive`), which is returned: run its servers with
    source_root=out (tandem/server_process.py). Its generated protos are committed, so nothing is built."""
    archive = _git("archive", "--format=tar", commit)
    if archive.returncode != 0:
        raise RuntimeError(f"git archive {commit[:12]} failed: {archive.stderr.decode(errors='replace')}")
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(out, filter="data")
    return out


def dependencies_differ(commit: str = PREVIOUS_RELEASE) -> bool:
    """Whether the previous release declares other dependencies than this tree (its servers then may not run
    in this virtual environment)."""
    return differs("pyproject.toml", commit) and _dependencies(_git("show", f"{commit}:pyproject.toml").stdout) \
        != _dependencies((ROOT / "pyproject.toml").read_bytes())


def _dependencies(pyproject: bytes) -> object:
    import tomllib

    project = tomllib.loads(pyproject.decode()).get("project", {})
    return project.get("dependencies"), project.get("optional-dependencies")
