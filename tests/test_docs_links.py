"""Every relative markdown link with an #anchor in README.md, docs/*.md and benchmarks/README.md
lands on a heading of its target file, by GitHub's anchor rules."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)\)")  # [text](target), text may hold [..]


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: inline links read as their text, lowercase, every character but
    letters, digits, spaces, - and _ dropped, each space a -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def prose_lines(path: Path) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    """Every heading's anchor; a repeated one also as -1, -2, ... as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(path):
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            slug = github_anchor(m.group(1).rstrip("#").rstrip())
            out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return out


def anchored_links(path: Path) -> list[tuple[str, str]]:
    """(target file, anchor) of each relative link with an anchor; `#x` alone targets `path` itself."""
    found = []
    for line in prose_lines(path):
        for target in LINK.findall(line):
            if "#" in target and not re.match(r"[a-z]+:", target):
                file, anchor = target.split("#", 1)
                found.append((file, anchor))
    return found


def test_github_anchor_by_hand():
    assert github_anchor("smollm2-135m: a real model (2026-11-24)") == "smollm2-135m-a-real-model-2026-11-24"
    assert github_anchor("`bf16` and `fp16`, step 2 of 3") == "bf16-and-fp16-step-2-of-3"
    # ", *, " leaves two spaces, so two dashes (as docs/rewards.md's own "Code: `run_code(...)`" heading)
    assert github_anchor("Code: `run_code(tests, *, timeout_s=5.0)`") == "code-run_codetests--timeout_s50"
    assert github_anchor("See [docs](docs/x.md) now") == "see-docs-now"


def test_repeated_headings_are_numbered(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Setup\n\n## Setup\n\n```\n# not a heading\n```\n## Setup\n")
    assert anchors(page) == {"setup", "setup-1", "setup-2"}


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_anchored_link_lands_on_a_heading(page):
    links = anchored_links(page)
    broken = []
    for file, anchor in links:
        target = (page.parent / file).resolve() if file else page
        if not target.is_file():
            broken.append(f"{file}#{anchor}: no such file")
        elif target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{file}#{anchor}: no such heading in {target.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_link_leaves_the_repository(page):
    """The README and docs stand on their own: every link targets a file of this repository."""
    outside = [target for line in prose_lines(page) for target in LINK.findall(line)
               if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE)]
    assert not outside, f"{page.relative_to(ROOT)} links outside the repository: {outside}"
