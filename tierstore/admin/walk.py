"""What is in a tierstore root: the tree walk shared by ``fsck``, ``stats`` and ``ls``.

Contract:

- ``walk_root`` classifies every entry under ROOT without following a symlink (``os.scandir``
  + ``DirEntry.is_dir/is_file(follow_symlinks=False)`` and ``lstat``): namespaces (directories
  with a ``manifest.json``, or named like a digest), their group / rank / fan-out directories,
  page files, temp files (live or stale), orphans (pages of a group or rank the manifest does
  not know), NFS/FUSE silly-rename leftovers, symlinks and anything else (foreign). This module
  lists ROOT, the namespace directories and their group and rank directories; each fan-out
  directory is walked by ``fan_dir_walk`` (which hands pages to a ``PageVisitor``), entries that
  are not what their level holds are classified by ``classifier``, manifests are read by
  ``namespace_dirs``. The walk itself never opens a page file.
- ``listing=True`` (the default of ``tierstore stats`` and ``ls``) answers from the directory
  listing alone (see ``fan_dir_walk``); approximate there, and said so in the output.
- Untrusted input: every exception from one manifest or one entry becomes a finding about that
  entry and the walk goes on. ``--namespace`` takes a digest or a unique prefix of one
  (``resolve_namespace_filter``); ROOT is resolved once (``check_root``).

Threading: the walk lists namespace, group and rank directories on the calling thread and
hands each fan-out directory ``<aa>`` to a thread pool (``jobs`` threads); a visitor is called
from pool threads and must be thread-safe. Results are merged on the calling thread.
"""

from __future__ import annotations

import os
import stat as _stat
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tierstore.admin.adaptive_gate import AdaptiveGate
from tierstore.admin.classifier import SKIP_AT_ROOT, Classifier, is_skipped, scandir_sorted
from tierstore.admin.fan_dir_walk import FanDirWalker, PageVisitor
from tierstore.admin.findings import MANIFEST, Finding
from tierstore.admin.namespace_dirs import NamespaceDir, load_manifest, sliced_group_spec
from tierstore.admin.progress import Progress
from tierstore.admin.tally import Inventory
from tierstore.errors import ConfigError
from tierstore.format.identity import MANIFEST_NAME
from tierstore.fs import safefs
from tierstore.fs.display import escape
from tierstore.fs.mapper import (
    NAMESPACE_DIR_RE,
    is_fanout_name,
    parse_index_dir,
    parse_rank_dir,
    parse_slice_dir,
)
from tierstore.fs.stale_temps import MANIFEST_TEMP_RE

FanDir = tuple[Path, int, int, bool]  # (<aa> directory, group, rank, orphan)


def _has_entry(root_fd: int, ns_name: str, name: str) -> bool:
    """Whether ``ns_name/name`` exists (of any type) under the root, without following links."""
    try:
        os.stat(f"{ns_name}/{name}", dir_fd=root_fd, follow_symlinks=False)
    except (OSError, ValueError):
        return False
    return True


def list_namespaces(root: Path, inv: Inventory, only: str | None, cls: Classifier) -> list[NamespaceDir]:
    """The namespace directories under ``root`` (only ``only`` when given), manifests read;
    every other entry of ROOT is classified into ``inv``."""
    root_fd = safefs.open_root(root)
    try:
        return _namespaces(root, inv, only, cls, root_fd)
    finally:
        os.close(root_fd)


def _namespaces(root: Path, inv: Inventory, only: str | None, cls: Classifier, root_fd: int) -> list[NamespaceDir]:
    out = []
    for e in scandir_sorted(root, inv):
        if is_skipped(e.name) or e.name in SKIP_AT_ROOT:
            continue
        if only is not None and not e.name.startswith(only):
            continue
        if not e.is_dir(follow_symlinks=False):
            if only is None:
                cls.other(e, inv, "namespace directories")
            continue
        path = Path(e.path)
        mpath = path / MANIFEST_NAME
        has_manifest = _has_entry(root_fd, e.name, MANIFEST_NAME)
        if not has_manifest and not NAMESPACE_DIR_RE.match(e.name):
            if only is None:
                cls.other(e, inv, "namespace directories")
            continue
        nsd = NamespaceDir(e.name, path, None)
        if not has_manifest:
            nsd.error = f"no {MANIFEST_NAME} (run an engine of this model once to rewrite it, or delete the directory)"
        else:
            load_manifest(nsd, root_fd)
        if nsd.error:
            inv.findings.append(Finding(str(mpath), MANIFEST, "manifest", nsd.error))
        out.append(nsd)
    return out


