"""``tierstore stats`` and ``ls``: what a walk of a tierstore root holds, per namespace and
group (files, bytes, token coverage, oldest/newest, model info), as a plain dict.

Contract:

- ``collect_stats`` walks ROOT (``walk.walk_root``) and returns ``stats_from_inventory``'s dict
  (schema key ``tierstore_stats``; fsck's JSON report embeds it); other packages may add keys
  to that dict (for example per-tier metrics). ``listing_json`` is ``ls --json``'s document
  (schema key ``tierstore_ls``); ``render`` holds the text renderings.
- Reading: ``read_headers`` reads only each page's header (``read_header``: usually its first
  4 KiB, never following a symlink; a bad header is a ``BAD_PAGE`` finding); without it no file
  is read and token coverage is ``tokens_per_chunk`` x files (``tokens_source`` "estimate");
  ``listing`` does not stat pages either (``bytes_source`` "layout", see ``fan_dir_walk``).
- Every group of a manifest is listed, even without pages; token coverage is per rank (every
  rank stores its own slice of the same tokens) and a namespace's is its least-covered group's.

Threading: ``collect_stats`` runs on the calling thread (the walk uses its own pool;
``read_header_tokens`` is called from it and keeps no state).
"""

from __future__ import annotations

import os
import time
from typing import Any

from tierstore.admin.fan_dir_walk import PageRef, PageVerdict
from tierstore.admin.findings import BAD_PAGE, Finding
from tierstore.admin.progress import Progress
from tierstore.admin.tally import GroupTally, Inventory
from tierstore.admin.walk import walk_root
from tierstore.errors import GONE_ERRNOS, PageError, PageIOError, PageMissing
from tierstore.format.header import HEADER_ALIGN, PageHeader, decode_header, header_len_of
from tierstore.format.identity import GroupSpec
from tierstore.fs.display import iso_utc


def read_header(path: str) -> PageHeader:
    """Read and verify only a page's header (usually its first 4 KiB); never follows a symlink.

    Raises a typed ``PageError`` (``PageMissing`` if the file is gone, ``PageIOError`` on
    other OS errors).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno in GONE_ERRNOS:
            raise PageMissing("no such page", path=path) from exc
        raise PageIOError(f"cannot open: {exc.strerror}", errno=exc.errno, path=path) from exc
    try:
        first = os.pread(fd, HEADER_ALIGN, 0)
        header_len = header_len_of(first, path=path)
        if header_len > len(first):
            first += os.pread(fd, header_len - len(first), len(first))
        return decode_header(first, path=path)
    except OSError as exc:
        raise PageIOError(f"read failed: {exc.strerror}", errno=exc.errno, path=path) from exc
    finally:
        os.close(fd)


def read_header_tokens(ref: PageRef) -> PageVerdict:
    """Visitor for ``stats``: read only the header (usually the first 4 KiB)."""
    try:
        header = read_header(ref.path)
    except PageMissing:
        return PageVerdict(vanished=True)
    except PageError as exc:
        return PageVerdict(problem=Finding(ref.path, BAD_PAGE, exc.kind, str(exc), size=ref.size))
    return PageVerdict(token_count=header.meta.token_count)


def _iso(t: float | None) -> str | None:
    return iso_utc(t)


def collect_stats(
    root: str | os.PathLike[str],
    *,
    namespace: str | None = None,
    read_headers: bool = True,
    jobs: int = 8,
    tmp_age: float = 3600.0,
    progress: Progress | None = None,
    listing: bool = False,
) -> dict[str, Any]:
    """Per namespace and group: files, bytes, token coverage, oldest/newest, model info.

    ``read_headers=False`` reads no file at all: token coverage is then
    ``tokens_per_chunk x files`` and ``tokens_source`` says "estimate". ``listing=True``
    (implies no headers) does not stat pages either: bytes come from the layout
    (``bytes_source`` "layout"), see the module docstring.
    """
    inv = walk_root(root, visitor=read_header_tokens if read_headers and not listing else None,
                    namespace=namespace, jobs=jobs, tmp_age=tmp_age, progress=progress, listing=listing)
    return stats_from_inventory(inv)


def _group_stats(g: int, spec: GroupSpec | None, tally: GroupTally, ranks: list[int], tokens: int) -> dict[str, Any]:
    """One group's entry of the stats dict: its manifest facts and its pages on all ranks."""
    from_headers = tally.tokens_from_headers
    return {
        "group": g,
        "kind": spec.kind.name.lower() if spec else None,
        "layers": len(spec.layer_names) if spec else None,
        "block_size": spec.block_size if spec else None,
        "tokens_per_chunk": spec.tokens_per_chunk if spec else None,
        "sliding_window": spec.sliding_window if spec else None,
        "page_bytes": spec.layout.nbytes if spec else None,
        "ranks": ranks,
        "files": tally.files,
        "bytes": tally.bytes,
        "tokens": tokens,
        "tokens_source": "headers" if from_headers == tally.files else ("estimate" if from_headers == 0 else "mixed"),
        "bytes_source": "stat" if tally.listed == 0 else ("layout" if tally.listed == tally.files else "mixed"),
        "oldest": _iso(tally.oldest),
        "newest": _iso(tally.newest),
    }


