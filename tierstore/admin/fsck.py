"""``tierstore fsck``: verify every file under a root and optionally repair.

Contract:

- ``run_fsck(FsckOptions)`` walks ROOT (``walk.walk_root``; symlinks are never followed)
  and verifies every page completely with ``fsck_read.PageVerifier`` against what its place and
  its namespace's manifest say: header checksum, every section checksum, exact file size,
  namespace digest = directory name, key/group/rank = path (``mapper.locate``), layout and
  group kind = the manifest's group. Pages are opened through checked directory fds, never
  followed, never blocking, in memory bounded per read by the layout and in total by
  ``budget_bytes`` (see fsck_read.py). Pages are read concurrently by ``jobs`` threads (None: 64,
  ``READS_IN_FLIGHT``; on NFS latency dominates, so more threads than cores pay off), at most
  as many at once as an ``AdaptiveGate`` finds pay off when ``jobs`` is None (a cached tree
  verifies fastest with 1-4: the rest only fight for the GIL). Every exception on one page is
  a finding about it.
- Problems: bad pages, stale temps, orphans, foreign files (hard-linked or non-regular page
  names: kind ``unsafe``), NFS/FUSE silly-rename leftovers, symlinks, namespace directories
  without a valid manifest, unreadable directories, and ``.tierstore*`` root entries that are
  symlinks or of the wrong type (a linked trash, index or lease). Warnings (``report.warnings``,
  no effect on the exit code): pages whose mode lets more users in than configured
  (``group_access``), cleared by ``--repair`` with fchmod on a checked fd. Text output escapes
  every name and string from the root (``display.escape``); JSON keeps them raw.
  Temp files that may still be written are counted, not reported as problems. Output: text
  with human-readable sizes (``render.human_bytes``, as ls and stats); ``--json``
  (``FsckReport.to_json``) with the schema key ``tierstore_fsck``, exact bytes, ``seconds``
  and the run's start and end as ISO 8601 UTC (``started_at``, ``finished_at``, as gc).
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
- Pages not verifiable with the key given (``mac_key_file``: no MAC tag, another key's tag, an
  algorithm not installed here, while every content check passes) are no problem and no
  damage: ``FsckReport.unverifiable``, their own count, never deleted or moved by ``--repair``
  (during a key rotation they are the other key's good pages) unless ``remove_unverifiable``
  (``--remove-unverifiable``: the operator's word that the key is the fleet's only one).
- Exit codes as e2fsck, bits added together: 0 clean, 1 errors found and all repaired, 4 errors
  left, 8 operational error (ROOT missing, bad option), 32 interrupted, and 64 pages not
  verifiable with this key left (``EXIT_UNVERIFIABLE``; 68 with damage left too).
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

import datetime as _dt
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from tierstore.admin.adaptive_gate import AdaptiveGate
from tierstore.admin.classifier import QUARANTINE_DIR
from tierstore.admin.findings import (
    BAD_PAGE,
    FOREIGN,
    MANIFEST,
    NFS_LEFTOVER,
    ORPHAN,
    STALE_TEMP,
    SYMLINK,
    UNREADABLE,
    UNVERIFIABLE,
    Finding,
    Fingerprint,
    fingerprint,
)
from tierstore.admin.fsck_read import (
    MAX_UNMANIFESTED_PAGE_BYTES,
    MODE,
    MODE_GROUP_SHARED,
    PageVerifier,
    deep_check_page,
)
from tierstore.admin.progress import Progress
from tierstore.admin.render import human_bytes
from tierstore.admin.stats import stats_from_inventory
from tierstore.admin.tally import Inventory
from tierstore.admin.walk import check_root, walk_root
from tierstore.errors import PageError, PageSealedCorrupt
from tierstore.format.header import FORMAT_VERSION, decode_header_any_version
from tierstore.format.identity import MANIFEST_NAME
from tierstore.format.mac import PageMac
from tierstore.format.page import check_stored_gaps
from tierstore.format.sealing import KeyRing, PageSealer
from tierstore.fs import display, safefs
from tierstore.fs.mapper import RESERVED_PREFIX, unknown_format

EXIT_CLEAN = 0
EXIT_REPAIRED = 1
EXIT_ERRORS_LEFT = 4
EXIT_OPERATIONAL = 8
EXIT_CANCELLED = 32
EXIT_UNVERIFIABLE = 64  # a bit of its own: not damage, so not 4 (damage left)

# A page with no usable manifest is verified into a buffer of the size its header declares;
# above MAX_UNMANIFESTED_PAGE_BYTES (fsck_read.py) it is reported, not read.
__all__ = ["MAX_UNMANIFESTED_PAGE_BYTES", "FsckOptions", "FsckReport", "PageVerifier", "deep_check_page", "run_fsck"]
CATEGORIES = (BAD_PAGE, STALE_TEMP, ORPHAN, FOREIGN, NFS_LEFTOVER, SYMLINK, MANIFEST, UNREADABLE)
READS_IN_FLIGHT = 64  # default ``jobs``: on a 10 ms mount, reads in flight set the pace
SLOW_ROOT_S = 0.001  # a root answering slower than this starts fsck's gate at READS_IN_FLIGHT
# Root entries tierstore itself creates under its reserved prefix (single source: tiers/gc_scan.py
# TRASH_DIR, tiers/lease.py LEASE_NAME, tiers/local_index.py INDEX_DIR; tests check they agree;
# not imported: the tiers package imports torch, fsck must stay light) -> whether a directory.
RESERVED_ROOT_ENTRIES = {".tierstore-trash": True, ".tierstore-gc.lease": False, ".tierstore": True}
_DELETE = frozenset({BAD_PAGE, ORPHAN, STALE_TEMP, NFS_LEFTOVER})


@dataclass
class FsckOptions:
    root: str | os.PathLike[str]
    repair: bool = False
    namespace: str | None = None  # a digest or a unique prefix
    jobs: int | None = None  # threads listing and reading pages (None: READS_IN_FLIGHT)
    tmp_age: float = 3600.0  # seconds after which a temp of another host (or a live pid) is stale
    quarantine_bad: bool = False  # move bad pages to ROOT/.quarantine instead of deleting them
    progress: bool | None = None  # None: on a terminal only
    deep: bool = False  # also check values (NaN/Inf) and older trees' gap bytes (deep_check_page)
    group_access: bool | None = None  # pages may be 0660 (None: when their namespace dir has group bits)
    budget_bytes: int = 1 << 30  # page buffers of all threads together (fsck_read.BufferPool)
    mac_key_file: str | os.PathLike[str] | None = None  # the fleet key: check every page's MAC tag
    remove_unverifiable: bool = False  # with repair: delete pages not verifiable with mac_key_file too
    # the encryption key: decrypt and fully check sealed pages (without it: ciphertext checksums)
    encryption_key_file: str | os.PathLike[str] | list[str] | None = None  # one or several (tenants' keys)


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
    started: float = 0.0  # wall clock (Unix seconds) of the run's start and end: JSON *_at
    finished: float = 0.0
    quarantine: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # operational error (exit 8)
    reads: dict[str, int] = field(default_factory=dict)  # max_in_flight, threads, peak_buffer_bytes
    # Pages whose mode lets more users in than configured (category "mode"): a confidentiality
    # warning, not damage, so not a problem for the exit code; ``--repair`` clears the bits.
    warnings: list[Finding] = field(default_factory=list)
    # Pages not verifiable with the key given (category "unverifiable"): not damage, exit bit 64.
    unverifiable: list[Finding] = field(default_factory=list)

    @property
    def repaired(self) -> int:
        return sum(1 for p in self.problems if p.action is not None)

    @property
    def left(self) -> int:
        return len(self.problems) - self.repaired

    @property
    def unverifiable_left(self) -> int:
        return sum(1 for p in self.unverifiable if p.action is None)

    @property
    def exit_code(self) -> int:
        if self.error is not None:
            return EXIT_OPERATIONAL
        code = EXIT_CLEAN
        if self.problems or any(p.action is not None for p in self.unverifiable):
            code = EXIT_REPAIRED if self.left == 0 else EXIT_ERRORS_LEFT
        return code | (EXIT_UNVERIFIABLE if self.unverifiable_left else 0)

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
            "unverifiable": len(self.unverifiable),
            "problems": len(self.problems),
            "repaired": self.repaired,
            "left": self.left,
        }

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` document: schema key first; exact bytes; ``seconds`` (the duration) and
        the start and end as ISO 8601 UTC (``started_at``, ``finished_at``: gc's format). Fields
        added to version 1 (the *_at times) keep it: readers ignore keys they do not know."""
        return {
            "tierstore_fsck": 1,
            "root": self.root,
            "repair": self.repair,
            "exit_code": self.exit_code,
            "error": self.error,
            "seconds": round(self.seconds, 3),
            "started_at": display.iso_utc(self.started, "milliseconds"),
            "finished_at": display.iso_utc(self.finished, "milliseconds"),
            "quarantine": self.quarantine,
            "counts": self.counts(),
            "problems": [p.to_json() for p in self.problems],
            "warnings": [w.to_json() for w in self.warnings],
            "unverifiable": [u.to_json() for u in self.unverifiable],
            "reads": self.reads,
            "namespaces": self.stats.get("namespaces", []),
        }

    def format_text(self) -> str:
        lines = []
        for p in (*self.problems, *self.unverifiable, *self.warnings):
            # Names and manifest strings come from the root: escaped, so none forges a line.
            done = (f"  [{p.action}]" if p.action
                    else (f"  [NOT repaired: {display.escape(p.repair_error)}]" if p.repair_error else ""))
            lines.append(f"{p.category}/{display.escape(p.kind)}: {display.escape(p.path)}: "
                         f"{display.escape(p.message)}{done}")
        if self.error:
            lines.append(f"fsck: {display.escape(self.error)}")
            return "\n".join(lines)
        c = self.counts()
        found = ", ".join(f"{c[k]} {k}" for k in CATEGORIES if c[k]) or "no problems"
        if self.warnings:
            found += f" ({len(self.warnings)} page(s) with too open a mode)"
        if self.unverifiable:
            found += (f"; {len(self.unverifiable)} page(s) not verifiable with this key (not damage: kept; "
                      "another key's pages, or planted without one)")
        lines.append(
            f"{display.escape(self.root)}: {c['namespaces']} namespace(s), {c['pages_ok']} pages ok "
            f"({human_bytes(c['bytes_ok'])}), {c['temps_active']} temp(s) in flight; {found}"
            f" in {self.seconds:.2f} s"
        )
        if self.repair and self.problems:
            lines.append(f"repaired {self.repaired}, left {self.left}"
                         + (f"; quarantine: {display.escape(self.quarantine)}" if self.quarantine else ""))
        elif self.problems:
            lines.append("run `tierstore fsck --repair` to repair")
        if self.unverifiable_left:
            lines.append("pages not verifiable with this key are kept: check them with the key that wrote them, or "
                         "remove them with `tierstore fsck --repair --remove-unverifiable --mac-key-file KEY` once "
                         "KEY is the only key of the fleet")
        return "\n".join(lines)


