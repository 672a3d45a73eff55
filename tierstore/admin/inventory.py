"""What is in a tierstore root: the tree walk shared by ``fsck``, ``stats`` and ``ls``.

Contract:

- ``walk_root`` classifies every entry under ROOT without following a symlink (``os.scandir``
  + ``DirEntry.is_dir/is_file(follow_symlinks=False)`` and ``lstat``): namespaces (directories
  with a ``manifest.json``, or named like a digest), their group / rank / fan-out directories,
  page files, temp files (live or stale), orphans (pages of a group or rank the manifest does
  not know), NFS/FUSE silly-rename leftovers, symlinks and anything else (foreign). Each page
  file at its proper place is handed to a ``PageVisitor`` (fsck verifies it completely,
  ``stats --exact`` reads only its header, ``ls --exact`` reads nothing); the walk itself never
  opens a page file.
- ``listing=True`` (the default of ``tierstore stats`` and ``ls``) answers from the directory
  listing alone: page names are counted per (namespace, group, rank) without a ``stat`` or a
  read per page (one ``readdir`` per fan-out directory and one ``stat`` of the directory).
  Approximate there, and said so in the output: bytes are the layout's uncompressed page size
  x count (an upper bound for zstd pages), token coverage is ``tokens_per_chunk`` x count,
  "newest" is the fan-out directories' last change (a store or a removal), "oldest" is
  unknown, and a page whose name is in the wrong fan-out directory is counted (fsck finds it).
  Everything that is not a page name (temps, foreign files, symlinks) is classified as usual.
- Untrusted input: manifests are read through ``safefs`` (no symlink followed, FIFOs refused,
  at most ``MANIFEST_MAX_BYTES``); every exception from one manifest or one entry becomes a
  finding about that entry and the walk goes on; pids in temp names are range-checked. Text
  renderings escape names and manifest strings (``display.escape``); the dicts keep raw values.
- Names skipped everywhere: ``.snapshot`` (NetApp snapshots) and names beginning with
  ``.tierstore`` (reserved for tierstore's own state, e.g. gc bookkeeping of the tiers
  package). Skipped at ROOT only: ``.quarantine`` (fsck's quarantine) and ``lost+found``.
- ``collect_stats`` returns a plain dict (per namespace and group: files, bytes, token
  coverage, oldest/newest, model info); ``format_stats`` / ``format_listing`` render it.
  Other packages may add keys to that dict (for example per-tier metrics).

Threading: the walk lists namespace, group and rank directories on the calling thread and
hands each fan-out directory ``<aa>`` to a thread pool (``jobs`` threads); a visitor is called
from pool threads and must be thread-safe. Results are merged on the calling thread.
``Progress`` is thread-safe.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat as _stat
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, TextIO

from tierstore.admin.adaptive_gate import AdaptiveGate
from tierstore.errors import GONE_ERRNOS, ConfigError, PageError, PageIOError, PageMissing
from tierstore.format.identity import MANIFEST_NAME, GroupSpec, Namespace, page_file_size
from tierstore.format.page import (
    FORMAT_VERSION,
    HEADER_ALIGN,
    PageHeader,
    PageLayout,
    decode_header,
    header_len_of,
)
from tierstore.fs import safefs
from tierstore.fs.display import escape, iso_utc
from tierstore.fs.mapper import (
    NAMESPACE_DIR_RE,
    PAGE_NAME_RE,
    PAGE_SUFFIX,
    RESERVED_PREFIX,
    SILLY_RENAME_PREFIXES,
    fanout,
    host_tag,
    is_fanout_name,
    parse_index_dir,
    parse_page_name,
    parse_rank_dir,
    parse_slice_dir,
    parse_temp_name,
)
from tierstore.fs.stale_temps import (
    MANIFEST_TEMP_RE,
    PID_LIMIT,
    TempWriter,
    pid_possible,
    writer_gone,
)

# Finding categories. Every one except TEMP_ACTIVE is a problem for fsck.
BAD_PAGE = "bad_page"  # a page file that fails verification (kind: the PageError kind)
STALE_TEMP = "stale_temp"  # a temp file whose writer is gone
TEMP_ACTIVE = "temp"  # a temp file that may still be written (not a problem)
ORPHAN = "orphan"  # a page in a group or rank its namespace's manifest does not know
FOREIGN = "foreign"  # anything tierstore does not write
NFS_LEFTOVER = "nfs_leftover"  # .nfsXXXX / .fuse_hiddenXXXX older than the temp age
SYMLINK = "symlink"  # a symbolic link (never followed)
MANIFEST = "manifest"  # a namespace directory without a valid manifest
UNREADABLE = "unreadable"  # a directory or file that could not be listed or stat'ed
# A page whose MAC tag does not verify with the key fsck was given (no tag, another key's, an
# algorithm not installed here) while its content checks pass: not damage, never deleted by
# --repair alone; fsck counts these apart from problems (their own exit status).
UNVERIFIABLE = "unverifiable"

SKIP_EVERYWHERE = (".snapshot",)
SKIP_AT_ROOT = (".quarantine", "lost+found")
QUARANTINE_DIR = ".quarantine"

# Manifests are a few KiB (tens for models with hundreds of layers); a bigger one is refused
# before it is read, so a planted 500 MB file costs nothing.
MANIFEST_MAX_BYTES = 4 << 20


class _OpenGate:
    """The gate of a walk without an ``AdaptiveGate``: every thread at once."""

    def acquire(self) -> None:
        return None

    def progress(self, done: int) -> None:
        return None

    def release(self, done: int = 1) -> None:
        return None


_NO_GATE = _OpenGate()
GATE_BATCH = 32  # entries of a fan-out directory between two progress reports to the walk's gate

# IOEngine's O_DIRECT probe file (engine.probe_odirect); removed by the engine unless killed.
_PROBE_RE = re.compile(r"^\.odirect-probe\.\d+\.\d+\.tmp$")


Fingerprint = tuple[int, int, int, int, int]


def fingerprint(st: os.stat_result) -> Fingerprint:
    """What must not change between the scan and a repair: device, inode, size, mtime, ctime.

    The inode alone is not enough: a file deleted and re-created in between often gets the
    same inode number back.
    """
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass
class Finding:
    """One entry that is not a healthy page (or a temp that may still be live)."""

    path: str
    category: str
    kind: str
    message: str
    size: int = 0
    mtime: float | None = None
    is_dir: bool = False
    fingerprint: Fingerprint | None = None  # identity at scan time; repair re-checks it
    action: str | None = None  # what repair did: "deleted", "quarantined", "unlinked"
    repair_error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "category": self.category,
            "kind": self.kind,
            "message": self.message,
            "size": self.size,
            "action": self.action,
            "repaired": self.action is not None,
            "repair_error": self.repair_error,
        }


@dataclass
class NamespaceDir:
    """A namespace directory under ROOT and what its manifest says (if readable)."""

    name: str
    path: Path
    namespace: Namespace | None
    error: str | None = None
    walk: bool = True  # False: another format's tree; its contents are neither read nor repaired

    @property
    def digest_bytes(self) -> bytes | None:
        """The digest page headers must carry: the directory's name, when it is one."""
        return bytes.fromhex(self.name) if NAMESPACE_DIR_RE.match(self.name) else None

    def group(self, index: int) -> GroupSpec | None:
        if self.namespace is None or index >= len(self.namespace.groups):
            return None
        return self.namespace.groups[index]

    @property
    def world_size(self) -> int | None:
        """Upper bound on rank numbers (product of all parallel sizes)."""
        if self.namespace is None:
            return None
        p = self.namespace.parallel
        return p.tp_size * p.pp_size * p.dcp_size * p.pcp_size


