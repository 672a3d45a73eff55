"""The documentation's links and code paths point at things that exist.

Checked in ``README.md``, ``docs/*.md`` and ``docs/measurements/README.md``:

- every relative markdown link resolves to an existing file or directory, and a link with an
  ``#anchor`` into a markdown file (or within the same file) names a heading of that file, as
  GitHub spells its anchors;
- every ``tierstore/...py`` path mentioned (in prose, code spans or code blocks) exists;
- ``docs/DESIGN.md`` stays a map: at most 600 lines, and its code layout (§1) lists every module
  of the package, and only modules that exist.

Pure text processing: the package is not imported.
"""

from __future__ import annotations

import re
import unicodedata
from functools import cache
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted(
    [REPO / "README.md", REPO / "docs" / "measurements" / "README.md", *(REPO / "docs").glob("*.md")]
)
DESIGN = REPO / "docs" / "DESIGN.md"
DESIGN_MAX_LINES = 600

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# [text](target) and ![alt](target); the text may hold code spans and nested brackets one level deep.
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
_PY_PATH = re.compile(r"(?<![\w./-])tierstore/[\w/]*\w\.py\b")
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _split_code(text: str) -> tuple[list[str], list[str]]:
    """The file's lines outside fenced code blocks and inside them (both with their contents)."""
    prose, code = [], []
    in_fence = False
    for line in text.splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        (code if in_fence else prose).append(line)
    return prose, code


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: markup dropped, lower case, punctuation removed,
    spaces to hyphens."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\([^)]*\)", r"\1", heading)  # links -> their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").replace("*", "")
    text = text.strip().lower()
    kept = []
    for ch in text:
        cat = unicodedata.category(ch)
        if ch in "-_ " or cat[0] in "LN" or cat == "Mn":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


@cache
def _anchors(path: Path) -> frozenset[str]:
    prose, _ = _split_code(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    anchors = set()
    for line in prose:
        anchors.update(_HTML_ANCHOR.findall(line))
        m = _HEADING.match(line)
        if not m:
            continue
        base = _slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        anchors.add(base if n == 0 else f"{base}-{n}")
    return frozenset(anchors)


def _links(path: Path) -> list[str]:
    prose, _ = _split_code(path.read_text(encoding="utf-8"))
    out = []
    for line in prose:
        out.extend(_LINK.findall(line))
        m = _REF_DEF.match(line)
        if m:
            out.append(m.group(1))
    return out


def _link_problem(doc: Path, target: str) -> str | None:
    """Why ``target`` (a link in ``doc``) does not resolve, or None when it does."""
    if _EXTERNAL.match(target):
        return None
    file_part, _, anchor = target.partition("#")
    file_part = unquote(file_part.split("?", 1)[0])
    dest = (doc.parent / file_part).resolve() if file_part else doc
    if not dest.exists():
        return f"{target}: no such file {dest}"
    try:
        dest.relative_to(REPO)
    except ValueError:
        return f"{target}: outside the repository"
    if anchor and dest.is_file() and dest.suffix == ".md" and unquote(anchor).lower() not in _anchors(dest):
        return f"{target}: no heading with anchor #{anchor} in {_rel(dest)}"
    return None


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_relative_links_resolve(doc: Path) -> None:
    problems = [p for t in _links(doc) if (p := _link_problem(doc, t))]
    assert not problems, f"{_rel(doc)}: broken links:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_tierstore_paths_exist(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    missing = sorted({p for p in _PY_PATH.findall(text) if not (REPO / p).is_file()})
    assert not missing, f"{_rel(doc)} names files that do not exist: {missing}"


def test_design_is_a_map_of_at_most_600_lines() -> None:
    n = len(DESIGN.read_text(encoding="utf-8").splitlines())
    assert n <= DESIGN_MAX_LINES, f"docs/DESIGN.md has {n} lines (at most {DESIGN_MAX_LINES}): move detail to docs/measurements/"


def _design_layout_modules() -> set[str]:
    """The modules listed in DESIGN.md §1's tree: the first column of the block under ``tierstore/``."""
    text = DESIGN.read_text(encoding="utf-8")
    section = text.split("## 1. Code layout", 1)[1].split("\n## 2.", 1)[0]
    listed: set[str] = set()
    in_tree = False
    for line in section.splitlines():
        if _FENCE.match(line):
            in_tree = False
            continue
        if line.rstrip() == "tierstore/":
            in_tree = True
            continue
        if in_tree:
            m = re.match(r"^  ([\w/]+\.py)\b", line)
            if m:
                listed.add(f"tierstore/{m.group(1)}")
                listed.update(f"tierstore/{x}" for x in re.findall(r"\b(__main__\.py)\b", line))
    return listed


def test_design_layout_lists_every_module() -> None:
    listed = _design_layout_modules()
    assert listed, "docs/DESIGN.md §1: no module tree found under a 'tierstore/' line"
    existing = {_rel(p) for p in (REPO / "tierstore").rglob("*.py") if "__pycache__" not in p.parts}
    # A subpackage's __init__.py is listed only when it holds code worth a line.
    required = {p for p in existing if not (p.endswith("/__init__.py") and p.count("/") > 1)}
    assert not listed - existing, f"docs/DESIGN.md §1 lists modules that do not exist: {sorted(listed - existing)}"
    assert not required - listed, (
        f"docs/DESIGN.md §1 misses modules (add a line each: what the module owns): {sorted(required - listed)}")


def test_the_slug_rule_matches_githubs() -> None:
    assert _slug("Configuration (`kv_connector_extra_config`)") == "configuration-kv_connector_extra_config"
    assert _slug("6. Decisions and the figures behind them") == "6-decisions-and-the-figures-behind-them"
    assert _slug("Maintenance at 10^6 pages (2026-11-23)") == "maintenance-at-106-pages-2026-11-23"
    assert _slug("What ran where (final code, 2026-11-22)") == "what-ran-where-final-code-2026-11-22"