# Floating-point dtypes -> (same-size unsigned view, mask, pattern): a value v is NaN or Inf
# when v & mask == pattern (all exponent bits set; fp8 e4m3fn has only NaN, s.1111.111; the
# fnuz types only 0x80).
def old_tree_findings(inv: Inventory) -> list[Finding]:
    """For each namespace of an older page format: a finding counting its pages whose gap bytes
    are not zero (non-canonical). The tree is only read, through checked directory fds
    (safefs.walk: iterative, no symlink followed; files opened non-blocking), never changed."""
    out = []
    root_fd = safefs.open_root(inv.root)
    try:
        for nsd in inv.namespaces:
            if nsd.walk or nsd.namespace is None or nsd.namespace.format_version >= FORMAT_VERSION:
                continue
            try:
                ns_fd = safefs.open_dir(nsd.name, root_fd)
            except OSError:
                continue  # swapped since the walk: nothing of it is read
            total, bad = 0, 0
            try:
                for d in safefs.walk(ns_fd, max_depth=8):
                    for name, st in d.entries:
                        if name.endswith(".kvp") and not name.startswith(".") and stat.S_ISREG(st.st_mode):
                            total += 1
                            bad += not _old_page_is_canonical(name, d.fd)
            finally:
                os.close(ns_fd)
            if bad:
                out.append(Finding(str(nsd.path / MANIFEST_NAME), MANIFEST, "noncanonical",
                                   f"page format {nsd.namespace.format_version}: {bad} of {total} page(s) have "
                                   f"non-zero alignment-gap bytes (written before format {FORMAT_VERSION} zeroed "
                                   "them; such bytes may come from earlier pages); never served here, left as is"))
    finally:
        os.close(root_fd)
    return out


