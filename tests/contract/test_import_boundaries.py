"""The process line in the imports: the scheduler never loads torch, the executor's package or the model core,
and the shared package `tandem` imports neither process's package (so either side can ship alone)."""
from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def _all_modules(package: str) -> list[str]:
    names = [package]
    for info in pkgutil.walk_packages([str(ROOT / package.replace(".", "/"))], prefix=f"{package}."):
        names.append(info.name)
    return names


def _loaded_after_importing(modules: list[str]) -> set[str]:
    """Top-level packages in sys.modules after importing every module, in a fresh interpreter."""
    code = ("import sys\n"
            f"for name in {modules!r}:\n"
            "    __import__(name)\n"
            "print('\\n'.join(sorted({m.split('.')[0] for m in sys.modules})))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return set(run.stdout.split())


@pytest.mark.parametrize("package, forbidden", [
    ("scheduler", {"torch", "executor_service", "models"}),
    ("tandem", {"torch", "executor_service", "models", "scheduler"}),
])
def test_package_imports_stay_on_its_side(package, forbidden):
    modules = _all_modules(package)
    assert len(modules) > 5, modules  # the walk found the package's modules
    leaked = _loaded_after_importing(modules) & forbidden
    assert not leaked, f"importing all of {package} loads {sorted(leaked)}"


def test_the_check_sees_a_leak():
    # The executor's package does load torch: the same check must notice it (the test is not vacuous).
    assert "torch" in _loaded_after_importing(["executor_service.executor"])