def fan_dirs(nsd: NamespaceDir, inv: Inventory, cls: Classifier) -> list[FanDir]:
    """(aa dir, group, rank, orphan) for every fan-out directory of a namespace."""
    out = []
    for e in scandir_sorted(nsd.path, inv):
        if is_skipped(e.name):
            continue
        if e.name == MANIFEST_NAME and e.is_file(follow_symlinks=False):
            continue
        m = MANIFEST_TEMP_RE.match(e.name)
        if m and e.is_file(follow_symlinks=False):
            cls.temp(e, inv, m.group(1), int(m.group(2)))
            continue
        g = parse_index_dir(e.name, "g")
        if g is None or not e.is_dir(follow_symlinks=False):
            cls.other(e, inv, "g<group> directories and manifest.json")
            continue
        group_known = nsd.namespace is None or g < len(nsd.namespace.groups)
        for r_entry in scandir_sorted(Path(e.path), inv):
            if is_skipped(r_entry.name):
                continue
            r = parse_rank_dir(r_entry.name)
            if r is None or not r_entry.is_dir(follow_symlinks=False):
                cls.other(r_entry, inv, "r<rank> or h<start>-<count> directories")
                continue
            heads = parse_slice_dir(r_entry.name)
            world = nsd.world_size
            if heads is None:
                orphan = not group_known or (world is not None and r >= world)
            else:  # a head slice: any TP may have written it; its heads must be the group's
                orphan = not group_known or (nsd.namespace is not None
                                             and sliced_group_spec(nsd.namespace.groups[g], heads) is None)
            for a_entry in scandir_sorted(Path(r_entry.path), inv):
                if is_skipped(a_entry.name):
                    continue
                if not is_fanout_name(a_entry.name) or not a_entry.is_dir(follow_symlinks=False):
                    cls.other(a_entry, inv, "two-hex-digit fan-out directories")
                    continue
                out.append((Path(a_entry.path), g, r, orphan))
    return out

def resolve_namespace_filter(root: Path, namespace: str | None) -> str | None:
    """Check a ``--namespace`` value (a digest or a unique prefix of one); returns the full name."""
    if namespace is None:
        return None
    names = []
    with os.scandir(root) as it:
        for e in it:
            if e.name.startswith(namespace) and e.is_dir(follow_symlinks=False) and not is_skipped(e.name):
                names.append(e.name)
    if not names:
        raise ConfigError(f"no namespace directory under {root} starts with {namespace!r} (see `tierstore ls {root}`)")
    if len(names) > 1 and namespace not in names:
        raise ConfigError(f"--namespace {namespace!r} is ambiguous: {sorted(names)}")
    return namespace if namespace in names else names[0]


def check_root(root: str | os.PathLike[str]) -> Path:
    """The root to walk: resolved once (a symlinked ROOT is the user's choice), must be a directory."""
    path = Path(os.path.realpath(root))
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ConfigError(f"ROOT {escape(root)} is not accessible: {exc.strerror} "
                          "(pass the cache directory given as \"root\")") from exc
    if not _stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"ROOT {escape(root)} is not a directory (pass the cache directory given as \"root\")")
    return path


def walk_root(
    root: str | os.PathLike[str],
    *,
    visitor: PageVisitor | None = None,
    namespace: str | None = None,
    jobs: int = 8,
    tmp_age: float = 3600.0,
    now: float | None = None,
    progress: Progress | None = None,
    listing: bool = False,
    gate: AdaptiveGate | None = None,
) -> Inventory:
    """Classify everything under ``root``; see the module docstring (``listing``: count page
    names without a stat per page; only without a visitor; ``gate``: how many of the ``jobs``
    threads list a fan-out directory or handle one of its entries at once)."""
    root_path = check_root(root)
    only = resolve_namespace_filter(root_path, namespace)
    cls = Classifier(time.time() if now is None else now, tmp_age)
    walker = FanDirWalker(root_path, visitor, cls, progress, listing=listing, gate=gate)
    inv = Inventory(root_path)
    inv.namespaces = list_namespaces(root_path, inv, only, cls)
    units = [(nsd, *fan) for nsd in inv.namespaces if nsd.walk for fan in fan_dirs(nsd, inv, cls)]
    if progress:
        progress.total_dirs = len(units)
    pool = ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="tierstore-walk")
    try:
        futures = [pool.submit(walker.fan_dir, *u) for u in units]
        for fut in futures:
            inv.merge(fut.result())
            if progress:
                progress.advance(dirs=1)
    except BaseException:
        # Ctrl-C or a bug: stop the workers at their next directory instead of finishing the tree.
        walker.stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    inv.findings.sort(key=lambda f: (f.path, f.category))
    return inv
