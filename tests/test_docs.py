"""The documentation's contract: README.md stays short and keeps its quick start, and no
relative link or image in README.md or docs/*.md points at a missing file or heading.

Anchors follow GitHub's heading slugs (lower case, punctuation dropped, spaces to
hyphens, `-1`, `-2`, ... for repeats), so a renamed heading breaks the links to it here
before it breaks them on GitHub.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_LIMIT = 10240  # bytes: depth goes into docs/

# The two quick-start commands, verbatim: the first installs and runs the default
# federation offline, the second installs the test extra and runs the tests.
QUICK_START = (
    'pip install -e . && FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 flwr run . --stream --federation-config "num-supernodes=5 client-resources-num-cpus=1"',
    'pip install -e ".[test]" && python -m pytest',
)

FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target "title") and ![alt](target); text may hold inline code or one level of brackets.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HTML_SRC = re.compile(r"<(?:img|a)\b[^>]*\b(?:src|href)=\"([^\"]+)\"", re.IGNORECASE)
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fence = [], None
    for line in text.splitlines():
        m = FENCE.match(line)
        if m:
            marker = m.group(2)
            if fence is None:
                fence = marker
            elif marker[0] == fence[0] and len(marker) >= len(fence):
                fence = None
            continue
        if fence is None:
            lines.append(line)
    return lines


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (github-slugger)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.replace("`", "")
    text = re.sub(r"(\*\*|__|\*)", "", text)  # emphasis markers (single _ stays: it is a word character)
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(path: Path) -> list[str]:
    found = []
    for line in prose_lines(path.read_text(encoding="utf-8")):
        m = REFERENCE_DEF.match(line)
        if m:
            found.append(m.group(1))
        line = INLINE_CODE.sub("", line)
        found += LINK.findall(line)
        found += HTML_SRC.findall(line)
    return found


def is_external(target: str) -> bool:
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target)) or target.startswith("//")


def relative_links(path: Path) -> list[str]:
    return [t for t in links(path) if t and not is_external(t)]


PAGES = sorted(DOCS.glob("*.md"))
SOURCES = [README, *PAGES]


def test_readme_is_at_most_10_kib():
    size = len(README.read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes, over {README_LIMIT}: move the depth into docs/"


@pytest.mark.parametrize("command", QUICK_START)
def test_readme_quick_start_has_the_command(command):
    text = README.read_text(encoding="utf-8")
    section = text.split("## Quick start", 1)
    assert len(section) == 2, "README.md has no '## Quick start' section"
    quick_start = section[1].split("\n## ", 1)[0]
    code_lines = [line.strip() for line in quick_start.splitlines()]
    assert command in code_lines, f"the quick start lost its command: {command}"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(source):
    broken = []
    for target in relative_links(source):
        file_part, _, fragment = unquote(target).partition("#")
        dest = (source.parent / file_part).resolve() if file_part else source
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
            continue
        if fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading with slug #{fragment} in {dest.relative_to(ROOT)}")
    assert not broken, f"{source.relative_to(ROOT)} has broken links:\n" + "\n".join(broken)


def test_docs_has_pages():
    assert PAGES, "docs/ has no .md pages"


def test_every_docs_page_is_linked_from_readme():
    linked = {
        (README.parent / unquote(t).partition("#")[0]).resolve() for t in relative_links(README) if t.partition("#")[0]
    }
    orphans = [p.name for p in PAGES if p.resolve() not in linked]
    assert not orphans, f"docs pages that README.md does not link: {orphans}"


def test_the_checks_catch_breakage(tmp_path):
    """The helpers must see what they are meant to see, or the tests above pass vacuously."""
    page = tmp_path / "page.md"
    page.write_text(
        "# Why `FLWR_X=1`\n\n## Experiment: accuracy against ε\n\n## Results\n\n### Results\n\n"
        "[a](other.md#x) ![b](fig.png) `[not](a-link.md)`\n\n```\n[nor](this.md)\n# not a heading\n```\n",
        encoding="utf-8",
    )
    assert anchors(page) == {"why-flwr_x1", "experiment-accuracy-against-ε", "results", "results-1"}
    assert relative_links(page) == ["other.md#x", "fig.png"]
    assert (
        github_slug("Server aggregation: ours vs Flower's built-ins") == "server-aggregation-ours-vs-flowers-built-ins"
    )
    assert github_slug("Asynchronous aggregation (FedBuff)") == "asynchronous-aggregation-fedbuff"


# `name...`: a test whose name starts so; `*` stands for any part of a name
TEST_NAME = re.compile(r"\b(test_[a-z0-9_*]+)(\.\.\.|…)?")


def test_every_test_the_threat_model_names_exists():
    """docs/threat-model.md states each bound with the test that shows it: every `test_...` it
    names is a test function (or a test module) in tests/, so a renamed or deleted test breaks
    this before it leaves a bound unproven."""
    defined: set[str] = set()
    for path in (ROOT / "tests").glob("test_*.py"):
        defined.add(path.stem)
        defined.update(re.findall(r"^\s*(?:async\s+)?def (test_[a-z0-9_]+)\(", path.read_text(), re.MULTILINE))
    named = set(TEST_NAME.findall((DOCS / "threat-model.md").read_text()))
    assert named, "the threat model names no test"
    missing = sorted(
        name + dots
        for name, dots in named
        if not fnmatch.filter(defined, name + ("*" if dots else ""))
    )
    assert not missing, f"docs/threat-model.md names tests that do not exist: {missing}"
