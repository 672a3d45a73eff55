"""``tierstore fsck``: verify every file under a root and optionally repair.

Contract:

- ``run_fsck(FsckOptions)`` walks ROOT (``inventory.walk_root``; symlinks are never followed)
  and verifies every page completely with ``pagefile.read_page`` against what its place and
  its namespace's manifest say: header checksum, every section checksum, exact file size,
  namespace digest = directory name, key/group/rank = path (``mapper.locate``), layout and
  group kind = the manifest's group. Pages are read concurrently by ``jobs`` threads (on
  NFS latency dominates, so more threads than cores pay off).
- Problems: bad pages, stale temps, orphans, foreign files, NFS/FUSE silly-rename leftovers,
  symlinks, namespace directories without a valid manifest, unreadable directories.
  Temp files that may still be written are counted, not reported as problems.
- ``--repair`` (``FsckOptions.repair``) deletes what tierstore wrote and can never serve (bad
  pages, orphans, stale temps, old silly-rename leftovers), unlinks symlinks (the link, never
  its target), and moves everything else tierstore did not write (foreign files and
  directories) to ``ROOT/.quarantine/<UTC time>-<pid>/<relative path>``, since it may be
  someone's data. With ``quarantine_bad`` bad pages are moved there too instead of deleted.
  Manifest problems and unreadable directories are left for a human (exit 4). Directories
  are never removed (a writer may be about to create a file in them). A ROOT holding no
  namespace but other files is refused (exit 8): it is probably not a cache directory.
- Every repair step goes through directory file descriptors opened component by component
  from ROOT with ``O_NOFOLLOW``, and re-checks each entry's fingerprint (device, inode, size, mtime, ctime) from the scan, so a symlink or
  a file swapped in after the scan is never followed out of ROOT nor removed by mistake.
- Exit codes as e2fsck: 0 clean, 1 errors found and all repaired, 4 errors left,
  8 operational error (ROOT missing, bad option), 32 interrupted.
- Every read rejects non-zero alignment-gap bytes (``format.check_gaps``: canonical bytes).
  ``--deep`` (``FsckOptions.deep``) also recomputes, per verified page (``deep_check_page``,
  one call per page, no shared state): gap bytes zero, and no NaN/Inf bit pattern in a
  floating-point section (a KV cache or Mamba state holding one poisons every request that
  loads it; integer and byte sections have no invalid encodings). Such a page is a bad page
  (kinds ``noncanonical``, ``nonfinite``). In namespaces of an older page format (never
  walked, never repaired) it counts the pages written non-canonically (non-zero gaps, which
  format 3 forbids) and reports them on the namespace's manifest finding (kind
  ``noncanonical``; left for a human like the namespace itself).

Threading: ``run_fsck`` is called from one thread; it uses a private pool for reads.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import zstandard

from tierstore.errors import PageError, PageIOError, PageMissing
from tierstore.format import (
    FORMAT_VERSION,
    PageExpectation,
    PageHeader,
    check_expectation,
    check_stored_gaps,
    decode_header_any_version,
    nonzero_gap,
)
from tierstore.identity import MANIFEST_NAME
from tierstore.inventory import (
    BAD_PAGE,
    FOREIGN,
    MANIFEST,
    NFS_LEFTOVER,
    ORPHAN,
    QUARANTINE_DIR,
    STALE_TEMP,
    SYMLINK,
    UNREADABLE,
    Finding,
    Fingerprint,
    Inventory,
    PageRef,
    PageVerdict,
    Progress,
    fingerprint,
    read_header,
    stats_from_inventory,
    walk_root,
)
from tierstore.pagefile import inspect_page, read_page

EXIT_CLEAN = 0
EXIT_REPAIRED = 1
EXIT_ERRORS_LEFT = 4
EXIT_OPERATIONAL = 8
EXIT_CANCELLED = 32

# A page with no usable manifest is verified into a buffer of the size its header declares.
# format.MAX_PAGE_BYTES (64 GiB) already bounds every reader; fsck runs ``jobs`` such reads at
# once, so it verifies no unmanifested page above this (pages are a few MiB to a few hundred).
MAX_UNMANIFESTED_PAGE_BYTES = 4 << 30
CATEGORIES = (BAD_PAGE, STALE_TEMP, ORPHAN, FOREIGN, NFS_LEFTOVER, SYMLINK, MANIFEST, UNREADABLE)
_DELETE = frozenset({BAD_PAGE, ORPHAN, STALE_TEMP, NFS_LEFTOVER})


@dataclass
class FsckOptions:
    root: str | os.PathLike[str]
    repair: bool = False
    namespace: str | None = None  # a digest or a unique prefix
    jobs: int = 8
    tmp_age: float = 3600.0  # seconds after which a temp of another host (or a live pid) is stale
    quarantine_bad: bool = False  # move bad pages to ROOT/.quarantine instead of deleting them
    progress: bool | None = None  # None: on a terminal only
    deep: bool = False  # also check values (NaN/Inf) and older trees' gap bytes (deep_check_page)


@dataclass
class FsckReport:
    root: str
    repair: bool
    problems: list[Finding] = field(default_factory=list)
    pages_ok: int = 0
    bytes_ok: int = 0
    temps_active: int = 0
    vanished: int = 0
    namespaces: int = 0
    seconds: float = 0.0
    quarantine: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # operational error (exit 8)

    @property
    def repaired(self) -> int:
        return sum(1 for p in self.problems if p.action is not None)

    @property
    def left(self) -> int:
        return len(self.problems) - self.repaired

    @property
    def exit_code(self) -> int:
        if self.error is not None:
            return EXIT_OPERATIONAL
        if not self.problems:
            return EXIT_CLEAN
        return EXIT_REPAIRED if self.left == 0 else EXIT_ERRORS_LEFT

    def counts(self) -> dict[str, int]:
        c = {cat: 0 for cat in CATEGORIES}
        for p in self.problems:
            c[p.category] += 1
        return {
            "namespaces": self.namespaces,
            "pages_ok": self.pages_ok,
            "bytes_ok": self.bytes_ok,
            "temps_active": self.temps_active,
            "vanished": self.vanished,
            **c,
            "problems": len(self.problems),
            "repaired": self.repaired,
            "left": self.left,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "tierstore_fsck": 1,
            "root": self.root,
            "repair": self.repair,
            "exit_code": self.exit_code,
            "error": self.error,
            "seconds": round(self.seconds, 3),
            "quarantine": self.quarantine,
            "counts": self.counts(),
            "problems": [p.to_json() for p in self.problems],
            "namespaces": self.stats.get("namespaces", []),
        }

    def format_text(self) -> str:
        lines = []
        for p in self.problems:
            done = f"  [{p.action}]" if p.action else (f"  [NOT repaired: {p.repair_error}]" if p.repair_error else "")
            lines.append(f"{p.category}/{p.kind}: {p.path}: {p.message}{done}")
        if self.error:
            lines.append(f"fsck: {self.error}")
            return "\n".join(lines)
        c = self.counts()
        found = ", ".join(f"{c[k]} {k}" for k in CATEGORIES if c[k]) or "no problems"
        lines.append(
            f"{self.root}: {c['namespaces']} namespace(s), {c['pages_ok']} pages ok "
            f"({c['bytes_ok'] / 2**20:.1f} MiB), {c['temps_active']} temp(s) in flight; {found}"
            f" in {self.seconds:.2f} s"
        )
        if self.repair and self.problems:
            lines.append(f"repaired {self.repaired}, left {self.left}"
                         + (f"; quarantine: {self.quarantine}" if self.quarantine else ""))
        elif self.problems:
            lines.append("run `tierstore fsck --repair` to repair")
        return "\n".join(lines)


class PageVerifier:
    """Visitor that reads and verifies a page completely (thread-safe).

    Each pool thread keeps one page buffer per size and one zstd decompressor, so the
    scan allocates nothing per page for namespaces with a manifest.
    """

    def __init__(self, deep: bool = False) -> None:
        self._local = threading.local()
        self.deep = deep

    def _buffer(self, nbytes: int) -> memoryview:
        bufs: dict[int, bytearray] = self._local.__dict__.setdefault("bufs", {})
        buf = bufs.get(nbytes)
        if buf is None:
            buf = bufs[nbytes] = bytearray(nbytes)
        return memoryview(buf)

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._local, "dctx", None)
        if d is None:
            d = self._local.dctx = zstandard.ZstdDecompressor()
        return d

    def __call__(self, ref: PageRef) -> PageVerdict:
        path = Path(ref.path)
        ns_bytes = ref.ns.digest_bytes
        try:
            if ref.group is not None and ns_bytes is not None:
                expect = PageExpectation(ns_bytes, ref.key, ref.group_index, ref.rank, ref.group.layout)
                page = self._buffer(ref.group.layout.nbytes)
                header = read_page(path, expect, page, self._decompressor())
                if header.meta.group_kind != ref.group.kind:
                    return self._bad(ref, "format", f"page says group kind {header.meta.group_kind.name.lower()}, "
                                                    f"the manifest's group {ref.group_index} is {ref.group.kind.name.lower()}")
                deep = deep_check_page(header, page) if self.deep else None
                if deep is not None:
                    return self._bad(ref, *deep)
            else:
                # No usable manifest: verify what the page says about itself and its place.
                # The header is checked first: inspect_page allocates the layout it declares.
                declared = read_header(ref.path).layout.nbytes
                if declared > MAX_UNMANIFESTED_PAGE_BYTES:
                    return self._bad(ref, "format", f"page declares {declared} bytes, more than fsck verifies "
                                                    f"without a manifest ({MAX_UNMANIFESTED_PAGE_BYTES}); not verified")
                header = inspect_page(path, self._decompressor())
                expect = PageExpectation(ns_bytes or header.meta.namespace, ref.key, ref.group_index, ref.rank)
                check_expectation(header, expect, path=ref.path)
        except PageMissing:
            return PageVerdict(vanished=True)
        except PageIOError as exc:
            # EIO, a soft NFS mount timing out...: maybe transient, so never deleted for it.
            return PageVerdict(problem=Finding(ref.path, UNREADABLE, "io", f"cannot read the page: {exc}", size=ref.size))
        except OSError as exc:
            return PageVerdict(problem=Finding(ref.path, UNREADABLE, "io", f"cannot read the page: {exc.strerror}", size=ref.size))
        except PageError as exc:
            return self._bad(ref, exc.kind, exc.message)
        return PageVerdict(token_count=header.meta.token_count)

    @staticmethod
    def _bad(ref: PageRef, kind: str, message: str) -> PageVerdict:
        return PageVerdict(problem=Finding(ref.path, BAD_PAGE, kind, message, size=ref.size, mtime=ref.mtime, fingerprint=ref.fingerprint))


# Floating-point dtypes -> (same-size unsigned view, mask, pattern): a value v is NaN or Inf
# when v & mask == pattern (all exponent bits set; fp8 e4m3fn has only NaN, s.1111.111; the
# fnuz types only 0x80).
_NONFINITE: dict[str, tuple[str, int, int]] = {
    "bfloat16": ("<u2", 0x7F80, 0x7F80),
    "float16": ("<u2", 0x7C00, 0x7C00),
    "float32": ("<u4", 0x7F800000, 0x7F800000),
    "float64": ("<u8", 0x7FF0000000000000, 0x7FF0000000000000),
    "float8_e4m3fn": ("u1", 0x7F, 0x7F),
    "float8_e5m2": ("u1", 0x7C, 0x7C),
    "float8_e4m3fnuz": ("u1", 0xFF, 0x80),
    "float8_e5m2fnuz": ("u1", 0xFF, 0x80),
}


def deep_check_page(header: PageHeader, page: memoryview) -> tuple[str, str] | None:
    """(kind, message) of the first problem ``--deep`` finds in a verified page buffer, or None.

    Recomputes what the page's content determines beyond its checksums: alignment gaps zero
    (canonical bytes) and floating-point sections free of NaN/Inf bit patterns. Pure function
    of its arguments (safe from the read pool's threads)."""
    import numpy as np  # here: plain fsck (and the CLI) must not import numpy (tests/test_cli.py)

    layout = header.layout
    gap = nonzero_gap(layout, page)
    if gap is not None:
        return "noncanonical", f"non-zero bytes in the alignment gap at page bytes {gap[0]}..{gap[1]}"
    for spec, (o, e) in zip(layout.sections, layout.spans, strict=True):
        rule = _NONFINITE.get(spec.dtype)
        if rule is None or e == o:
            continue
        words = np.frombuffer(page[o:e], dtype=rule[0])
        bad = int(np.count_nonzero((words & np.array(rule[1], dtype=rule[0])) == rule[2]))
        if bad:
            return "nonfinite", (f"section {spec.name!r} ({spec.dtype}) holds {bad} NaN/Inf value(s): a KV "
                                 "cache or state that poisons every request loading it")
    return None


def old_tree_findings(inv: Inventory) -> list[Finding]:
    """For each namespace of an older page format: a finding counting its pages whose gap bytes
    are not zero (non-canonical). The tree is only read (with O_NOFOLLOW), never changed."""
    out = []
    for nsd in inv.namespaces:
        if nsd.walk or nsd.namespace is None or nsd.namespace.format_version >= FORMAT_VERSION:
            continue
        total, bad = 0, 0
        for dirpath, _, names in os.walk(nsd.path, followlinks=False):
            for name in names:
                if not name.endswith(".kvp") or name.startswith("."):
                    continue
                total += 1
                bad += not _old_page_is_canonical(os.path.join(dirpath, name))
        if bad:
            out.append(Finding(str(nsd.path / MANIFEST_NAME), MANIFEST, "noncanonical",
                               f"page format {nsd.namespace.format_version}: {bad} of {total} page(s) have non-zero "
                               f"alignment-gap bytes (written before format {FORMAT_VERSION} zeroed them; such "
                               "bytes may come from earlier pages); never served here, left as is"))
    return out


def _old_page_is_canonical(path: str) -> bool:
    """False when a page of an older format has non-zero gap bytes (unreadable files: True,
    they are not this check's business)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            if size > MAX_UNMANIFESTED_PAGE_BYTES:
                return True
            data = os.pread(fd, size, 0)
        finally:
            os.close(fd)
        _, header = decode_header_any_version(data, path=path)
        check_stored_gaps(header, memoryview(data)[header.header_len : header.header_len + header.payload_len])
    except (OSError, PageError) as exc:
        return not (isinstance(exc, PageError) and "non-zero" in exc.message)
    return True


class SafeRoot:
    """Removes and moves entries under ROOT without ever following a symlink.

    Every path is opened component by component from ROOT's directory fd with O_NOFOLLOW,
    and the entry's fingerprint (device, inode, size, mtime, ctime) must still be what the scan saw.
    """

    _DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)

    def __init__(self, root: Path):
        self.root = root
        self.root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))

    def close(self) -> None:
        os.close(self.root_fd)

    def _rel(self, path: str) -> PurePosixPath:
        rel = PurePosixPath(os.path.relpath(path, self.root))
        if rel.is_absolute() or not rel.parts or ".." in rel.parts or rel.parts == (".",):
            raise ValueError(f"{path} is not inside {self.root}")
        return rel

    def _open_dir(self, parts: tuple[str, ...], create: bool = False) -> int:
        fd = os.dup(self.root_fd)
        try:
            for part in parts:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                nfd = os.open(part, self._DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _check_same(self, name: str, dir_fd: int, expected: Fingerprint | None) -> os.stat_result:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if expected is not None and fingerprint(st) != expected:
            raise FileExistsError("the entry changed since the scan; run fsck again")
        return st

    def unlink(self, path: str, expected: Fingerprint | None) -> None:
        rel = self._rel(path)
        fd = self._open_dir(rel.parts[:-1])
        try:
            st = self._check_same(rel.name, fd, expected)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError("refusing to delete a directory")
            os.unlink(rel.name, dir_fd=fd)
        finally:
            os.close(fd)

    def move(self, path: str, expected: Fingerprint | None, dest_root: PurePosixPath) -> str:
        """Rename ``path`` to ``dest_root/<its relative path>`` (both under ROOT)."""
        rel = self._rel(path)
        src_fd = self._open_dir(rel.parts[:-1])
        try:
            self._check_same(rel.name, src_fd, expected)
            dst_fd = self._open_dir(dest_root.parts + rel.parts[:-1], create=True)
            try:
                # rename(2) never follows a symlink: a link is moved as a link.
                os.rename(rel.name, rel.name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
            finally:
                os.close(dst_fd)
        finally:
            os.close(src_fd)
        return str(self.root / dest_root / rel)


def _repair(report: FsckReport, root: Path, quarantine_bad: bool) -> None:
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    qdir = PurePosixPath(QUARANTINE_DIR) / f"{stamp}-{os.getpid()}"
    safe = SafeRoot(root)
    try:
        for p in report.problems:
            try:
                if p.category == SYMLINK:
                    safe.unlink(p.path, p.fingerprint)
                    p.action = "unlinked"
                elif p.category in _DELETE and not (quarantine_bad and p.category == BAD_PAGE):
                    safe.unlink(p.path, p.fingerprint)
                    p.action = "deleted"
                elif p.category in (FOREIGN, BAD_PAGE):
                    safe.move(p.path, p.fingerprint, qdir)
                    p.action = "quarantined"
                    report.quarantine = str(root / qdir)
                else:
                    p.repair_error = "needs a human (see the message)"
            except FileNotFoundError:
                p.action = "vanished"  # gone already (gc, a writer, another fsck)
            except (OSError, ValueError) as exc:
                p.repair_error = str(exc)
    finally:
        safe.close()


def run_fsck(options: FsckOptions) -> FsckReport:
    """Check (and with ``repair``, fix) a root; never raises for problems in the tree."""
    start = time.monotonic()
    report = FsckReport(root=str(options.root), repair=options.repair)
    progress = Progress("fsck", enabled=options.progress)
    try:
        inv: Inventory = walk_root(
            options.root, visitor=PageVerifier(options.deep), namespace=options.namespace, jobs=options.jobs,
            tmp_age=options.tmp_age, progress=progress,
        )
    except (OSError, ValueError) as exc:  # ConfigError is a ValueError
        report.error = str(exc)
        return report
    finally:
        progress.close()
    report.root = str(inv.root)
    report.problems = inv.findings
    if options.deep:
        report.problems.extend(old_tree_findings(inv))
    report.temps_active = inv.temps_active
    report.vanished = inv.vanished
    report.namespaces = len(inv.namespaces)
    report.pages_ok = sum(t.files for t in inv.tallies.values())
    report.bytes_ok = sum(t.bytes for t in inv.tallies.values())
    report.stats = stats_from_inventory(inv)
    if options.repair and report.problems and not inv.namespaces and any(p.category == FOREIGN for p in report.problems):
        # `tierstore fsck --repair /home` must not move a home directory into a quarantine.
        report.error = (f"{inv.root} holds no tierstore namespace, only other files; refusing to repair. "
                        "Check ROOT (it must be the cache directory itself)")
    elif options.repair and report.problems:
        try:
            _repair(report, inv.root, options.quarantine_bad)
        except OSError as exc:
            report.error = f"repair failed: {exc}"
    report.seconds = time.monotonic() - start
    return report
