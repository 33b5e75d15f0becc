"""Every relative link in README.md and docs/ reaches a file, and every #anchor a heading of it (GitHub's rule: the
heading lowercased, punctuation other than - and _ dropped, spaces as -, a repeat numbered -1, -2, …). Renaming a
module renames the math page's headings; this is what catches the links that still point at the old ones."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of ``page``'s headings (outside fenced code)."""
    found, seen, fenced = set(), {}, False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        match = None if fenced else re.match(r"^#{1,6}\s+(.*)", line)
        if match:
            name = slug(match.group(1))
            found.add(name if name not in seen else f"{name}-{seen[name]}")
            seen[name] = seen.get(name, 0) + 1
    return found


def test_slugs_by_hand():
    assert slug("The adaptive bound [`miles_mis/correction/adaptive.py`]") == \
        "the-adaptive-bound-miles_miscorrectionadaptivepy"
    assert slug("What mismatch needs a correction") == "what-mismatch-needs-a-correction"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_reach_their_file_and_heading(page):
    broken = []
    for link in LINK.findall(page.read_text(encoding="utf-8")):
        if link.startswith(("http://", "https://", "mailto:")):
            continue
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{link} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{link} (no such heading)")
    assert not broken, f"{page.relative_to(REPO)}: {broken}"