@dataclass(frozen=True)
class PageRef:
    """A page file found at a proper place, handed to the visitor."""

    path: str
    ns: NamespaceDir
    group_index: int
    rank: int
    key: bytes
    size: int
    mtime: float
    fingerprint: Fingerprint
    group: GroupSpec | None  # None when the manifest is missing or unreadable


@dataclass
class PageVerdict:
    """What a visitor found: the page's token count, or a problem, or that it vanished."""

    token_count: int | None = None
    problem: Finding | None = None
    vanished: bool = False


PageVisitor = Callable[[PageRef], PageVerdict]
# A visitor's optional ``visit_batch(nsd, group_index, rank, group, directory, [(name, key)])``:
# pages of one fan-out directory at once, each answered with (ref, verdict) or None for the
# per-page path (fsck_read.PageVerifier.visit_batch).
BatchVisitor = Callable[[NamespaceDir, int, int, GroupSpec, str, list[tuple[str, bytes]]],
                        list[tuple[PageRef, PageVerdict] | None]]


@dataclass
class GroupTally:
    """Healthy pages of one (namespace, group, rank)."""

    files: int = 0
    bytes: int = 0
    tokens: int = 0
    tokens_from_headers: int = 0  # files whose token count came from their header
    listed: int = 0  # files counted from the listing alone (bytes estimated from the layout)
    oldest: float | None = None
    newest: float | None = None

    def add(self, size: int, mtime: float, tokens: int, from_header: bool) -> None:
        self.files += 1
        self.bytes += size
        self.tokens += tokens
        self.tokens_from_headers += int(from_header)
        self.oldest = mtime if self.oldest is None else min(self.oldest, mtime)
        self.newest = mtime if self.newest is None else max(self.newest, mtime)

    def add_listed(self, count: int, page_bytes: int, tokens_per_page: int, dir_mtime: float | None) -> None:
        """``count`` pages seen only by name; ``dir_mtime`` is their directory's last change."""
        self.files += count
        self.listed += count
        self.bytes += count * page_bytes
        self.tokens += count * tokens_per_page
        if dir_mtime is not None and count:
            self.newest = dir_mtime if self.newest is None else max(self.newest, dir_mtime)

    def merge(self, other: GroupTally) -> None:
        self.files += other.files
        self.bytes += other.bytes
        self.tokens += other.tokens
        self.tokens_from_headers += other.tokens_from_headers
        self.listed += other.listed
        if other.oldest is not None:  # None in a listing: oldest unknown, newest from dir times
            self.oldest = other.oldest if self.oldest is None else min(self.oldest, other.oldest)
        if other.newest is not None:
            self.newest = other.newest if self.newest is None else max(self.newest, other.newest)