def stats_from_inventory(inv: Inventory) -> dict[str, Any]:
    """Turn a walk into the stats dict (also used by fsck's JSON report)."""
    namespaces = []
    for nsd in inv.namespaces:
        ns = nsd.namespace
        # Every group of the manifest is listed, even without pages.
        tallies = {g: GroupTally() for g in range(len(ns.groups) if ns else 0)}
        ranks: dict[int, list[int]] = {g: [] for g in tallies}
        tokens = dict.fromkeys(tallies, 0)
        for (name, g, r), t in sorted(inv.tallies.items()):
            if name != nsd.name:
                continue
            tallies.setdefault(g, GroupTally()).merge(t)
            ranks.setdefault(g, []).append(r)
            # Every rank stores its own slice of the same tokens: coverage is per rank.
            tokens[g] = max(tokens.get(g, 0), t.tokens)
        glist = [_group_stats(g, nsd.group(g), tallies[g], ranks[g], tokens[g]) for g in sorted(tallies)]
        all_t = GroupTally()
        for t in tallies.values():
            all_t.merge(t)
        namespaces.append({
            "namespace": nsd.name,
            "path": str(nsd.path),
            "manifest_error": nsd.error,
            "model": ns.model if ns else None,
            "revision": ns.revision if ns else None,
            "dtype": ns.dtype if ns else None,
            "hash_algo": ns.hash_algo if ns else None,
            "layout_id": ns.layout_id if ns else None,
            "format_version": ns.format_version if ns else None,
            "parallel": ns.parallel.to_json() if ns else None,
            "extra": dict(ns.extra) if ns else None,
            "num_groups": len(ns.groups) if ns else None,
            "files": all_t.files,
            "bytes": all_t.bytes,
            "bytes_source": "stat" if all_t.listed == 0 else ("layout" if all_t.listed == all_t.files else "mixed"),
            # The prefix length served is bounded by the least-covered group.
            "tokens": min((d["tokens"] for d in glist), default=0),
            "oldest": _iso(all_t.oldest),
            "newest": _iso(all_t.newest),
            "groups": glist,
        })
    counts: dict[str, int] = {}
    for f in inv.findings:
        counts[f.category] = counts.get(f.category, 0) + 1
    return {
        "tierstore_stats": 1,  # the schema's version (ls and stats print this document)
        "root": str(inv.root),
        "generated_at": _iso(time.time()),
        "namespaces": namespaces,
        "totals": {
            "namespaces": len(namespaces),
            "files": sum(n["files"] for n in namespaces),
            "bytes": sum(n["bytes"] for n in namespaces),
        },
        "other": {"temps_active": inv.temps_active, **counts},
    }


def listing_json(stats: dict[str, Any]) -> dict[str, Any]:
    """``tierstore ls --json``: one row per namespace and group (what ``format_listing`` prints),
    schema key ``tierstore_ls``; ``bytes`` are file bytes (st_size) or, where ``bytes_source`` is
    "layout", the uncompressed page file size x files (exact for uncompressed pages)."""
    rows = []
    for ns in stats["namespaces"]:
        if not ns["groups"]:  # a namespace whose manifest is unreadable: one row, as in the text
            rows.append({"namespace": ns["namespace"], "model": ns["model"], "dtype": ns["dtype"], "group": None,
                         "kind": None, "files": ns["files"], "bytes": ns["bytes"],
                         "bytes_source": ns["bytes_source"], "tokens": ns["tokens"], "tokens_source": None,
                         "newest": ns["newest"]})
        for g in ns["groups"]:
            rows.append({"namespace": ns["namespace"], "model": ns["model"], "dtype": ns["dtype"],
                         "group": g["group"], "kind": g["kind"], "files": g["files"], "bytes": g["bytes"],
                         "bytes_source": g["bytes_source"], "tokens": g["tokens"],
                         "tokens_source": g["tokens_source"], "newest": g["newest"]})
    return {"tierstore_ls": 1, "root": stats["root"], "generated_at": stats["generated_at"], "rows": rows,
            "totals": stats["totals"]}
