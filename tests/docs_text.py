"""The project's documentation as text, for tests that check or run what it says: README.md and docs/*.md."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def docs_pages() -> list[Path]:
    """README.md, then every docs/*.md in name order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def docs_text(*pages: str) -> str:
    """The text of `pages` (paths from the repository root, e.g. "docs/metrics.md"), joined by blank lines;
    no pages = README.md and every docs/*.md. A page that does not exist is an error (FileNotFoundError)."""
    paths = [ROOT / p for p in pages] if pages else docs_pages()
    return "\n\n".join(p.read_text(encoding="utf-8") for p in paths)
