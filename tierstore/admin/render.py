"""Text renderings for people of the stats dict (``stats.collect_stats``): ``format_stats``
(``tierstore stats``), ``format_listing`` (``tierstore ls``) and ``human_bytes``, the size
style of every command's text output.

Contract: names and manifest strings are escaped (``display.escape``; the dict keeps raw
values); an estimated value is marked "~" and explained under the table.

Threading: pure functions.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tierstore.fs.display import escape


def human_bytes(n: float) -> str:
    """``n`` bytes for people: "512 B", "1.5 MiB", ... up to TiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _table(rows: Iterable[list[str]], header: list[str]) -> str:
    rows = [header, *rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)

def format_stats(stats: dict[str, Any]) -> str:
    """Human-readable rendering of ``collect_stats``'s dict (names and manifest strings escaped)."""
    out = [f"root {escape(stats['root'])}: {stats['totals']['namespaces']} namespace(s), "
           f"{stats['totals']['files']} pages, {human_bytes(stats['totals']['bytes'])}"]
    for n in stats["namespaces"]:
        out.append("")
        if n["manifest_error"]:
            out.append(f"namespace {escape(n['namespace'])}  (manifest: {escape(n['manifest_error'])})")
        else:
            rev = f"@{escape(n['revision'])}" if n["revision"] else ""
            par = ",".join(f"{escape(k)}={escape(v)}" for k, v in n["parallel"].items() if v != 1) or "single rank"
            out.append(f"namespace {escape(n['namespace'])}  model {escape(n['model'])}{rev}  "
                       f"dtype {escape(n['dtype'])}  hash {escape(n['hash_algo'])}  {par}")
        rows = []
        for g in n["groups"]:
            approx_bytes = "~" if g.get("bytes_source", "stat") != "stat" else ""
            rows.append([
                f"g{g['group']}", escape(g["kind"]), str(g["files"]), human_bytes(g["bytes"]) + approx_bytes,
                f"{g['tokens']}{'~' if g['tokens_source'] != 'headers' else ''}",
                ",".join(map(str, g["ranks"])), g["oldest"] or "-", g["newest"] or "-",
            ])
        if rows:
            out.append(_table(rows, ["group", "kind", "files", "bytes", "tokens", "ranks", "oldest", "newest"]))
        else:
            out.append("  (no pages)")
    other = {k: v for k, v in stats["other"].items() if v}
    if other:
        out.append("")
        out.append("other entries: " + ", ".join(f"{k}={v}" for k, v in sorted(other.items()))
                   + ("  (run `tierstore fsck` for details)" if set(other) - {"temps_active"} else ""))
    groups = [g for n in stats["namespaces"] for g in n["groups"]]
    if any(g.get("bytes_source", "stat") != "stat" for g in groups):
        out.append("~ bytes estimated as the uncompressed page size x files, newest from directory times "
                   "(--exact stats every page)")
    if any(g["tokens_source"] != "headers" for g in groups):
        out.append("~ token coverage estimated as tokens_per_chunk x files")
    return "\n".join(out)


def format_listing(stats: dict[str, Any]) -> str:
    """One line per namespace and group (``tierstore ls``; names and manifest strings escaped)."""
    rows = []
    for n in stats["namespaces"]:
        model = escape(n["model"]) if n["model"] else f"? ({escape(n['manifest_error'])})"
        name, dtype = escape(n["namespace"]), escape(n["dtype"] or "-")
        if not n["groups"]:
            rows.append([name, model, dtype, "-", "-", "0", "0 B", "-"])
        for g in n["groups"]:
            approx = "~" if g.get("bytes_source", "stat") != "stat" else ""
            rows.append([name, model, dtype, f"g{g['group']}", escape(g["kind"]),
                         str(g["files"]), human_bytes(g["bytes"]) + approx, g["newest"] or "-"])
    if not rows:
        return f"no namespaces under {escape(stats['root'])}"
    return _table(rows, ["namespace", "model", "dtype", "group", "kind", "files", "bytes", "newest"])
