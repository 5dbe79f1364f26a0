"""Every relative link in the documentation resolves (issue 37): README.md, docs/, the results
tree's Markdown and lab/README.md. A link to another Markdown file's #anchor must name one of its headings, spelled
as GitHub spells the anchor. Links with a scheme (https:, mailto:) are not followed: this tier has
no network."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) or ![alt](target), text may hold one level of brackets; an optional "title"
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFDEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def doc_files() -> list[Path]:
    files = [ROOT / "README.md"]
    for tree in ("docs", "benchmarks"):
        files += sorted((ROOT / tree).rglob("*.md"))
    files.append(ROOT / "lab" / "README.md")
    return files


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks, with inline code spans blanked."""
    fenced = None
    for no, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m:
            fenced = None if fenced == m.group(1) else (fenced or m.group(1))
            continue
        if fenced is None:
            yield no, CODE_SPAN.sub(lambda s: " " * len(s.group(0)), line)


def links(text: str):
    for no, line in prose_lines(text):
        for m in INLINE.finditer(line):
            yield no, m.group(1)
        m = REFDEF.match(line)
        if m:
            yield no, m.group(1)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    text = path.read_text(encoding="utf-8")
    for _, line in prose_lines(text):
        m = HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    # explicit <a name=…> / id=… anchors count too (inside code they are not anchors)
    found.update(HTML_ANCHOR.findall(text))
    return found


def broken_links(path: Path) -> list[str]:
    problems = []
    for no, target in links(path.read_text(encoding="utf-8")):
        if SCHEME.match(target):
            continue
        where, _, fragment = target.partition("#")
        dest = (path.parent / where).resolve() if where else path
        rel = path.relative_to(ROOT)
        if not dest.exists():
            problems.append(f"{rel}:{no}: {target} -> no such file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif not dest.is_relative_to(ROOT):
            problems.append(f"{rel}:{no}: {target} leaves the repository")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            problems.append(f"{rel}:{no}: {target} -> {dest.relative_to(ROOT)} has no heading #{fragment}")
    return problems


def test_every_relative_link_resolves():
    files = doc_files()
    assert len(files) > 10, f"found only {len(files)} Markdown files: is the tree where this test thinks?"
    problems = [p for f in files for p in broken_links(f)]
    assert not problems, f"{len(problems)} broken link(s):\n" + "\n".join(problems)


@pytest.mark.parametrize("text,expected", [
    ("[a](x.md) and ![b](img/p.png \"t\") `[c](not-a-link.md)`", ["x.md", "img/p.png"]),
    ("[`code` text](../y.md#part)", ["../y.md#part"]),
    ("[ref]: refs/z.md", ["refs/z.md"]),
    ("```\n[a](in-fence.md)\n```\n[b](after.md)", ["after.md"]),
])
def test_links_are_found_where_markdown_renders_them(text, expected):
    assert [t for _, t in links(text)] == expected


@pytest.mark.parametrize("heading,anchor", [
    ("Adding a vLLM release", "adding-a-vllm-release"),
    ("`flash serve` and the RunSpec (v0.33)", "flash-serve-and-the-runspec-v033"),
    ("Exit codes", "exit-codes"),
])
def test_heading_anchor_as_github_spells_it(heading, anchor):
    assert slug(heading) == anchor


def test_a_broken_link_and_a_missing_anchor_are_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "target.md").write_text("# Only heading\n")
    doc = tmp_path / "doc.md"
    doc.write_text("[ok](target.md#only-heading) [gone](missing.md) [bad](target.md#nope) [web](https://x.y/z)\n")
    problems = broken_links(doc)
    assert len(problems) == 2 and "missing.md" in problems[0] and "#nope" in problems[1]


def test_readme_front_door_gives_the_command_ci_runs():
    """README's two commands: the test line is exactly what .ci/run executes, and the front door
    links the docs index and the architecture guide (one link from README to each)."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```sh\n(.*?)```", readme, re.S)
    assert block, "README.md lacks its ```sh block of the two commands"
    test_line = [ln for ln in block.group(1).splitlines() if "# test it" in ln]
    ci = [ln.split(None, 1)[1] for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.startswith("exec ")]
    assert len(test_line) == 1 and len(ci) == 1, (test_line, ci)
    assert test_line[0].split("#")[0].strip() == ci[0].strip()
    targets = {t for _, t in links(readme)}
    assert {"docs/README.md", "docs/ARCHITECTURE.md", "docs/STATUS.md"} <= targets
