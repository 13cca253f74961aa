"""README.md stays a short front page and the docs/ pages stay linked: README opens with the two setup
commands and is at most 320 lines; every docs/*.md it links exists and every docs page is linked from it;
every relative link inside README and docs/ resolves, to a file and, with `#anchor`, to one of its headings."""
from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import pytest

from tests.docs_text import ROOT, docs_pages

README = ROOT / "README.md"
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.DOTALL | re.MULTILINE)


def _prose(text: str) -> str:
    """The text without its fenced code blocks (a `[x](y)` inside code is not a link)."""
    return FENCE.sub("", text)


def _links(path: Path) -> list[str]:
    return LINK.findall(_prose(path.read_text(encoding="utf-8")))


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces
    become hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = _anchor(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= 320, f"README.md has {lines} lines: move detail to a docs/ page"


def test_readme_opens_with_the_two_setup_commands():
    head = README.read_text(encoding="utf-8").splitlines()[:12]
    commands = [line.split("#")[0].strip() for line in head]
    assert "scripts/serve" in commands and "scripts/test" in commands, head


def test_every_docs_page_is_linked_from_readme_and_every_linked_page_exists():
    linked = {link.split("#")[0] for link in _links(README)}
    linked_docs = {link for link in linked if link.startswith("docs/") and link.endswith(".md")}
    missing = sorted(link for link in linked_docs if not (ROOT / link).is_file())
    assert not missing, f"README.md links docs pages that do not exist: {missing}"
    pages = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")}
    assert pages, "no docs/*.md pages"
    unlinked = sorted(pages - linked_docs)
    assert not unlinked, f"docs pages README.md does not link: {unlinked}"


@pytest.mark.parametrize("page", docs_pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path):
    broken = []
    for link in _links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto: ...
            continue
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{link}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{link}: no heading with that anchor in {path.relative_to(ROOT)}")
    assert not broken, broken


def test_quantization_quality_bounds_are_stated_where_the_tests_say():
    """tests/executor/test_quantization_quality.py holds these bounds; the performance page states them."""
    text = " ".join((ROOT / "docs" / "performance.md").read_text(encoding="utf-8").split())
    assert ("fp16 every greedy token and |ΔNLL| < 0.002; int8 |ΔNLL| < 0.02 and top-1 ≥ 120/128; "
            "bfloat16 (native) |ΔNLL| < 0.005 and top-1 ≥ 126/128") in text


PATH_MENTION = re.compile(r"(?<![\w/.-])((?:executor_service|scheduler|models|tandem|tests|benchmarks|scripts|deploy|"
                          r"protos|docs)/[\w/.-]*\w\.(?:py|md|proto|cpp|h|yaml|yml|json|toml|sh|txt))(?![\w/])")


MODULE_MENTION = re.compile(r"(?<![\w/.-])(\w+\.py)(?![\w/])")
PLACEHOLDER = re.compile(r"[A-Z]{3,}")  # `scripts/bench_NAME.py`: a pattern, not a file


def _path_mentions(path: Path) -> set[str]:
    """Repository paths a page names in its text (code blocks included: commands name files too)."""
    return {m for m in PATH_MENTION.findall(path.read_text(encoding="utf-8")) if not PLACEHOLDER.search(m)}


def _module_mentions(path: Path) -> set[str]:
    """Bare module file names a page names (`engine.py`), placeholders left out."""
    return {m for m in MODULE_MENTION.findall(path.read_text(encoding="utf-8")) if not PLACEHOLDER.search(m)}


SKIPPED_DIRS = {".venv", "node_modules", ".git", "__pycache__"}  # no repository module lives under these


@functools.cache
def _repository_file_names() -> set[str]:
    """Walked once per process, pruning SKIPPED_DIRS instead of filtering after the walk: a filtered rglob per
    docs page walked all of .venv (tens of thousands of files) every time, ~20 s of CPU for this file."""
    names: set[str] = set()
    for _, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]
        names.update(f for f in files if f.endswith(".py"))
    return names


@pytest.mark.parametrize("page", [README, *docs_pages()], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_named_files_exist(page: Path):
    """Every `dir/file.py` (and .md, .proto, .cpp ...) a page names is in the repository, and every bare
    `module.py` it names is the name of one: moved or renamed code takes the docs with it."""
    missing = sorted(m for m in _path_mentions(page) if not (ROOT / m).exists())
    assert not missing, f"{page.relative_to(ROOT)} names files that are not there: {missing}"
    unknown = sorted(_module_mentions(page) - _repository_file_names())
    assert not unknown, f"{page.relative_to(ROOT)} names modules no file of the repository is called: {unknown}"


def test_named_files_check_can_fail(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text("See `executor_service/no_such_module.py`, executor_service/executor.py and `gone.py`; "
                    "scripts/bench_NAME.py is a pattern.\n")
    assert _path_mentions(page) == {"executor_service/no_such_module.py", "executor_service/executor.py"}
    assert _module_mentions(page) == {"gone.py"} and "gone.py" not in _repository_file_names()
