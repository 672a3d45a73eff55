"""The package's floor plan holds (docs/DESIGN.md §1): no import circle, counting function-level
and ``TYPE_CHECKING`` imports; no import running up the layers; no class over 300 lines; only
the chosen entry points at the top level. Pure AST walks of ``tierstore/`` (no import)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "tierstore"
# Bottom up; an import may go down or sideways within a floor, never up.
LAYERS = [["errors", "metrics"], ["fs", "config", "store"], ["format"], ["native", "kernels"], ["index"],
          ["rootstore"], ["objstore"], ["tiers"], ["admin", "testing"], ["vllm"], ["bench", "demo", "__main__", "__init__"]]
TOP_LEVEL = {"__init__.py", "__main__.py", "config.py", "demo.py", "errors.py", "metrics.py", "store.py"}


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        name = ".".join(p.with_suffix("").relative_to(PKG.parent).parts)
        out[name.removesuffix(".__init__")] = p
    return out


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # ``from pkg import module`` imports the module (and runs the package's __init__,
                # which only re-exports); ``from module import name`` the module.
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods]
                targets = subs or [node.module]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name and t.startswith("tierstore"):
                    edges[name].add(t)
    return edges


def _circles(edges: dict[str, set[str]], nodes: list[str]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in nodes:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle() -> None:
    mods = _modules()
    assert _circles(_imports(mods), sorted(mods)) == []


def test_imports_run_down_the_layers() -> None:
    rank = {unit: i for i, floor in enumerate(LAYERS) for unit in floor}
    mods = _modules()
    up = []
    for src, dsts in _imports(mods).items():
        a = src.split(".")[1] if "." in src else "__init__"
        for dst in dsts:
            b = dst.split(".")[1] if "." in dst else "__init__"
            assert a in rank and b in rank, f"{a} or {b} is on no floor: add it to LAYERS and DESIGN §1"
            if a != b and rank[b] > rank[a]:
                up.append(f"{src} -> {dst}")
    assert up == []


def test_no_class_over_300_lines_and_only_entry_points_at_the_top() -> None:
    big = [f"{p.relative_to(PKG.parent)}:{n.name} {n.end_lineno - n.lineno + 1}"
           for p in PKG.rglob("*.py") for n in ast.walk(ast.parse(p.read_text()))
           if isinstance(n, ast.ClassDef) and n.end_lineno is not None and n.end_lineno - n.lineno + 1 > 300]
    assert big == []
    assert {p.name for p in PKG.glob("*.py")} == TOP_LEVEL


def test_one_list_of_gone_errnos() -> None:
    """"The file is gone" is decided by ``errors.GONE_ERRNOS`` alone: no other module spells a
    tuple, list or set of ENOENT beside ESTALE (three lists once disagreed on ENOTDIR)."""
    spelled = []
    for path in PKG.rglob("*.py"):
        if path == PKG / "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                names = {elt.attr for elt in node.elts if isinstance(elt, ast.Attribute)}
                if {"ENOENT", "ESTALE"} <= names:
                    spelled.append(f"{path.relative_to(PKG.parent)}:{node.lineno}")
    assert spelled == []