def _old_page_is_canonical(name: str, dir_fd: int) -> bool:
    """False when a page of an older format has non-zero gap bytes (unreadable or unsafe
    files: True, they are not this check's business)."""
    try:
        data = safefs.read_small(name, dir_fd, MAX_UNMANIFESTED_PAGE_BYTES)
        _, header = decode_header_any_version(data, path=name)
        check_stored_gaps(header, memoryview(data)[header.header_len : header.header_len + header.payload_len])
    except (OSError, PageError) as exc:
        return not (isinstance(exc, PageError) and "non-zero" in exc.message)
    return True


def reserved_root_findings(root: Path) -> list[Finding]:
    """Root entries under tierstore's reserved prefix that are not what tierstore creates: a
    symlink (a linked trash, index or lease: gc or the index would act through it) or an
    entry of the wrong type. The walk skips these names, so fsck looks at them here."""
    out = []
    with os.scandir(root) as it:
        entries = [e for e in it if e.name.startswith(RESERVED_PREFIX)]
    for e in entries:
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue  # gone since the listing
        fp = fingerprint(st)
        if stat.S_ISLNK(st.st_mode):
            try:
                target = os.readlink(e.path)
            except OSError:
                target = "?"
            out.append(Finding(e.path, SYMLINK, "symlink", f"tierstore's own entry is a symbolic link to {target!r}: "
                               "never followed; gc and the local index refuse it until it is removed",
                               size=st.st_size, mtime=st.st_mtime, fingerprint=fp))
            continue
        want_dir = RESERVED_ROOT_ENTRIES.get(e.name)
        if want_dir is None:
            continue  # another reserved name (probes, a newer tierstore's state): not ours to judge
        is_dir = stat.S_ISDIR(st.st_mode)
        if is_dir != want_dir or (not want_dir and not stat.S_ISREG(st.st_mode)):
            what = "directory" if want_dir else "regular file"
            out.append(Finding(e.path, FOREIGN, "reserved", f"tierstore's own entry should be a {what}, it is "
                               f"file type {stat.S_IFMT(st.st_mode):#o}; tierstore refuses it until it is moved",
                               size=st.st_size, mtime=st.st_mtime, is_dir=is_dir, fingerprint=fp))
    return out


