"""Every relative link of the README and docs/ resolves: its file exists, and its #anchor is a heading
of that file as GitHub names headings (lower case, punctuation dropped, spaces as hyphens)."""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def unfenced(text: str) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.M | re.S)


def anchors(page: Path) -> set[str]:
    """GitHub's ids of a page's headings; a repeated one is numbered -1, -2, ..."""
    ids, seen = set(), Counter()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", unfenced(page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        ids.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)
        seen[slug] += 1
    return ids


def broken_links(page: Path) -> list[str]:
    broken = []
    prose = re.sub(r"`[^`\n]*`", "", unfenced(page.read_text()))  # inline code holds no links
    for target in LINK.findall(prose):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no such heading")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert not broken_links(page)


def test_a_broken_link_or_anchor_is_found(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# Set up `--x`, quickly\n\n## Set up `--x`, quickly\n```\n# not one\n```\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#set-up---x-quickly) [ok](b.md#set-up---x-quickly-1) [gone](c.md)\n"
                    "[no anchor](b.md#not-one) `[code](d.md)`\n```\n[block](e.md)\n```\n[self](#nothing)\n")
    assert broken_links(page) == ["c.md: no such file", "b.md#not-one: no such heading",
                                  "#nothing: no such heading"]
