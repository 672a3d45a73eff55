"""Files a reader can hold, and modules that keep to their own names (docs/DESIGN.md §1):

- a module of ``tierstore/`` is at most 600 lines, a function or method at most 80;
- no module uses another tierstore module's private names: no ``from tierstore.x import _y``,
  no ``module._y`` on an imported tierstore module, no ``obj._y`` (``self`` included: a mixin or
  a subclass in another file counts) and no ``getattr(obj, "_y")`` where ``_y`` is defined only
  in other tierstore modules. Two modules that must share a frame or a result do it through a
  public property or a small protocol.

Pure AST walks of ``tierstore/`` (no import). A name is "defined" in a module when the module
binds it: a def or class, an assignment to a name or an attribute, an argument, an import, or a
``__slots__`` entry.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "tierstore"
MODULE_MAX_LINES = 600
FUNCTION_MAX_LINES = 80
# Private names that are vLLM's, not tierstore's: tierstore overrides them, and a benchmark
# times vLLM's and tierstore's versions side by side.
FOREIGN_PRIVATE = {"_maximal_prefix_lookup"}
_ATTR_CALLS = {"getattr", "setattr", "hasattr", "delattr"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != "_"


@cache
def _trees() -> dict[str, ast.Module]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        out[".".join(p.with_suffix("").relative_to(PKG.parent).parts).removesuffix(".__init__")] = (
            ast.parse(p.read_text(), filename=str(p)))
    return out


def _defined(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                                  for t in node.targets):
            names.update(c.value for c in ast.walk(node.value)
                         if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return {n for n in names if _private(n)}


def _module_aliases(tree: ast.Module, mods: dict[str, ast.Module]) -> dict[str, str]:
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tierstore"):
            for a in node.names:
                if f"{node.module}.{a.name}" in mods:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in mods and a.asname:
                    aliases[a.asname] = a.name
    return aliases


def private_reaches(trees: dict[str, ast.Module]) -> list[str]:
    defs = {name: _defined(tree) for name, tree in trees.items()}
    elsewhere: dict[str, set[str]] = {}
    for name, names in defs.items():
        for n in names:
            elsewhere.setdefault(n, set()).add(name)
    found = []
    for mod, tree in trees.items():
        aliases = _module_aliases(tree, trees)

        def foreign(attr: str, mod: str = mod) -> bool:
            return (_private(attr) and attr not in defs[mod] and attr not in FOREIGN_PRIVATE
                    and attr in elsewhere)

        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tierstore"):
                found += [f"{mod}:{node.lineno} from {node.module} import {a.name}"
                          for a in node.names if _private(a.name)]
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                v = node.value
                if isinstance(v, ast.Name) and aliases.get(v.id, mod) != mod:
                    found.append(f"{mod}:{node.lineno} {ast.unparse(node)}")
                elif foreign(node.attr):
                    found.append(f"{mod}:{node.lineno} {ast.unparse(node)} (bound in "
                                 f"{', '.join(sorted(elsewhere[node.attr]))})")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _ATTR_CALLS
                  and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                  and isinstance(node.args[1].value, str) and foreign(node.args[1].value)):
                found.append(f"{mod}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_module_over_600_lines() -> None:
    big = {f"{p.relative_to(PKG.parent)}": n for p in PKG.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MODULE_MAX_LINES}
    assert big == {}


def test_no_function_over_80_lines() -> None:
    long = [f"{mod}:{node.name} {node.end_lineno - node.lineno + 1}"
            for mod, tree in _trees().items() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None
            and node.end_lineno - node.lineno + 1 > FUNCTION_MAX_LINES]
    assert long == []


def test_no_module_uses_another_modules_private_names() -> None:
    assert private_reaches(_trees()) == []


def test_the_reach_check_finds_each_kind_of_reach() -> None:
    """The walk is not vacuous: each form of reach, planted in two small modules, is found."""
    owner = "_hidden = 1\nclass Base:\n    def __init__(self):\n        self._kept = self._other = 0\n"
    reacher = ("import tierstore.a as a\nfrom tierstore.a import _hidden\nfrom tierstore import a as b\n"
               "class C(a.Base):\n    def f(self, o):\n        o._other; b._hidden; self._kept\n"
               "        return getattr(o, '_kept')\n")
    reaches = private_reaches({"tierstore.a": ast.parse(owner), "tierstore.b": ast.parse(reacher)})
    assert [r.split(" (")[0] for r in reaches] == [
        "tierstore.b:2 from tierstore.a import _hidden", "tierstore.b:6 o._other", "tierstore.b:6 b._hidden",
        "tierstore.b:6 self._kept", "tierstore.b:7 getattr(o, '_kept')"]