class SafeRoot:
    """Removes, moves and chmods entries under ROOT without ever following a symlink.

    Every directory is opened component by component from ROOT's fd with O_NOFOLLOW
    (safefs.open_dir_path), every act is an ``*at`` call relative to that checked fd, and the
    entry's fingerprint (device, inode, size, mtime, ctime) must still be what the scan saw.
    """

    def __init__(self, root: Path):
        self.root = root
        self.root_fd = safefs.open_root(root)

    def close(self) -> None:
        os.close(self.root_fd)

    def _rel(self, path: str) -> PurePosixPath:
        rel = PurePosixPath(os.path.relpath(path, self.root))
        if rel.is_absolute() or not rel.parts or ".." in rel.parts or rel.parts == (".",):
            raise ValueError(f"{path} is not inside {self.root}")
        return rel

    def _open_dir(self, parts: tuple[str, ...], create: bool = False) -> int:
        return safefs.open_dir_path(self.root_fd, parts, create=create)

    def _check_same(self, name: str, dir_fd: int, expected: Fingerprint | None) -> os.stat_result:
        st = safefs.lstat_at(name, dir_fd)
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

    def chmod(self, path: str, expected: Fingerprint | None, allowed: int) -> None:
        """Clear a page's group/other mode bits beyond ``allowed``, through an fd opened
        O_NOFOLLOW|O_NONBLOCK in its checked directory (fchmod: a hard link, a FIFO or a
        swapped entry is never changed)."""
        rel = self._rel(path)
        dir_fd = self._open_dir(rel.parts[:-1])
        try:
            fd, st = safefs.open_regular(rel.name, dir_fd)
            try:
                if expected is not None and (st.st_dev, st.st_ino) != expected[:2]:
                    raise FileExistsError("the entry changed since the scan; run fsck again")
                os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~(0o077 & ~allowed))
            finally:
                os.close(fd)
        finally:
            os.close(dir_fd)


