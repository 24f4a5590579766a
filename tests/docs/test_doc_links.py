"""The README's and docs/' relative links lead somewhere: the file exists and, for a `#fragment` into
a Markdown page, that page has a heading with that anchor (GitHub's: lower case, punctuation
dropped, spaces to hyphens)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$")


def anchor(heading: str) -> str:
    text = re.sub(r"[`*\\]", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, fenced = set(), False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        if not fenced and (m := HEADING.match(line)):
            found.add(anchor(m.group(1)))
    return found


def test_a_heading_gets_githubs_anchor():
    assert anchor("Defaults that differ from the original M\\*") == "defaults-that-differ-from-the-original-m"
    assert anchor("`mstar serve`") == "mstar-serve"
    assert anchor("π0.5: a robot policy") == "π05-a-robot-policy"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading '#{fragment}' in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"
