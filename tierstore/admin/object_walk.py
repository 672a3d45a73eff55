"""What is under an object tier's bucket prefix (``s3://BUCKET/PREFIX``): the listing walk shared
by ``tierstore fsck``, ``stats`` and ``ls`` on a URL, the object twin of ``walk.walk_root``.

Contract:

- An object's key is ``PREFIX/`` + a page file's path under a file root, so the listing is read
  as that directory tree (``ObjectWalk``): ``<ns>/manifest.json``,
  ``<ns>/g<g>/<r<rank>|h<start>-<count>>/<aa>/<key>.kvp``. The result is the directory walk's
  ``tally.Inventory`` (namespaces as ``NamespaceDir``, findings, ``GroupTally`` per namespace,
  group and rank), so ``stats.stats_from_inventory``, ``render`` and ``fsck.FsckReport`` serve
  both; ``stats_dict`` puts the URL where the directory's paths are.
- The same rules as the directory walk: a namespace is a top-level name with a
  ``manifest.json`` object or named like a digest; its manifest is read by
  ``namespace_dirs.load_manifest`` (the directory fsck's bounded, checked read and parse; the
  object's size is checked against ``MANIFEST_MAX_BYTES`` before its GET), every problem a
  ``MANIFEST`` finding; a namespace of another page format is neither listed further nor
  counted; a page in a group, rank or head slice the manifest does not know is an ``ORPHAN``,
  a page under the wrong fan-out name a misplaced ``BAD_PAGE``. Names skipped everywhere
  (``classifier.is_skipped``: ``.tierstore*``, the object tier's probes, and ``.snapshot``) and at
  the top (``.quarantine``, ``lost+found``) are skipped. Anything else is ``FOREIGN``: one
  finding per entry at the first level where it is not what that level holds, as a directory
  is one finding in the directory walk (``kind`` "dir" for a key prefix, with its object count
  and bytes, "file" for an object). Buckets have no temp files, links or modes: none of those
  findings arise.
- ``listing=True`` (stats, ls): each page object is counted from the listing alone, its size
  and last-modified time exact (``bytes_source`` "stat": object bytes are the file bytes), token
  coverage ``tokens_per_chunk`` x files; no GET. A misplaced page is counted, as in the
  directory listing. Otherwise each page at its proper place goes to ``on_page`` (fsck).
- ``sources``: object key and ETag of every object a finding names (what a repair re-checks);
  ``old_pages`` (with ``keep_old``): the objects of namespaces of an older page format.
- ``tierstore stats|ls s3://...`` (``collect_object_stats``): ``--namespace``, ``--json`` and
  ``--progress`` as on a directory; ``--exact``, ``--no-headers`` and ``--jobs`` are accepted and
  change nothing (one listing: sizes and times are exact already; token coverage stays the
  estimate, since no object is read). A prefix holding objects but no namespace is refused
  (exit 8), as a directory that is not a cache is.

Failure policy: a failed LIST raises its ``PageError`` (the command's operational error, exit
8); a failed manifest request is a ``MANIFEST`` finding about that namespace.
Threading: runs on the calling thread; ``on_page`` is called on it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierstore.admin.classifier import SKIP_AT_ROOT, is_skipped
from tierstore.admin.findings import BAD_PAGE, FOREIGN, MANIFEST, ORPHAN, Finding
from tierstore.admin.namespace_dirs import (
    MANIFEST_MAX_BYTES,
    NamespaceDir,
    load_manifest,
    sliced_group_spec,
)
from tierstore.admin.progress import progress_bar
from tierstore.admin.render import human_bytes
from tierstore.admin.stats import stats_from_inventory
from tierstore.admin.tally import GroupTally, Inventory
from tierstore.config import ObjectLocation
from tierstore.errors import ConfigError, PageError, PageMissing, TierStoreError
from tierstore.format.identity import MANIFEST_NAME, GroupSpec
from tierstore.fs import safefs
from tierstore.fs.display import escape
from tierstore.fs.mapper import (
    NAMESPACE_DIR_RE,
    PAGE_SUFFIX,
    fanout,
    is_fanout_name,
    parse_index_dir,
    parse_page_name,
    parse_rank_dir,
    parse_slice_dir,
)
from tierstore.objstore.client import ObjectClient, ObjectInfo

# Per request of the admin commands: longer than the tier's (object_deadline_s, 10 s), which
# trades a page for a recompute; here a slow answer only makes the walk slower.
ADMIN_DEADLINE_S = 30.0


@dataclass(frozen=True)
class ObjectPage:
    """A page object at its proper place, handed to ``on_page`` (``fan_dir_walk.PageRef``'s twin)."""

    path: str  # s3://BUCKET/KEY: what findings name
    key: str  # the object key
    ns: NamespaceDir
    group_index: int
    rank: int
    page_key: bytes
    size: int
    mtime: float
    etag: str
    group: GroupSpec | None  # the slice's spec in a head-slice prefix; None without a usable manifest


def open_client(url: str, deadline_s: float = ADMIN_DEADLINE_S) -> ObjectClient:
    """The client of ``s3://BUCKET/PREFIX`` (``ConfigError`` for another form; endpoint and
    credentials from the ``AWS_*`` variables, see ``objstore.client``)."""
    return ObjectClient(ObjectLocation.parse(url, setting="ROOT"), deadline_s)


def object_url(location: ObjectLocation, key: str) -> str:
    return f"s3://{location.bucket}/{key}"


class ObjectProgress:
    """The progress bar of a walk over objects (``progress.progress_bar``'s style): objects done,
    their bytes and the problems so far. Threading: ``advance`` from any thread (a lock)."""

    def __init__(self, label: str, enabled: bool | None) -> None:
        self._bar = progress_bar(label, unit="obj", enabled=enabled)
        self._lock = threading.Lock()
        self.nbytes = 0
        self.problems = 0

    def advance(self, objects: int = 1, nbytes: int = 0, problems: int = 0) -> None:
        with self._lock:
            self.nbytes += nbytes
            self.problems += problems
            if not self._bar.disable:
                self._bar.set_postfix_str(f"{human_bytes(self.nbytes)}, {self.problems} problems", refresh=False)
                self._bar.update(objects)

    def close(self) -> None:
        with self._lock:
            self._bar.close()


@dataclass
class _Foreign:
    """Objects under one entry that is not what its level holds."""

    expected: str
    is_dir: bool
    objects: int = 0
    nbytes: int = 0
    newest: float | None = None


def _safe_name(name: str) -> bool:
    return name not in ("", ".", "..") and "\0" not in name and len(name.encode()) <= 255


class ObjectWalk:
    """One listing of a bucket prefix read as a tierstore root (module docstring)."""

    def __init__(self, client: ObjectClient, *, namespace: str | None = None, listing: bool = False,
                 on_page: Callable[[ObjectPage, Inventory], None] | None = None,
                 progress: ObjectProgress | None = None, keep_old: bool = False) -> None:
        self.client = client
        self.location = client.location
        self.url = self.location.url
        self.only = namespace
        self.listing = listing
        self.on_page = on_page
        self.progress = progress
        self.keep_old = keep_old
        self.inv = Inventory(Path(self.location.prefix or "."))
        self.sources: dict[str, tuple[str, str]] = {}  # finding path -> (object key, ETag)
        self.old_pages: dict[str, list[ObjectInfo]] = {}  # namespaces of another format: their pages
        self._tops: dict[str, NamespaceDir | None] = {}
        self._dirs: dict[tuple[str, int, str], tuple[str | None, GroupSpec | None]] = {}
        self._foreign: dict[str, _Foreign] = {}
        self._scratch: tempfile.TemporaryDirectory[str] | None = None
        self._scratch_fd = -1

    def run(self) -> Inventory:
        """List the prefix (one LIST request per 1,000 objects) and classify every object."""
        base = self.location.key(self.only) if self.only is not None else self.location.prefix
        cut = len(self.location.prefix) + 1 if self.location.prefix else 0
        try:
            for info in self.client.list_keys(base):
                rel = info.key[cut:] if info.key.startswith(self.location.prefix) else ""
                if rel:
                    self._object(rel, info)
        finally:
            self._close_scratch()
        for path, f in sorted(self._foreign.items()):
            what = f"{f.objects} object(s) under it" if f.is_dir else "an object"
            self.inv.findings.append(Finding(
                object_url(self.location, self.location.key(path)), FOREIGN, "dir" if f.is_dir else "file",
                f"not written by tierstore (expected {f.expected}); {what}", size=f.nbytes, mtime=f.newest,
                is_dir=f.is_dir))
        self.inv.namespaces.sort(key=lambda n: n.name)
        self.inv.findings.sort(key=lambda f: (f.path, f.category))
        return self.inv

    # ------------------------------------------------------------------ one object
    def _object(self, rel: str, info: ObjectInfo) -> None:
        parts = rel.split("/")
        top = parts[0]
        if any(is_skipped(p) for p in parts) or top in SKIP_AT_ROOT:
            return
        if self.progress is not None and self.listing:
            self.progress.advance(1, info.size)
        if len(parts) == 1:
            return self._other(parts, 1, info, "namespace directories")
        nsd = self._namespace(top)
        if nsd is None:
            return self._other(parts, 1, info, "namespace directories")
        if not nsd.walk:
            if self.keep_old:
                self.old_pages.setdefault(nsd.name, []).append(info)
            return None
        if len(parts) == 2 and parts[1] == MANIFEST_NAME:
            return None
        g = parse_index_dir(parts[1], "g")
        if g is None or len(parts) < 3:
            return self._other(parts, 2, info, "g<group> directories and manifest.json")
        r = parse_rank_dir(parts[2])
        if r is None or len(parts) < 4:
            return self._other(parts, 3, info, "r<rank> or h<start>-<count> directories")
        if not is_fanout_name(parts[3]) or len(parts) < 5:
            return self._other(parts, 4, info, "two-hex-digit fan-out directories")
        name = parts[4]
        key = parse_page_name(name) if name.endswith(PAGE_SUFFIX) and len(parts) == 5 else None
        if key is None:
            return self._other(parts, 5, info, "page files")
        self._page(nsd, g, parts[2], r, parts[3], key, info)
        return None

    def _page(self, nsd: NamespaceDir, g: int, rdir: str, r: int, fan: str, key: bytes, info: ObjectInfo) -> None:
        path = object_url(self.location, info.key)
        mtime = info.last_modified.timestamp()
        orphan, group = self._place(nsd, g, rdir, r)
        if orphan is not None:
            self.inv.findings.append(Finding(path, ORPHAN, "orphan", orphan, size=info.size, mtime=mtime))
            self.sources[path] = (info.key, info.etag)
            return
        if self.listing or self.on_page is None:
            self.inv.pages_seen += 1
            tokens = group.tokens_per_chunk if group is not None else 0
            self.inv.tallies.setdefault((nsd.name, g, r), GroupTally()).add(info.size, mtime, tokens, False)
            return
        if fanout(key) != fan:
            self.inv.findings.append(Finding(path, BAD_PAGE, "misplaced", "page name does not belong in this "
                                             "fan-out directory", size=info.size, mtime=mtime))
            self.sources[path] = (info.key, info.etag)
            return
        self.inv.pages_seen += 1
        self.on_page(ObjectPage(path, info.key, nsd, g, r, key, info.size, mtime, info.etag, group), self.inv)

    def _place(self, nsd: NamespaceDir, g: int, rdir: str, r: int) -> tuple[str | None, GroupSpec | None]:
        """(why its pages are orphans or None, the group spec its pages have) of a rank prefix:
        the rules of ``walk.fan_dirs`` and ``fan_dir_walk``."""
        memo = self._dirs.get((nsd.name, g, rdir))
        if memo is not None:
            return memo
        group = nsd.group(g)
        heads = parse_slice_dir(rdir)
        world = nsd.world_size
        why = None
        if nsd.namespace is not None and group is None:
            why = f"group {g} is not in the namespace's manifest"
        elif heads is None and world is not None and r >= world:
            why = f"rank {r} is outside the manifest's parallel layout ({world} ranks)"
        elif heads is not None and group is not None:
            group = sliced_group_spec(group, heads)
            if group is None:
                why = f"head slice {rdir} is not one of the group's KV heads"
        self._dirs[(nsd.name, g, rdir)] = memo = (why, group)
        return memo

    def _other(self, parts: list[str], depth: int, info: ObjectInfo, expected: str) -> None:
        """An object at a place that does not hold it: one finding per entry (module docstring)."""
        is_dir = len(parts) > depth
        path = "/".join(parts[:depth]) + ("/" if is_dir else "")
        f = self._foreign.get(path)
        if f is None:
            f = self._foreign[path] = _Foreign(expected, is_dir)
        f.objects += 1
        f.nbytes += info.size
        t = info.last_modified.timestamp()
        f.newest = t if f.newest is None else max(f.newest, t)

    # ------------------------------------------------------------------ namespaces
    def _namespace(self, top: str) -> NamespaceDir | None:
        if top in self._tops:
            return self._tops[top]
        found = NamespaceDir(top, Path(top), None)
        nsd: NamespaceDir | None = found
        mkey = self.location.key(f"{top}/{MANIFEST_NAME}")
        try:
            info = self.client.head(mkey) if _safe_name(top) else None
        except PageError as exc:
            info, found.error = None, f"unreadable manifest: {exc.message}"
        if info is None and found.error is None:
            if not NAMESPACE_DIR_RE.match(top):
                nsd = None
            else:
                found.error = (f"no {MANIFEST_NAME} (run an engine of this model once to rewrite it, or delete the "
                             "directory)")
        elif info is not None:
            self._load_manifest(found, mkey, info)
        self._tops[top] = nsd
        if nsd is not None:
            if nsd.error:
                self.inv.findings.append(Finding(object_url(self.location, mkey), MANIFEST, "manifest", nsd.error))
            self.inv.namespaces.append(nsd)
        return nsd

    def _load_manifest(self, nsd: NamespaceDir, mkey: str, info: ObjectInfo) -> None:
        """GET the manifest object (bounded) and read it with the directory fsck's own code, from a
        private scratch directory: one parser, one set of checks, one wording."""
        try:
            if info.size > MANIFEST_MAX_BYTES:
                raise safefs.UnsafeEntry("too_large", MANIFEST_NAME, f"{info.size} bytes, more than "
                                         f"{MANIFEST_MAX_BYTES}")
            body, _ = self.client.get(mkey)
            if len(body) > MANIFEST_MAX_BYTES:
                raise safefs.UnsafeEntry("too_large", MANIFEST_NAME, f"{len(body)} bytes, more than "
                                         f"{MANIFEST_MAX_BYTES}")
            root_fd = self._scratch_root()
            os.mkdir(nsd.name, 0o700, dir_fd=root_fd)
            fd = os.open(f"{nsd.name}/{MANIFEST_NAME}", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                         dir_fd=root_fd)
            try:
                safefs.write_all(fd, body)
            finally:
                os.close(fd)
        except PageMissing:
            nsd.error = f"no {MANIFEST_NAME} (removed while fsck ran)"
            return
        except (PageError, OSError) as exc:
            nsd.error = f"unreadable manifest: {exc.message if isinstance(exc, PageError) else exc}"
            return
        load_manifest(nsd, root_fd)

    def _scratch_root(self) -> int:
        if self._scratch is None:
            self._scratch = tempfile.TemporaryDirectory(prefix="tierstore-manifests-")
            self._scratch_fd = safefs.open_root(self._scratch.name)
        return self._scratch_fd

    def _close_scratch(self) -> None:
        if self._scratch_fd >= 0:
            os.close(self._scratch_fd)
            self._scratch_fd = -1
        if self._scratch is not None:
            with contextlib.suppress(OSError):
                self._scratch.cleanup()
            self._scratch = None


def resolve_namespace(client: ObjectClient, namespace: str | None) -> str | None:
    """A ``--namespace`` value (a digest or a unique prefix of one) as a namespace's name under
    the prefix; ``ConfigError`` as ``walk.resolve_namespace_filter``."""
    if namespace is None:
        return None
    loc = client.location
    names: set[str] = set()
    if NAMESPACE_DIR_RE.match(namespace):
        if next(iter(client.list_keys(loc.key(namespace))), None) is not None:
            names.add(namespace)
    else:
        cut = len(loc.prefix) + 1 if loc.prefix else 0
        for info in client.list_keys(loc.prefix):
            top, slash, _ = info.key[cut:].partition("/")
            if slash and top.startswith(namespace) and not is_skipped(top):
                names.add(top)
    if not names:
        raise ConfigError(f"no namespace directory under {escape(loc.url)} starts with {namespace!r} "
                          f"(see `tierstore ls {escape(loc.url)}`)")
    if len(names) > 1 and namespace not in names:
        raise ConfigError(f"--namespace {namespace!r} is ambiguous: {sorted(names)}")
    return namespace if namespace in names else min(names)


def stats_dict(inv: Inventory, url: str) -> dict[str, Any]:
    """``stats.stats_from_inventory`` of an object walk, the URL as its root and paths."""
    doc = stats_from_inventory(inv)
    doc["root"] = url
    for n in doc["namespaces"]:
        n["path"] = f"{url.rstrip('/')}/{n['namespace']}"
    return doc


def collect_object_stats(url: str, *, namespace: str | None = None, progress: bool | None = None,
                         label: str = "stats") -> dict[str, Any]:
    """``tierstore stats|ls s3://...``: the stats dict of one listing (no GET; module docstring).
    A prefix holding objects but no namespace is refused (``TierStoreError``), as a directory
    that is not a cache is (``tiers.gc.not_a_cache``)."""
    client = open_client(url)
    bar = ObjectProgress(label, progress)
    try:
        walk = ObjectWalk(client, namespace=resolve_namespace(client, namespace), listing=True, progress=bar)
        inv = walk.run()
    finally:
        bar.close()
    if not inv.namespaces and namespace is None:
        names = sorted({f.path.rstrip("/").rsplit("/", 1)[-1] for f in inv.findings if f.category == FOREIGN})
        if names:
            shown = ", ".join(escape(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
            raise TierStoreError(f"refusing {escape(client.location.url)}: it holds {len(names)} entries ({shown}) "
                                 "and no namespace directory: probably not a cache prefix; pass the URL given as "
                                 "\"object_url\"")
    return stats_dict(inv, client.location.url)