# Called between the scan and the repair (tests swap directories for symlinks here).
_before_repair_hook: Callable[[], None] | None = None


def _key_ring(files: str | os.PathLike[str] | list[str] | None) -> KeyRing | None:
    """The keys fsck opens sealed pages with: every ``--encryption-key-file`` (the default key
    and tenants' keys alike: a page's trailer names its key)."""
    paths = [files] if isinstance(files, str | os.PathLike) else list(files or ())
    if not paths:
        return None
    first, *rest = paths
    return KeyRing(PageSealer.from_key_file(first), {f"#{i}": PageSealer.from_key_file(p) for i, p in enumerate(rest)})


def _repair(report: FsckReport, root: Path, quarantine_bad: bool, remove_unverifiable: bool = False) -> None:
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    qdir = PurePosixPath(QUARANTINE_DIR) / f"{stamp}-{os.getpid()}"
    if _before_repair_hook is not None:
        _before_repair_hook()
    safe = SafeRoot(root)
    try:
        for p in (*report.problems, *report.warnings, *(report.unverifiable if remove_unverifiable else ())):
            try:
                if p.category == SYMLINK:
                    safe.unlink(p.path, p.fingerprint)
                    p.action = "unlinked"
                elif p.category == MODE:
                    shared = p.kind == MODE_GROUP_SHARED
                    safe.chmod(p.path, p.fingerprint, (safefs.GROUP_SHARED if shared else safefs.PRIVATE).file_mode)
                    p.action = "chmod"
                elif p.kind == PageSealedCorrupt.kind:
                    p.repair_error = ("damage found in an encrypted page without its key: kept (nothing is removed "
                                      "that this fsck cannot authenticate); run fsck --repair with "
                                      "--encryption-key-file to remove it")
                elif p.category == UNVERIFIABLE or (p.category in _DELETE
                                                     and not (quarantine_bad and p.category == BAD_PAGE)):
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


def root_latency_s(root: str | os.PathLike[str]) -> float:
    """Median seconds of three ``stat`` + ``scandir`` round trips on ``root``: about 10 us on
    a local disk, one or two server round trips on NFS (unless its attribute cache answers)."""
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        os.stat(root)
        with os.scandir(root) as it:
            next(it, None)
        times.append(time.perf_counter() - t0)
    return sorted(times)[1]


def run_fsck(options: FsckOptions) -> FsckReport:
    """Check (and with ``repair``, fix) a root; never raises for problems in the tree. The
    report's times (``seconds``, ``started``, ``finished``) cover the whole run, an error's too."""
    return timed_report(options, _run_fsck)


