"""deploy/k8s/Dockerfile builds an image that runs the native decode step: it installs a C++ compiler (and
ninja, through the package's dependencies), builds the kernel at image build time into the cache of the user
the pods run as, and the package ships the kernel's sources.

Static checks only: the Dockerfile and pyproject.toml are read, no image is built (no docker engine here).
"""
from __future__ import annotations

import ast
import fnmatch
import re
import tomllib

import pytest

from tests.cli_parsers import ROOT

DOCKERFILE = ROOT / "deploy" / "k8s" / "Dockerfile"
NATIVE = ROOT / "models" / "native"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined and comments dropped."""
    lines = [line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(word.upper(), rest.strip()) for word, _, rest in
            (line.strip().partition(" ") for line in text.splitlines() if line.strip())]


def _index(predicate) -> int:
    found = [i for i, (op, args) in enumerate(_instructions()) if predicate(op, args)]
    assert found, "no such instruction in the Dockerfile"
    return found[0]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_image_installs_a_compiler_and_ninja():
    installs = [args for op, args in _instructions() if op == "RUN" and "apt-get install" in args]
    assert any(re.search(r"(^|\s)(g\+\+|build-essential)(\s|$)", args) for args in installs), installs
    # ninja (torch.utils.cpp_extension's build tool) comes with the package, which the image pip-installs
    assert any(re.match(r"ninja\b", dep) for dep in _pyproject()["project"]["dependencies"])
    _index(lambda op, args: op == "RUN" and re.search(r"pip install \.(\s|$)", args))


def test_the_image_prebuilds_the_native_kernel_for_the_pods_user():
    """`python -m models.decode.native` runs after the package is installed and as the user the manifests
    run as (uid 1000), so the library lands in the cache the executor reads (~/.cache/tandem/native)."""
    build = _index(lambda op, args: op == "RUN" and "python -m models.decode.native" in args)
    assert build > _index(lambda op, args: op == "RUN" and "pip install ." in args)
    assert build > _index(lambda op, args: op == "USER" and args.startswith("1000"))
    assert ("ENV", "HOME=/home/tandem") in _instructions()[:build]
    tree = ast.parse((ROOT / "models" / "decode" / "native.py").read_text())  # (no torch imported here)
    assert any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body)
    assert any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body)


@pytest.mark.parametrize("source", sorted(p.name for p in NATIVE.iterdir() if p.suffix in (".cpp", ".h")))
def test_the_package_ships_every_kernel_source(source):
    globs = _pyproject()["tool"]["setuptools"]["package-data"]["models"]
    assert any(fnmatch.fnmatch(f"native/{source}", g) for g in globs), globs