@dataclass
class Inventory:
    """The result of one walk."""

    root: Path
    namespaces: list[NamespaceDir] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    tallies: dict[tuple[str, int, int], GroupTally] = field(default_factory=dict)
    temps_active: int = 0
    pages_seen: int = 0  # page files handed to the visitor (healthy or not)
    vanished: int = 0  # files deleted under the walk (by gc or a writer); not problems

    def merge(self, other: Inventory) -> None:
        self.findings.extend(other.findings)
        for k, t in other.tallies.items():
            self.tallies.setdefault(k, GroupTally()).merge(t)
        self.temps_active += other.temps_active
        self.pages_seen += other.pages_seen
        self.vanished += other.vanished


class Progress:
    """The walk's progress bar on stderr (tqdm): fan-out directories done of all, with the rate
    and the time left (ETA), and files, bytes and problems seen; silent unless enabled
    (default: only when the stream is a terminal). ``total_dirs`` may be set after creation
    (the walk knows it once it has listed the namespaces). Threading: ``advance`` from any
    thread (a lock; tqdm itself is not thread-safe for concurrent updates)."""

    def __init__(self, label: str, stream: TextIO | None = None, enabled: bool | None = None):
        self.stream = stream or sys.stderr
        self.enabled = _is_terminal(self.stream) if enabled is None else enabled
        self.label = label
        self.dirs = 0
        self.files = 0
        self.nbytes = 0
        self.problems = 0
        self._lock = threading.Lock()
        self._bar = progress_bar(label, unit="dir", stream=self.stream, enabled=self.enabled)

    @property
    def total_dirs(self) -> int:
        return int(self._bar.total or 0)

    @total_dirs.setter
    def total_dirs(self, n: int) -> None:
        with self._lock:
            self._bar.total = n
            self._bar.bar_format = KNOWN_TOTAL_FORMAT
            self._bar.refresh()

    def advance(self, *, files: int = 0, nbytes: int = 0, dirs: int = 0, problems: int = 0) -> None:
        with self._lock:
            self.files += files
            self.nbytes += nbytes
            self.dirs += dirs
            self.problems += problems
            if self.enabled:
                self._bar.set_postfix_str(f"{self.files} files, {human_bytes(self.nbytes)}, "
                                          f"{self.problems} problems", refresh=False)
                self._bar.update(dirs)

    def close(self) -> None:
        with self._lock:
            self._bar.close()


# tqdm's default with one decimal of percentage: "fsck:  42.5%|####      | 17/40 [00:03<00:04, 5.6dir/s, ...]".
KNOWN_TOTAL_FORMAT = "{desc}: {percentage:5.1f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or fake stream
        return False


def progress_bar(label: str, *, total: int | None = None, unit: str = "it", stream: TextIO | None = None,
                 enabled: bool | None = None) -> Any:
    """A tqdm bar on ``stream`` (stderr): rate and ETA when ``total`` is known, the rate alone
    otherwise; disabled (every call a no-op) unless ``enabled``, by default when the stream is
    a terminal. Every long walk of the CLI (fsck, stats, ls, gc) draws through this one style."""
    from tqdm import tqdm  # imported only where a command runs: a library import stays light

    out = stream or sys.stderr
    on = _is_terminal(out) if enabled is None else enabled
    return tqdm(total=total, desc=label, unit=unit, file=out, disable=not on, leave=True, dynamic_ncols=True,
                mininterval=0.2, smoothing=0.1, bar_format=KNOWN_TOTAL_FORMAT if total else None)


