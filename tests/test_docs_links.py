"""Every relative link in the Markdown pages (the repository root and docs/) resolves: the file or
folder exists and, for a ``#anchor``, the target page has a heading with that GitHub slug."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([*ROOT.glob("*.md"), *(ROOT / "docs").rglob("*.md")])

FENCE = re.compile(r"^\s{0,3}(```|~~~)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# [text](target) and ![alt](target), with an optional "title"; the text may hold `code` or an image.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^()\s>]*(?:\([^()\s]*\)[^()\s>]*)*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s+<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """The page's lines outside fenced code blocks, numbered from 1."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text in lowercase, every character that is not a
    letter, digit, space, '-' or '_' dropped, spaces turned into '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link or image: its text
    text = INLINE_CODE.sub(lambda m: m.group(2), text)
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = re.sub(r"(\*\*|__|\*)(.+?)\1", r"\2", text)  # emphasis markers
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    """Every heading anchor of a page; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for _, line in _prose_lines(page.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        if slug in seen:
            seen[slug] += 1
            slug = f"{slug}-{seen[slug]}"
        else:
            seen[slug] = 0
        found.add(slug)
    return frozenset(found)


def relative_links(page: Path) -> list[tuple[int, str]]:
    """The page's links that point inside the repository (no scheme, no absolute path), with line numbers."""
    links = []
    for number, line in _prose_lines(page.read_text(encoding="utf-8")):
        line = INLINE_CODE.sub("", line)
        targets = [m.group(1) for m in LINK.finditer(line)]
        reference = REFERENCE.match(line)
        if reference:
            targets.append(reference.group(1))
        for target in targets:
            if not target or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith(("/", "//")):
                continue
            links.append((number, target))
    return links


def broken_links(page: Path, *, root: Path = ROOT) -> list[str]:
    """What is wrong with each relative link of a page, one line each (none when all resolve)."""
    problems = []
    for number, target in relative_links(page):
        path_part, _, anchor = target.partition("#")
        destination = (page.parent / unquote(path_part)).resolve() if path_part else page
        where = f"{page.relative_to(root)}:{number}: {target}"
        if not destination.exists():
            problems.append(f"{where}: no file or folder {destination}")
        elif anchor and destination.suffix == ".md" and unquote(anchor).lower() not in anchors(destination):
            problems.append(f"{where}: {destination.name} has no heading with the anchor #{anchor}")
    return problems


def test_github_slug_rules() -> None:
    assert github_slug("Object stores (S3 and compatibles)") == "object-stores-s3-and-compatibles"
    assert (
        github_slug("Experiment trackers: MLflow and Weights & Biases")
        == "experiment-trackers-mlflow-and-weights--biases"
    )
    assert github_slug("`torch.compile`") == "torchcompile"
    assert github_slug("The save's 3%, met") == "the-saves-3-met"
    assert github_slug("keep_last_n and tombstones") == "keep_last_n-and-tombstones"


def test_repeated_headings_get_numbered_anchors(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Limits\n\n```\n# Limits\n```\n## Limits\n### Limits\n", encoding="utf-8")
    assert anchors(page) == {"limits", "limits-1", "limits-2"}


def test_a_broken_link_is_named(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Top\n\n## Usage\n", encoding="utf-8")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md#usage) [self](#here) `[code](missing.md)`\n\n## Here\n\n"
        "[gone](missing.md) [no anchor](a.md#nowhere) [web](https://example.com/x.md)\n",
        encoding="utf-8",
    )
    problems = broken_links(page, root=tmp_path)
    assert len(problems) == 2, problems
    assert "missing.md: no file" in problems[0]
    assert "has no heading with the anchor #nowhere" in problems[1]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    problems = broken_links(page)
    assert not problems, "broken links:\n" + "\n".join(problems)