def timed_report(options: FsckOptions, run: Callable[[FsckOptions, FsckReport], None]) -> FsckReport:
    """A report of ``run(options, report)`` whose times cover the whole run, an error's too
    (the directory fsck's and the object fsck's)."""
    start = time.monotonic()
    report = FsckReport(root=str(options.root), repair=options.repair, started=time.time())
    try:
        run(options, report)
    finally:
        report.finished = time.time()
        report.seconds = time.monotonic() - start
    return report


def _run_fsck(options: FsckOptions, report: FsckReport) -> None:
    progress = Progress("fsck", enabled=options.progress)
    jobs = options.jobs or READS_IN_FLIGHT
    verifier: PageVerifier | None = None
    try:
        root = check_root(options.root)
        refusal = unknown_format(root) if options.repair else None
        if refusal is not None:  # a newer tierstore's layouts: not this version's to repair
            report.error = f"refusing to repair {display.escape(str(root))}: {refusal}"
            return
        # Default: as many pages at once as pay off, up to READS_IN_FLIGHT (adaptive_gate.py):
        # from all of them on a slow mount, from 1 elsewhere (a cached tree settles at 1-4,
        # where 64 threads only fight for the GIL). An explicit --jobs is kept as given.
        first_limit = jobs if root_latency_s(root) > SLOW_ROOT_S else 1
        gate = AdaptiveGate(jobs, adaptive=options.jobs is None, start=first_limit)
        mac = PageMac.from_key_file(options.mac_key_file) if options.mac_key_file is not None else None
        sealer = _key_ring(options.encryption_key_file)
        verifier = PageVerifier(root, deep=options.deep, budget_bytes=options.budget_bytes,
                                group_access=options.group_access, mac=mac, sealer=sealer)
        inv: Inventory = walk_root(
            root, visitor=verifier, namespace=options.namespace, jobs=jobs,
            tmp_age=options.tmp_age, progress=progress, gate=gate,
        )
        reserved = reserved_root_findings(inv.root) if options.namespace is None else []
    except (OSError, ValueError) as exc:  # ConfigError is a ValueError
        report.error = str(exc)
        return
    except Exception as exc:  # noqa: BLE001 - a report with exit 8, never a traceback
        report.error = f"the walk stopped: {type(exc).__name__}: {exc} (a tierstore bug: please report it)"
        return
    finally:
        progress.close()
        if verifier is not None:
            verifier.close()
    report.root = str(inv.root)
    report.problems = [f for f in inv.findings if f.category != UNVERIFIABLE] + reserved
    report.unverifiable = [f for f in inv.findings if f.category == UNVERIFIABLE]
    report.warnings = sorted(verifier.mode_findings, key=lambda f: f.path)
    if options.deep:
        report.problems.extend(old_tree_findings(inv))
    report.temps_active = inv.temps_active
    report.vanished = inv.vanished
    report.namespaces = len(inv.namespaces)
    report.pages_ok = sum(t.files for t in inv.tallies.values())
    report.bytes_ok = sum(t.bytes for t in inv.tallies.values())
    report.stats = stats_from_inventory(inv)
    report.reads = {"threads": jobs, "max_in_flight": verifier.max_reads_in_flight,
                    "peak_buffer_bytes": verifier.pool.peak, "adaptive": gate.adaptive,
                    "limit_final": gate.limit, "limit_max": max(gate.limits_seen),
                    "native_pages": verifier.native_pages}
    if options.repair and report.problems and not inv.namespaces and any(p.category == FOREIGN for p in report.problems):
        # `tierstore fsck --repair /home` must not move a home directory into a quarantine.
        report.error = (f"{inv.root} holds no tierstore namespace, only other files; refusing to repair. "
                        "Check ROOT (it must be the cache directory itself)")
    elif options.repair and (report.problems or report.warnings
                             or (options.remove_unverifiable and report.unverifiable)):
        try:
            _repair(report, inv.root, options.quarantine_bad, options.remove_unverifiable)
        except OSError as exc:
            report.error = f"repair failed: {exc}"