def human_bytes(n: float) -> str:
    """``n`` bytes for people: "512 B", "1.5 MiB", ... up to TiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class _Classifier:
    """What an entry that is not a page at its proper place is: rules that do not depend on
    where in the tree the entry is."""

    def __init__(self, now: float, tmp_age: float):
        self.now = now
        self.tmp_age = tmp_age
        self.host = host_tag()

    def temp_is_stale(self, host: str, pid: int, mtime: float) -> tuple[bool, str]:
        """``stale_temps``' one rule: stale only when its writer is provably gone (``host`` ""
        when the name does not say; then by age against ``--tmp-age``)."""
        return writer_gone(TempWriter(host or None, pid), mtime, grace_s=self.tmp_age, now=self.now,
                           this_host=self.host, stuck_after_s=self.tmp_age)

    def other(self, entry: os.DirEntry[str], inv: Inventory, expected: str) -> None:
        """Record what an entry that is not what its level holds is (symlink, probe, NFS
        leftover, foreign)."""
        st = _lstat_entry(entry, inv)
        if st is None:
            return
        f = Finding(entry.path, FOREIGN, "", "", size=st.st_size, mtime=st.st_mtime, fingerprint=fingerprint(st))
        if _stat.S_ISLNK(st.st_mode):
            f.category, f.kind = SYMLINK, "symlink"
            try:
                target = os.readlink(entry.path)
            except OSError:
                target = "?"
            f.message = f"symbolic link to {target!r} (never followed)"
        elif _PROBE_RE.match(entry.name) and _stat.S_ISREG(st.st_mode):
            stale, why = self.temp_is_stale("", 0, st.st_mtime)
            if not stale:
                inv.temps_active += 1
                return
            f.category, f.kind, f.message = STALE_TEMP, "temp", f"O_DIRECT probe file of an engine; {why}"
        elif entry.name.startswith(SILLY_RENAME_PREFIXES):
            stale, why = self.temp_is_stale("", 0, st.st_mtime)
            if not stale:
                inv.temps_active += 1
                return
            f.category, f.kind = NFS_LEFTOVER, "silly_rename"
            f.message = f"NFS/FUSE silly-rename leftover of a deleted open file; {why}"
        else:
            f.is_dir = _stat.S_ISDIR(st.st_mode)
            f.kind = "dir" if f.is_dir else ("file" if _stat.S_ISREG(st.st_mode) else "special")
            f.message = f"not written by tierstore (expected {expected})"
        inv.findings.append(f)

    def temp(self, e: os.DirEntry[str], inv: Inventory, host: str, pid: int) -> None:
        """Record a temp file of a writer: active, or stale once the writer is provably gone."""
        if not pid_possible(pid):
            self.other(e, inv, f"temp files named with a pid of at most {PID_LIMIT}")
            return
        st = _lstat_entry(e, inv)
        if st is None:
            return
        stale, why = self.temp_is_stale(host, pid, st.st_mtime)
        if stale:
            inv.findings.append(Finding(e.path, STALE_TEMP, "temp", why, size=st.st_size, mtime=st.st_mtime, fingerprint=fingerprint(st)))
        else:
            inv.temps_active += 1


def _scandir(path: Path, inv: Inventory) -> list[os.DirEntry[str]]:
    """The entries of ``path`` sorted by name; [] if it is gone, a finding if unreadable."""
    try:
        with os.scandir(path) as it:
            return sorted(it, key=lambda e: e.name)
    except OSError as exc:
        if exc.errno in GONE_ERRNOS:
            return []
        inv.findings.append(Finding(str(path), UNREADABLE, "io", f"cannot list directory: {exc.strerror}", is_dir=True))
        return []


def _lstat_entry(entry: os.DirEntry[str], inv: Inventory) -> os.stat_result | None:
    """lstat; None (and counted) if the entry vanished or cannot be stat'ed."""
    try:
        return entry.stat(follow_symlinks=False)
    except OSError as exc:
        if exc.errno in GONE_ERRNOS:
            inv.vanished += 1
        else:
            inv.findings.append(Finding(entry.path, UNREADABLE, "io", f"cannot stat: {exc.strerror}"))
        return None


