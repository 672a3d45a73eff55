"""``tools/quick-mutants.py`` re-checks the quick loop's claim (docs/TESTING.md): each of its
breakages must still name text that is in its module exactly once, or the tool stops at that
mutant (exit 2) and the claim goes unchecked. Moving code (a module split) breaks this silently
until someone runs the tool; this test says so at once. Pure text: nothing is mutated or run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_mutant_names_text_found_once_in_its_module() -> None:
    spec = importlib.util.spec_from_file_location("quick_mutants", REPO / "tools" / "quick-mutants.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    counts = {m.name: (REPO / m.path).read_text().count(m.old) for m in tool.MUTANTS}
    assert len(counts) >= 10
    assert {name: n for name, n in counts.items() if n != 1} == {}
