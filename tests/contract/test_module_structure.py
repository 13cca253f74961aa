"""The code's shape, checked: the scheduler's modules import one way (no cycle, counting imports made only for
type hints or inside functions), and no hand-written module grows past 400 lines. Each check has a control
case that shows it can fail."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT

MAX_LINES = 400
HAND_WRITTEN = ("tandem", "models", "executor_service", "scheduler")


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports, every import statement counted (top level, inside
    functions, under `if TYPE_CHECKING:`), `from pkg import module` resolved to the module."""
    modules = {_module_name(root, p): p for p in (root / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(name, is_pkg, node.module, node.level)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            deps |= {_owner(t, modules) for t in targets if _owner(t, modules) not in (None, name)}
        graph[name] = deps
    return graph


def _module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(name: str, is_pkg: bool, module: str | None, level: int) -> str:
    if not level:
        return module or ""
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _owner(target: str, modules: dict) -> str | None:
    """The module of the package that `target` names (or lies in), None when outside the package."""
    while target:
        if target in modules:
            return target
        target = target.rpartition(".")[0]
    return None


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1 = on the path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_scheduler_imports_one_way():
    graph = import_graph(ROOT, "scheduler")
    assert len(graph) > 20, sorted(graph)  # the walk found the package
    assert graph["scheduler.fleet.fleet"], "the walk resolves imports"  # (not an empty graph that trivially passes)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in scheduler/: " + " -> ".join(cycle)


def test_the_cycle_check_sees_a_type_hint_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import C\n")
    (pkg / "c.py").write_text("def f():\n    from pkg import a\n")
    assert find_cycle(import_graph(tmp_path, "pkg")) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
    (pkg / "c.py").write_text("X = 1\n")
    assert find_cycle(import_graph(tmp_path, "pkg")) is None


def _hand_written(root: Path) -> list[Path]:
    return [p for d in HAND_WRITTEN for p in (root / d).rglob("*.py") if "_pb2" not in p.name]


def _too_long(root: Path) -> dict[str, int]:
    sizes = {str(p.relative_to(root)): len(p.read_text(encoding="utf-8").splitlines()) for p in _hand_written(root)}
    return {p: n for p, n in sizes.items() if n > MAX_LINES}


def test_no_hand_written_module_over_400_lines():
    assert len(_hand_written(ROOT)) > 100
    assert _too_long(ROOT) == {}


def test_the_size_check_sees_a_long_module(tmp_path):
    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "scheduler" / "long_pb2.py").write_text("x = 1\n" * (MAX_LINES + 1))  # generated: not counted
    assert _too_long(tmp_path) == {str(Path("scheduler/long.py")): MAX_LINES + 1}


@pytest.mark.parametrize("package", ["tandem", "executor_service", "models"])
def test_other_packages_import_one_way_too(package):
    cycle = find_cycle(import_graph(ROOT, package))
    assert cycle is None, f"import cycle in {package}/: " + " -> ".join(cycle)


MAX_MODULES_PER_FOLDER = 20


def folder_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Each folder of `package` (its top-level sub-packages, nested folders counted in theirs) -> the folders
    its modules import. The modules at the package's root (config, types, the façade, entry points) are the
    package's base and top and belong to no folder: the rule is that folders import one way."""
    def folder(module: str) -> str | None:
        parts = module.split(".")
        inside = parts if (root / module.replace(".", "/")).is_dir() else parts[:-1]
        return ".".join(inside[:2]) if len(inside) > 1 else None

    graph: dict[str, set[str]] = {}
    for module, deps in import_graph(root, package).items():
        if (src := folder(module)) is None:
            continue
        graph.setdefault(src, set()).update(d for d in map(folder, deps) if d not in (None, src))
    return graph


@pytest.mark.parametrize("package", ["scheduler", "executor_service", "models", "tandem"])
def test_folders_import_one_way(package):
    graph = folder_graph(ROOT, package)
    assert package == "tandem" or len(graph) >= 5, sorted(graph)  # the walk found the folders
    cycle = find_cycle(graph)
    assert cycle is None, f"folders of {package}/ import each other: " + " -> ".join(cycle)


def test_the_folder_check_sees_two_folders_importing_each_other(tmp_path):
    pkg = tmp_path / "pkg"
    for d in ("a", "b", "b/inner"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "base.py").write_text("from pkg.b import y\n")  # a root module: belongs to no folder
    (pkg / "a" / "x.py").write_text("from pkg import base\nfrom pkg.b.inner import z\n")
    (pkg / "b" / "y.py").write_text("X = 1\n")
    (pkg / "b" / "inner" / "z.py").write_text("def f():\n    from pkg.a import x\n")
    assert find_cycle(folder_graph(tmp_path, "pkg")) == ["pkg.a", "pkg.b", "pkg.a"]
    (pkg / "b" / "inner" / "z.py").write_text("X = 2\n")
    assert find_cycle(folder_graph(tmp_path, "pkg")) is None


def _folders(root: Path) -> list[Path]:
    """The hand-written folders (a folder of generated contract code, only *_pb2 modules, is scripts/gen_protos')."""
    def generated(folder: Path) -> bool:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        return bool(modules) and all("_pb2" in p.name for p in modules)
    return sorted(p.parent for d in HAND_WRITTEN for p in (root / d).rglob("__init__.py") if not generated(p.parent))


def test_no_folder_holds_more_than_20_modules():
    crowded = {str(f.relative_to(ROOT)): n for f in _folders(ROOT)
               if (n := len([p for p in f.glob("*.py") if p.name != "__init__.py"])) > MAX_MODULES_PER_FOLDER}
    assert crowded == {}, "split these folders by concept"


def first_line_docstring(init: Path) -> str | None:
    """The docstring of a folder's __init__.py when it is one line (None when missing or longer)."""
    doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")), clean=False)
    return doc if doc and "\n" not in doc.strip() and len(doc.split()) >= 4 else None


def test_every_folder_says_in_one_line_what_it_holds():
    assert len(_folders(ROOT)) > 25
    silent = [str(f.relative_to(ROOT)) for f in _folders(ROOT) if not first_line_docstring(f / "__init__.py")]
    assert silent == [], "give each __init__.py a one-line docstring saying what the folder holds"


def test_the_docstring_check_sees_silence(tmp_path):
    (tmp_path / "__init__.py").write_text('"""pkg"""\n')
    assert first_line_docstring(tmp_path / "__init__.py") is None
    (tmp_path / "__init__.py").write_text('"""Two\nlines."""\n')
    assert first_line_docstring(tmp_path / "__init__.py") is None
    (tmp_path / "__init__.py").write_text('"""The parts of a thing, each in its file."""\nX = 1\n')
    assert first_line_docstring(tmp_path / "__init__.py") == "The parts of a thing, each in its file."