def _skipped(name: str) -> bool:
    return name in SKIP_EVERYWHERE or name.startswith(RESERVED_PREFIX)


def _has_entry(root_fd: int, ns_name: str, name: str) -> bool:
    """Whether ``ns_name/name`` exists (of any type) under the root, without following links."""
    try:
        os.stat(f"{ns_name}/{name}", dir_fd=root_fd, follow_symlinks=False)
    except (OSError, ValueError):
        return False
    return True


def _load_manifest(nsd: NamespaceDir, root_fd: int) -> None:
    """Read and check ``nsd``'s manifest through safefs; any problem becomes ``nsd.error``.

    Every exception counts (a planted manifest can raise anything from json or the dataclasses:
    RecursionError for deep nesting, OverflowError for 1e400, ValueError, KeyError...): it is a
    finding about this namespace, never the end of the walk.
    """
    try:
        ns_fd = safefs.open_dir(nsd.name, root_fd)
        try:
            raw = safefs.read_small(MANIFEST_NAME, ns_fd, MANIFEST_MAX_BYTES)
        finally:
            os.close(ns_fd)
        ns = Namespace.from_manifest(json.loads(raw))
        _check_namespace_values(ns)
    except safefs.UnsafeEntry as exc:
        nsd.error = f"unreadable manifest: {exc}"
        return
    except OSError as exc:
        nsd.error = f"unreadable manifest: {exc.strerror or exc}"
        return
    except Exception as exc:  # noqa: BLE001 - untrusted input: every failure is a finding
        nsd.error = f"unreadable manifest: {type(exc).__name__}: {str(exc)[:200]}"
        return
    if ns.digest != nsd.name:
        nsd.error = f"manifest describes namespace {ns.digest}, not {nsd.name}"
    elif ns.format_version != FORMAT_VERSION:
        # Another tierstore's tree (another page format and directory layout): its pages are
        # never served here, and nodes that still run that version may be using them, so
        # nothing in it is read or repaired.
        nsd.namespace = ns
        nsd.error = (f"written by tierstore page format {ns.format_version}; this tierstore uses "
                     f"format {FORMAT_VERSION} and never serves these pages "
                     "(left as is: delete the directory once no node uses that version)")
        nsd.walk = False
    else:
        nsd.namespace = ns


def _check_namespace_values(ns: Namespace) -> None:
    """Compute what the walk and the stats use, so a value that parses but cannot be used
    (a negative shape, a float where a count belongs) fails here, inside the manifest's try."""
    p = ns.parallel
    world = p.tp_size * p.pp_size * p.dcp_size * p.pcp_size
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"parallel layout has {world!r} ranks")
    if not isinstance(ns.format_version, int):
        raise ValueError(f"format_version {ns.format_version!r} is not an integer")
    for g in ns.groups:
        nbytes = g.layout.nbytes
        if not isinstance(nbytes, int) or nbytes < 0 or not isinstance(g.tokens_per_chunk, int):
            raise ValueError(f"group layout of {nbytes!r} bytes")
        g.kind.name.lower()
        len(g.layer_names)
    ns.parallel.to_json()
    dict(ns.extra)


def slice_group(group: GroupSpec, heads: tuple[int, int]) -> GroupSpec | None:
    """The group as its slice ``h<start>-<count>`` holds it (``head_slices.slice_layout``:
    attention sections cut to ``count`` KV heads, Gated DeltaNet states to ``count`` linear key
    heads; docs/DESIGN.md §9); None when the group has no such slice (another Mamba group, or
    units beyond the group's)."""
    from tierstore.format.head_slices import HeadRange, slice_layout

    try:
        layout = slice_layout(group.layout, HeadRange(*heads))
    except ValueError:
        return None
    return dataclasses.replace(group, layout=layout)


@lru_cache(maxsize=256)
def _estimated_page_bytes(ns: Namespace, group_index: int, rank: int, key_len: int,
                          layout: PageLayout | None = None) -> int:
    """Bytes of an uncompressed page file of this group (header + payload; ``layout``: a head
    slice's); 0 if unknown."""
    try:
        return page_file_size(ns, group_index, key_len, rank, layout)
    except Exception:  # noqa: BLE001 - an odd manifest: no estimate rather than no stats
        return 0


@dataclass
class _Seen:
    """Pages a walk thread found in its current directory, told to ``Progress`` once per directory."""

    count: int = 0
    nbytes: int = 0


class _Walker:
    def __init__(self, root: Path, visitor: PageVisitor | None, classifier: _Classifier, progress: Progress | None,
                 listing: bool = False, gate: AdaptiveGate | None = None):
        self._local = threading.local()
        self.gate: AdaptiveGate | _OpenGate = gate if gate is not None else _NO_GATE
        self.root = root
        self.visitor = visitor
        self.listing = listing and visitor is None
        self.cls = classifier
        self.progress = progress
        self.stop = threading.Event()

    # -- levels --------------------------------------------------------------------------

    def namespaces(self, inv: Inventory, only: str | None) -> list[NamespaceDir]:
        root_fd = safefs.open_root(self.root)
        try:
            return self._namespaces(inv, only, root_fd)
        finally:
            os.close(root_fd)

    def _namespaces(self, inv: Inventory, only: str | None, root_fd: int) -> list[NamespaceDir]:
        out = []
        for e in _scandir(self.root, inv):
            if _skipped(e.name) or e.name in SKIP_AT_ROOT:
                continue
            if only is not None and not e.name.startswith(only):
                continue
            if not e.is_dir(follow_symlinks=False):
                if only is None:
                    self.cls.other(e, inv, "namespace directories")
                continue
            path = Path(e.path)
            mpath = path / MANIFEST_NAME
            has_manifest = _has_entry(root_fd, e.name, MANIFEST_NAME)
            if not has_manifest and not NAMESPACE_DIR_RE.match(e.name):
                if only is None:
                    self.cls.other(e, inv, "namespace directories")
                continue
            nsd = NamespaceDir(e.name, path, None)
            if not has_manifest:
                nsd.error = f"no {MANIFEST_NAME} (run an engine of this model once to rewrite it, or delete the directory)"
            else:
                _load_manifest(nsd, root_fd)
            if nsd.error:
                inv.findings.append(Finding(str(mpath), MANIFEST, "manifest", nsd.error))
            out.append(nsd)
        return out

    def fan_dirs(self, nsd: NamespaceDir, inv: Inventory) -> list[tuple[Path, int, int, bool]]:
        """(aa dir, group, rank, orphan) for every fan-out directory of a namespace."""
        out = []
        for e in _scandir(nsd.path, inv):
            if _skipped(e.name):
                continue
            if e.name == MANIFEST_NAME and e.is_file(follow_symlinks=False):
                continue
            m = MANIFEST_TEMP_RE.match(e.name)
            if m and e.is_file(follow_symlinks=False):
                self.cls.temp(e, inv, m.group(1), int(m.group(2)))
                continue
            g = parse_index_dir(e.name, "g")
            if g is None or not e.is_dir(follow_symlinks=False):
                self.cls.other(e, inv, "g<group> directories and manifest.json")
                continue
            group_known = nsd.namespace is None or g < len(nsd.namespace.groups)
            for r_entry in _scandir(Path(e.path), inv):
                if _skipped(r_entry.name):
                    continue
                r = parse_rank_dir(r_entry.name)
                if r is None or not r_entry.is_dir(follow_symlinks=False):
                    self.cls.other(r_entry, inv, "r<rank> or h<start>-<count> directories")
                    continue
                heads = parse_slice_dir(r_entry.name)
                world = nsd.world_size
                if heads is None:
                    orphan = not group_known or (world is not None and r >= world)
                else:  # a head slice: any TP may have written it; its heads must be the group's
                    orphan = not group_known or (nsd.namespace is not None
                                                 and slice_group(nsd.namespace.groups[g], heads) is None)
                for a_entry in _scandir(Path(r_entry.path), inv):
                    if _skipped(a_entry.name):
                        continue
                    if not is_fanout_name(a_entry.name) or not a_entry.is_dir(follow_symlinks=False):
                        self.cls.other(a_entry, inv, "two-hex-digit fan-out directories")
                        continue
                    out.append((Path(a_entry.path), g, r, orphan))
        return out

    def fan_dir(self, nsd: NamespaceDir, aa: Path, g: int, r: int, orphan: bool) -> Inventory:
        """Walk one ``<aa>`` directory (runs on a pool thread)."""
        try:
            return self._fan_dir(nsd, aa, g, r, orphan)
        except BaseException:
            # Stop the other workers now, not when the caller gets round to this future: under
            # load it may take a while, and every queued directory would fail the same way.
            self.stop.set()
            raise

    def _fan_dir(self, nsd: NamespaceDir, aa: Path, g: int, r: int, orphan: bool) -> Inventory:
        inv = Inventory(self.root)
        if self.stop.is_set():
            return inv
        group = nsd.group(g)
        heads = parse_slice_dir(aa.parent.name)
        if heads is not None and group is not None and not orphan:
            group = slice_group(group, heads)  # its pages hold those heads: the slice's layout
        if self.listing and not orphan:
            return self._fan_dir_listed(inv, nsd, aa, g, r, group)
        fan = aa.name
        batch = getattr(self.visitor, "visit_batch", None) if group is not None and not orphan else None
        gate = self.gate
        gate.acquire()  # one pass per directory: a pass through the gate may be a thread switch
        try:
            entries = _scandir(aa, inv)
            for at in range(0, len(entries), GATE_BATCH):
                if self.stop.is_set():
                    break
                chunk = [e for e in entries[at:at + GATE_BATCH] if not _skipped(e.name)]
                rest = chunk if batch is None else self._visit_batch(batch, chunk, inv, nsd, g, r, group, str(aa))
                for e in rest:
                    self._entry_guarded(e, inv, nsd, g, r, orphan, group, fan)
                gate.progress(len(chunk))
        finally:
            gate.release(0)
        if self.progress and self._seen.count:  # once per directory: the lock is not taken per page
            self.progress.advance(files=self._seen.count, nbytes=self._seen.nbytes)
            self._seen.count = self._seen.nbytes = 0
        return inv

    @property
    def _seen(self) -> _Seen:
        """This thread's pages of its current directory not yet told to ``progress``."""
        seen = getattr(self._local, "seen", None)
        if seen is None:
            seen = self._local.seen = _Seen()
        return seen

    def _entry_guarded(self, e: os.DirEntry[str], inv: Inventory, nsd: NamespaceDir, g: int, r: int,
                       orphan: bool, group: GroupSpec | None, fan: str) -> None:
        """``_leaf_entry``; an exception from this one entry is a finding about it."""
        try:
            ref = self._leaf_entry(e, inv, nsd, g, r, orphan, group, fan)
        except Exception as exc:  # noqa: BLE001 - untrusted input: one entry never ends the walk
            inv.findings.append(Finding(e.path, UNREADABLE, "error",
                                        f"could not classify: {type(exc).__name__}: {str(exc)[:200]}"))
            return
        if ref is not None:
            self._visit(ref, inv)  # a visitor's own failure is a bug: it stops the walk

    def _visit_batch(self, batch: BatchVisitor, chunk: list[os.DirEntry[str]], inv: Inventory, nsd: NamespaceDir,
                     g: int, r: int, group: GroupSpec, directory: str) -> list[os.DirEntry[str]]:
        """Hand the chunk's page names at their proper place to the visitor's batch (no stat
        here: the batch's own open and fstat tell size and identity); the entries it leaves
        (and every other entry) go back for the per-entry path."""
        fan = os.path.basename(directory)
        pages: list[tuple[os.DirEntry[str], bytes]] = []
        rest: list[os.DirEntry[str]] = []
        for e in chunk:
            name = e.name
            key = parse_page_name(name) if name.endswith(PAGE_SUFFIX) else None
            if key is not None and fanout(key) == fan and e.is_file(follow_symlinks=False):
                pages.append((e, key))
            else:
                rest.append(e)
        if not pages:
            return rest
        results = batch(nsd, g, r, group, directory, [(e.name, key) for e, key in pages])
        seen = self._seen if self.progress else None
        for (e, _), got in zip(pages, results, strict=True):
            if got is None:
                rest.append(e)
                continue
            ref, verdict = got
            inv.pages_seen += 1
            if seen is not None:
                seen.count += 1
                seen.nbytes += ref.size
            self._record(ref, verdict, inv)
        return rest

    def _fan_dir_listed(self, inv: Inventory, nsd: NamespaceDir, aa: Path, g: int, r: int,
                        group: GroupSpec | None) -> Inventory:
        """Count page names without a stat per page (``listing``); classify the rest as usual."""
        count = 0
        key_len = 0
        others: list[os.DirEntry[str]] = []
        try:
            dir_mtime: float | None = os.stat(aa, follow_symlinks=False).st_mtime
            with os.scandir(aa) as it:
                for e in it:
                    name = e.name
                    if name.endswith(".kvp") and PAGE_NAME_RE.match(name) and e.is_file(follow_symlinks=False):
                        count += 1
                        key_len = (len(name) - 4) // 2
                    elif not _skipped(name):
                        others.append(e)
        except OSError as exc:
            if exc.errno not in GONE_ERRNOS:
                inv.findings.append(Finding(str(aa), UNREADABLE, "io", f"cannot list directory: {exc.strerror}",
                                            is_dir=True))
            return inv
        for e in sorted(others, key=lambda x: x.name):
            self._entry_guarded(e, inv, nsd, g, r, False, group, aa.name)
        if self.progress and self._seen.count:
            self.progress.advance(files=self._seen.count, nbytes=self._seen.nbytes)
            self._seen.count = self._seen.nbytes = 0
        if count:
            inv.pages_seen += count
            if self.progress:
                self.progress.advance(files=count)
            page_bytes = (_estimated_page_bytes(nsd.namespace, g, r, key_len, group.layout if group else None)
                          if nsd.namespace else 0)
            tokens = group.tokens_per_chunk if group is not None else 0
            inv.tallies.setdefault((nsd.name, g, r), GroupTally()).add_listed(count, page_bytes, tokens, dir_mtime)
        return inv

    def _leaf_entry(self, e: os.DirEntry[str], inv: Inventory, nsd: NamespaceDir, g: int, r: int,
                    orphan: bool, group: GroupSpec | None, fan: str) -> PageRef | None:
        """Classify one entry of the fan-out directory ``fan``; the page to visit, if it is one.

        The hot path of fsck (one call per page): the walk already parsed the namespace, group
        and rank directories, so a page's place is checked by its fan-out name alone (what
        ``mapper.locate`` would re-derive from the whole path)."""
        if not e.is_file(follow_symlinks=False):
            self.cls.other(e, inv, "page files")
            return None
        name = e.name
        key = parse_page_name(name) if name.endswith(PAGE_SUFFIX) else None  # a page is never a temp name
        if key is None:
            tmp = parse_temp_name(name)
            if tmp is not None:
                self.cls.temp(e, inv, tmp.host, tmp.pid)
            else:
                self.cls.other(e, inv, "page files")
            return None
        st = _lstat_entry(e, inv)
        if st is None:
            return None
        if self.progress:
            seen = self._seen
            seen.count += 1
            seen.nbytes += st.st_size
        fp = fingerprint(st)
        if orphan:
            why = (f"group {g} is not in the namespace's manifest" if nsd.group(g) is None
                   else f"head slice {e.path.split(os.sep)[-3]} is not one of the group's KV heads"
                   if parse_slice_dir(e.path.split(os.sep)[-3]) is not None
                   else f"rank {r} is outside the manifest's parallel layout ({nsd.world_size} ranks)")
            inv.findings.append(Finding(e.path, ORPHAN, "orphan", why, size=st.st_size, mtime=st.st_mtime,
                                        fingerprint=fp))
            return None
        if fanout(key) != fan:
            inv.findings.append(Finding(e.path, BAD_PAGE, "misplaced", "page name does not belong in this fan-out "
                                        "directory", size=st.st_size, mtime=st.st_mtime, fingerprint=fp))
            return None
        inv.pages_seen += 1
        return PageRef(e.path, nsd, g, r, key, st.st_size, st.st_mtime, fp, group)

    def _visit(self, ref: PageRef, inv: Inventory) -> None:
        self._record(ref, self.visitor(ref) if self.visitor else PageVerdict(), inv)

    def _record(self, ref: PageRef, verdict: PageVerdict, inv: Inventory) -> None:
        if verdict.vanished:
            inv.vanished += 1
            return
        if verdict.problem is not None:
            if self.progress:
                self.progress.advance(problems=1)
            inv.findings.append(verdict.problem)
            return
        tokens = verdict.token_count
        from_header = tokens is not None
        if tokens is None:
            tokens = ref.group.tokens_per_chunk if ref.group is not None else 0
        inv.tallies.setdefault((ref.ns.name, ref.group_index, ref.rank), GroupTally()).add(
            ref.size, ref.mtime, tokens, from_header)


def resolve_namespace_filter(root: Path, namespace: str | None) -> str | None:
    """Check a ``--namespace`` value (a digest or a unique prefix of one); returns the full name."""
    if namespace is None:
        return None
    names = []
    with os.scandir(root) as it:
        for e in it:
            if e.name.startswith(namespace) and e.is_dir(follow_symlinks=False) and not _skipped(e.name):
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
    walker = _Walker(root_path, visitor, _Classifier(time.time() if now is None else now, tmp_age), progress,
                     listing=listing, gate=gate)
    inv = Inventory(root_path)
    inv.namespaces = walker.namespaces(inv, only)
    units = [(nsd, *fan) for nsd in inv.namespaces if nsd.walk for fan in walker.fan_dirs(nsd, inv)]
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


# -- stats / ls ----------------------------------------------------------------------------


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
