"""Shared-tier garbage collection: keep a shared root under ``max_bytes`` with many nodes.

Contract (``tierstore gc ROOT --max-bytes N``, and ``GcDaemon`` as the background mode):

1. Take the lease (``lease.py``); if another node holds it, do nothing (report ``busy``). If
   the lease cannot be written because the export is full (ENOSPC, EDQUOT), first unlink a few
   least recently used pages without it (``_make_room``), then take it.
2. Sweep the trash dir ``ROOT/.tierstore-trash``: unlink entries older than ``trash_grace_s``.
3. Scan every namespace under ROOT (and the root's own probe and lease leftovers): page files (LRU stamp = mtime, which readers refresh with
   a rate-limited ``utime`` on hit), temp files (those older than ``temp_max_age_s`` were
   abandoned by a dead writer and are removed), tierstore's own metadata (a namespace's
   ``manifest.json``, the name fsck's walk accepts there: ``metadata_bytes``) and anything
   else (``.nfs*``, ``.fuse_hidden*``, foreign files: ``other_bytes``, with a warning that
   names ``tierstore fsck``); both counted, never touched, not toward the cap: fsck owns them.
4. If the bytes found exceed ``max_bytes``, evict least-recently-stamped pages until the total
   is at most ``low_watermark * max_bytes``. A victim is re-``stat``ed first (a page hit since
   the scan is skipped), then renamed into the trash (the name vanishes atomically: new
   readers get a clean miss; a reader that already has it open keeps reading the whole file,
   which it verifies), then unlinked after the grace period; with grace 0 it is unlinked at
   its place at once (the same visibility as a rename followed by an unlink, one operation
   less). ENOENT/ESTALE mean another evictor got there first.
5. Renew the lease while working; stop evicting as soon as it is lost. Release it.

``dry_run`` changes nothing under ROOT (no lease file, no trash directory, no unlink or
rename) and reports what the real pass would do in the same fields: the pages and bytes it
would evict (the same LRU prefix), the stale temps and the trash entries it would remove.
The plan is the real pass's result when nothing is hit or removed in between.

A ROOT holding entries but no namespace directory is refused (``refused``), as fsck refuses
it: it is probably not a cache directory, and gc would otherwise write its lease and trash
there. So is a ROOT whose format marker (``ROOT/.tierstore-format``, ``mapper.unknown_format``)
names a format or layout this version does not know: a newer tierstore wrote it. A refusal
and a lease problem are returned in the report (``refused``, ``lease_problem``) and logged at
debug only: the caller says them once (the CLI as its error line, ``GcDaemon`` as a warning).

Scale (docs/measurements/fsck.md): the scan keeps about 70 bytes per page in packed arrays
(``_ScanTable``; a list of objects took about 450). Victims are taken in LRU order, batch by
batch (each batch exactly the LRU prefix that reaches the target, so the set evicted is the
same as one victim at a time), and each batch is evicted directory by directory through one
checked directory fd per directory, ``evict_threads`` directories at a time: per victim one
``lstat`` and one ``unlink`` (or ``rename``), never a directory walk from the root. The cost
left is the file system's own unlink: 0.1-1 ms per file on this machine's ext4, which is
mounted ``-o discard`` (the freed blocks are trimmed while the unlink waits), and a round
trip on NFS; several in flight hide most of it.

Hostile roots (anything under ROOT is untrusted input): every directory is opened with
``O_NOFOLLOW`` relative to its parent's fd and every unlink/rename is an ``*at`` call on the fd
that was checked, after re-checking the victim's (device, inode, mtime) (safefs.py): a symlinked
trash, namespace or fan-out directory, even one swapped in between scan and eviction, is
reported in ``unsafe`` (said by the caller: the CLI prints it, the daemon warns when it changes)
and never followed. The walk is iterative with the layout's depth. The cap counts only bytes
gc can free: file bytes (``st_size``, the meaning every command's bytes have) of regular,
single-link pages at their place, temps and trash entries; tierstore's own manifests are
counted in ``metadata_bytes`` (no warning); everything else (a 1 TiB sparse foreign file,
hard-linked pages) is counted in ``other_bytes`` and warned about, never a reason to evict. A
lease problem (a directory at the lease path) is reported in ``lease_problem``.

No sqlite and no lock on the shared root: everything is files, renames and stats.
Threading: ``collect`` is a plain function (it evicts on a private pool of ``evict_threads``);
``GcDaemon`` is one daemon thread per root.
"""

from __future__ import annotations

import argparse
import logging
import os
import stat
import threading
import time
import uuid
from array import array
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tierstore.errors import GONE_ERRNOS, SPACE_ERRNOS
from tierstore.format.identity import MANIFEST_NAME
from tierstore.fs import safefs
from tierstore.fs.deadline import note_space_freed
from tierstore.fs.display import escape, parse_size
from tierstore.fs.lease import Lease
from tierstore.fs.mapper import (
    FORMAT_MARKER_TEMP_RE,
    NAMESPACE_DIR_RE,
    PAGE_SUFFIX,
    PROBE_LEFTOVER_RE,
    RESERVED_PREFIX,
    SILLY_RENAME_PREFIXES,
    fanout,
    host_tag,
    parse_index_dir,
    parse_page_name,
    parse_rank_dir,
    unknown_format,
)
from tierstore.fs.stale_temps import TempWriter, temp_writer, writer_gone
from tierstore.metrics import TierMetrics

log = logging.getLogger(__name__)

TRASH_DIR = ".tierstore-trash"
_PAGE_DEPTH = 4  # namespace / g<group> / r<rank> / <fan-out> / page
_EVICT_BATCH = 4096  # victims per batch evicted in directory order
EVICT_THREADS = 8  # unlinks in flight (``--evict-threads``)
# Called between the scan and the evictions (tests swap a directory for a symlink here).
_after_scan_hook: Callable[[], None] | None = None


@dataclass
class GcReport:
    busy: bool = False  # another node holds the lease: nothing was done
    lease_lost: bool = False
    pages: int = 0
    page_bytes: int = 0
    temp_bytes: int = 0
    other_bytes: int = 0  # foreign, hard-linked or unexpected files (warned about)
    metadata_bytes: int = 0  # tierstore's own metadata (namespace manifests): neither pages nor foreign
    trash_bytes: int = 0  # still in the trash (grace period) after the run
    total_before: int = 0
    total_after: int = 0
    evicted: int = 0
    evicted_bytes: int = 0
    skipped_recent: int = 0  # victims hit (re-stamped) since the scan
    vanished: int = 0  # victims another evictor or fsck removed first
    temps_removed: int = 0
    trash_removed: int = 0
    lease_problem: str | None = None  # the lease path is not a lease file (see lease.py)
    room_evicted: int = 0  # of ``evicted``: taken without the lease, the export full (``_make_room``)
    room_bytes: int = 0
    refused: str | None = None  # not a cache directory: nothing done
    dry_run: bool = False  # the counts below are what a real pass would do
    unsafe: list[str] = field(default_factory=list)  # entries gc refused to follow or touch
    seconds: float = 0.0
    started: float = 0.0  # wall clock (Unix seconds) when this node held the lease
    finished: float = 0.0


class _ScanTable:
    """The pages the scan found, packed in arrays (about 70 bytes a page): directory index,
    key bytes, (device, inode), file size, mtime stamp. Threading: one thread."""

    def __init__(self) -> None:
        self.dirs: list[tuple[str, ...]] = []  # directory parts under the root
        self._dir_ids: dict[tuple[str, ...], int] = {}
        self.dir_of = array("I")
        self.stamp = array("q")  # mtime in ns: the LRU stamp
        self.size = array("q")  # file bytes (st_size): what evicting it frees
        self.dev = array("Q")
        self.ino = array("Q")
        self._key_off = array("Q")
        self._key_len = array("B")
        self._keys = bytearray()

    def __len__(self) -> int:
        return len(self.stamp)

    def add(self, parts: tuple[str, ...], key: bytes, st: os.stat_result) -> None:
        d = self._dir_ids.get(parts)
        if d is None:
            d = self._dir_ids[parts] = len(self.dirs)
            self.dirs.append(parts)
        self.dir_of.append(d)
        self.stamp.append(st.st_mtime_ns)
        self.size.append(_file_bytes(st))
        self.dev.append(st.st_dev)
        self.ino.append(st.st_ino)
        self._key_off.append(len(self._keys))
        self._key_len.append(len(key))
        self._keys += key

    def name(self, i: int) -> str:
        o = self._key_off[i]
        return self._keys[o:o + self._key_len[i]].hex() + PAGE_SUFFIX

    def lru_order(self) -> Iterator[int]:
        """Page indexes, least recently stamped first (stable: ties in scan order)."""
        import numpy as np  # already loaded with the tiers package; 8 bytes a page, not ~70 for a list

        yield from (int(i) for i in np.argsort(np.frombuffer(self.stamp, dtype=np.int64), kind="stable"))


def _file_bytes(st: os.stat_result) -> int:
    """A file's bytes as every tierstore command counts them: ``st_size`` (what ``stat`` and
    ``ls -l`` report, and what ``tierstore stats`` sums), not its allocated blocks, which
    depend on the file system (4 KiB rounding on ext4, compression on ZFS, the server on NFS)."""
    return st.st_size


def _page_key(parts: tuple[str, ...], name: str) -> bytes | None:
    """The key of a page at its place (``ns/g<group>/<rank dir>/<fan-out>/<key>.kvp``), else None."""
    if len(parts) != _PAGE_DEPTH or not NAMESPACE_DIR_RE.match(parts[0]):
        return None
    key = parse_page_name(name)
    if (key is not None and parse_index_dir(parts[1], "g") is not None
            and parse_rank_dir(parts[2]) is not None and fanout(key) == parts[3]):  # r<rank> or h<s>-<c>
        return key
    return None


def _unsafe(rep: GcReport, where: str, what: str) -> None:
    if len(rep.unsafe) < 100:
        rep.unsafe.append(f"{escape(where)}: {what}")
    # at debug: the caller says it (the CLI's "refused" lines, the daemon's warning), once
    log.debug("tierstore gc: %s: %s; not followed, not touched", escape(where), what)


def parse_bytes(text: str) -> int:
    """``--max-bytes``: ``fs.display.parse_size``'s forms, as an argparse type."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _sweep_trash(trash_fd: int, grace_s: float, rep: GcReport) -> None:
    dry = rep.dry_run
    now = time.time_ns()
    for name, st in safefs._list(trash_fd):
        if not stat.S_ISREG(st.st_mode):
            _unsafe(rep, f"{TRASH_DIR}/{name}", "not a regular file in the trash")
            continue
        born_text = name.split(".", 1)[0]  # names start with the eviction time in ns
        born = int(born_text) if born_text.isascii() and born_text.isdigit() and len(born_text) <= 20 else 0
        size = _file_bytes(st)
        if now - born >= grace_s * 1e9:
            try:
                if not dry:
                    safefs.unlink_at(name, trash_fd, safefs.identity(st))
                rep.trash_removed += 1
            except OSError as exc:
                if exc.errno not in GONE_ERRNOS:
                    rep.trash_bytes += size
        else:
            rep.trash_bytes += size


def _scan(root_fd: int, temp_max_age_s: float, rep: GcReport, lease: Lease) -> _ScanTable:
    pages = _ScanTable()
    now = time.time()

    def descend(parts: tuple[str, ...]) -> bool:
        return NAMESPACE_DIR_RE.match(parts[0]) is not None

    def on_error(parts: tuple[str, ...], exc: BaseException) -> None:
        if isinstance(exc, safefs.UnsafeEntry):
            _unsafe(rep, "/".join(parts), exc.reason)

    for d in safefs.walk(root_fd, max_depth=_PAGE_DEPTH, descend=descend, on_error=on_error):
        lease.renew_if_due()
        if not d.parts:  # the root: its files are the lease, the marker...: only the marker's temps are gc's
            for name, st in d.entries:
                if FORMAT_MARKER_TEMP_RE.match(name) and stat.S_ISREG(st.st_mode):
                    _sweep_temp(d.fd, name, st, temp_writer(name), temp_max_age_s, now, rep)
                elif PROBE_LEFTOVER_RE.match(name) and stat.S_ISREG(st.st_mode):
                    _sweep_leftover(d.fd, name, st, temp_max_age_s, now, rep)
            continue
        for name, st in d.entries:
            where = "/".join((*d.parts, name))
            if stat.S_ISDIR(st.st_mode):
                if len(d.parts) >= _PAGE_DEPTH:
                    _unsafe(rep, where, "a directory deeper than the layout")
                continue
            if stat.S_ISLNK(st.st_mode):
                _unsafe(rep, where, "a symlink")
                continue
            if not stat.S_ISREG(st.st_mode):
                _unsafe(rep, where, "not a regular file")
                continue
            key = _page_key(d.parts, name)
            if key is not None:
                if st.st_nlink != 1:
                    _unsafe(rep, where, f"a page with {st.st_nlink} links (counted as foreign)")
                    rep.other_bytes += _file_bytes(st)
                    continue
                pages.add(d.parts, key, st)
                rep.page_bytes += _file_bytes(st)
            elif (writer := temp_writer(name)) is not None:
                _sweep_temp(d.fd, name, st, writer, temp_max_age_s, now, rep)
            elif PROBE_LEFTOVER_RE.match(name):
                _sweep_leftover(d.fd, name, st, temp_max_age_s, now, rep)
            elif len(d.parts) == 1 and name == MANIFEST_NAME:  # fsck's rule (inventory.fan_dirs): ours
                rep.metadata_bytes += _file_bytes(st)
            else:
                rep.other_bytes += _file_bytes(st)
    rep.pages = len(pages)
    return pages


def _sweep_leftover(dir_fd: int, name: str, st: os.stat_result, temp_max_age_s: float, now: float,
                    rep: GcReport) -> None:
    """A probe or lease file left behind (``mapper.PROBE_LEFTOVER_RE``: its writer unlinks it
    within a call): removed once older than ``temp_max_age_s`` (``_remove_or_count``)."""
    _remove_or_count(dir_fd, name, st, now - st.st_mtime > temp_max_age_s, rep)


def _sweep_temp(dir_fd: int, name: str, st: os.stat_result, writer: TempWriter | None, temp_max_age_s: float,
                now: float, rep: GcReport) -> None:
    """The temp ``name``: removed if its ``writer`` (``temp_writer``'s parse of the name) is gone
    (``writer_gone``; ``_remove_or_count``)."""
    stale = writer is not None and writer_gone(writer, st.st_mtime, grace_s=temp_max_age_s, now=now)[0]
    _remove_or_count(dir_fd, name, st, stale, rep)


def _remove_or_count(dir_fd: int, name: str, st: os.stat_result, stale: bool, rep: GcReport) -> None:
    """Unlink a ``stale`` temp (not in a dry run) and count it removed; count any other's bytes
    as temp bytes. Failure policy: one that cannot be removed is counted as kept."""
    if stale:
        try:
            if not rep.dry_run:
                safefs.unlink_at(name, dir_fd, safefs.identity(st))
            rep.temps_removed += 1
            return
        except OSError:
            pass
    rep.temp_bytes += _file_bytes(st)


class _Evictor:
    """Evicts victims given in directory order through one checked fd per directory.
    Threading: one thread; ``close`` releases the fd."""

    def __init__(self, pages: _ScanTable, root_fd: int, trash_fd: int, grace_s: float, rep: GcReport) -> None:
        self.pages, self.root_fd, self.trash_fd, self.grace_s, self.rep = pages, root_fd, trash_fd, grace_s, rep
        self._dir = -1
        self._dir_fd = -1  # with _dir set: -1 that directory is gone, -2 it is unsafe (reported once)

    def close(self) -> None:
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
        self._dir, self._dir_fd = -1, -1

    def _fd_of(self, d: int) -> int:
        if d == self._dir:
            return self._dir_fd
        self.close()
        self._dir = d
        parts = self.pages.dirs[d]
        try:
            self._dir_fd = safefs.open_dir_path(self.root_fd, parts)
        except safefs.UnsafeEntry as exc:
            _unsafe(self.rep, "/".join(parts), f"{exc.reason} since the scan")
            self._dir_fd = -2
        except OSError:
            self._dir_fd = -1  # gone: its victims count as vanished
        return self._dir_fd

    def evict(self, i: int) -> None:
        """Evict page ``i`` unless it changed since the scan; updates the report."""
        pages, rep = self.pages, self.rep
        dir_fd = self._fd_of(pages.dir_of[i])
        if dir_fd < 0:
            rep.vanished += dir_fd == -1
            return
        name = pages.name(i)
        ident = (pages.dev[i], pages.ino[i])
        try:
            st = _fresh_stat(name, dir_fd)
        except OSError:
            rep.vanished += 1
            return
        if safefs.identity(st) != ident or not stat.S_ISREG(st.st_mode):
            _unsafe(rep, "/".join((*pages.dirs[pages.dir_of[i]], name)), "replaced since the scan")
            return
        if st.st_mtime_ns != pages.stamp[i]:
            rep.skipped_recent += 1
            return
        try:
            if self.grace_s <= 0:
                os.unlink(name, dir_fd=dir_fd)  # the entry checked just above, in a checked directory
            else:
                dest = f"{time.time_ns()}.{host_tag()}.{os.getpid()}.{uuid.uuid4().hex[:8]}.kvp"
                os.rename(name, dest, src_dir_fd=dir_fd, dst_dir_fd=self.trash_fd)
                rep.trash_bytes += pages.size[i]
        except OSError as exc:
            if exc.errno in GONE_ERRNOS:
                rep.vanished += 1
                return
            raise
        rep.evicted += 1
        rep.evicted_bytes += pages.size[i]


def _fresh_stat(name: str, dir_fd: int) -> os.stat_result:
    """A victim's attributes as the file server has them now, for the re-check before evicting:
    an ``lstat`` on NFS is answered from the attribute cache (acregmax 60 s), so a page another
    node stamped seconds ago still looked cold; an open revalidates (close-to-open). The open
    follows no symlink and never blocks (O_NONBLOCK: a FIFO planted under the name); anything
    that cannot be opened that way falls back to ``lstat``, whose type check then refuses it."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in GONE_ERRNOS:
            raise
        return safefs.lstat_at(name, dir_fd)
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def _open_trash(root_fd: int, rep: GcReport) -> int | None:
    """The trash directory's fd (created unless a dry run); -1 a dry run's absent trash; None
    unsafe (reported: gc does nothing)."""
    try:
        return safefs.open_dir_path(root_fd, (TRASH_DIR,), create=not rep.dry_run)
    except safefs.UnsafeEntry as exc:
        _unsafe(rep, TRASH_DIR, f"{exc.reason}: gc neither sweeps nor evicts; remove it")
        return None
    except FileNotFoundError:
        if rep.dry_run:
            return -1
        raise




def not_a_cache(root_fd: int) -> str | None:
    """Why the directory ``root_fd`` is not a cache root (entries, none a namespace directory),
    or None (a cache root, or empty: a cache not written yet)."""
    # tierstore's own entries (a down tier's probe files too) say nothing about what the root is
    # (a silly-renamed lease, read by one node while another replaced it, says nothing either)
    names = [name for name, _ in safefs._list(root_fd)
             if not name.startswith(RESERVED_PREFIX) and not name.startswith(SILLY_RENAME_PREFIXES)]
    if not names or any(NAMESPACE_DIR_RE.match(name) for name in names):
        return None
    shown = ", ".join(escape(n) for n in sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
    return (f"it holds {len(names)} entries ({shown}) and no namespace directory: probably not a cache "
            "directory; pass the directory given as \"root\" (fsck refuses it too)")


class DryLease:
    """The lease of a dry run: taken without writing anything (a dry run changes nothing)."""

    problem: str | None = None

    def acquire(self) -> bool:
        return True

    def renew_if_due(self) -> bool:
        return True

    def release(self) -> bool:
        return True


def collect(
    root: str | os.PathLike[str],
    max_bytes: int,
    *,
    low_watermark: float = 0.9,
    trash_grace_s: float = 0.0,
    temp_max_age_s: float = 3600.0,
    lease: Lease | None = None,
    dry_run: bool = False,
    metrics: TierMetrics | None = None,
    evict_threads: int = EVICT_THREADS,
) -> GcReport:
    """One gc pass over ``root`` (see the module docstring)."""
    t0 = time.monotonic()
    root = Path(root)
    rep = GcReport(dry_run=dry_run)
    root_fd = safefs.open_root(root)
    try:
        rep.refused = not_a_cache(root_fd)
    finally:
        os.close(root_fd)
    if not rep.refused and not dry_run:  # a newer tierstore's layouts: not this version's to evict
        rep.refused = unknown_format(root)
    if rep.refused:  # the caller says it (one line): the CLI's error, GcDaemon's warning
        log.debug("tierstore gc %s: refused: %s", root, rep.refused)
        rep.seconds = time.monotonic() - t0
        return rep
    if dry_run and (lease is None or isinstance(lease, Lease)):
        lease = DryLease()  # type: ignore[assignment]  # never the real one: it writes its file
    lease = lease or Lease(root)
    held = lease.acquire()
    if not held and not dry_run and getattr(lease, "problem_errno", None) in SPACE_ERRNOS:
        _make_room(root, temp_max_age_s, max(1, evict_threads), rep)
        held = lease.acquire()  # in the room just made
    if not held:
        if metrics is not None and rep.room_evicted:
            metrics.evicted(rep.room_evicted, rep.room_bytes)
        rep.lease_problem = lease.problem
        rep.busy = lease.problem is None
        if lease.problem:  # the caller says it, as a refusal
            log.debug("tierstore gc %s: %s", root, lease.problem)
        rep.seconds = time.monotonic() - t0
        return rep
    rep.started = time.time()
    root_fd = safefs.open_root(root)
    try:
        _collect_locked(root_fd, max_bytes, low_watermark, trash_grace_s, temp_max_age_s, lease, dry_run, rep,
                        max(1, evict_threads))
    finally:
        os.close(root_fd)
        rep.finished = time.time()
        if not lease.release():  # taken over after ours expired unrenewed (a starved pass): say so
            rep.lease_lost = True
    if rep.other_bytes:
        log.warning("tierstore gc %s: %d bytes are not pages gc can free (foreign, hard-linked or unexpected "
                    "files) and do not count toward the cap; `tierstore fsck %s` lists them", escape(root),
                    rep.other_bytes, escape(root))
    if metrics is not None and not dry_run:
        metrics.evicted(rep.evicted, rep.evicted_bytes)
        metrics.set_capacity(rep.total_after, max_bytes)
    if rep.evicted and not dry_run:
        note_space_freed(root)  # this process's tiers on the root stop skipping stores
    rep.seconds = time.monotonic() - t0
    return rep


ROOM_FRACTION = 0.02  # of the page bytes, evicted without the lease when the export is full


def _make_room(root: Path, temp_max_age_s: float, threads: int, rep: GcReport) -> None:
    """The export is full (the lease could not be written: ENOSPC or EDQUOT): unlink the
    least recently used pages, ``ROOM_FRACTION`` of the page bytes and at least one page, and
    stale temps, without the lease, so the lease, the nodes' stores and the next pass have room.

    Without this a full export never recovered: gc needs the lease to evict, the lease needs a
    new file, and every node's stores stay refused. Several nodes doing this at once scan the
    same pages in the same LRU order, so they mostly unlink the same victims (the later ones
    count them ``vanished``); eviction is safe with two evictors (renames and unlinks of
    checked entries, readers verify). Unlinked at once, not through the trash: a rename frees
    nothing. Counted in ``evicted`` and in ``room_evicted``; a warning names the cap when the
    export filled up below it. Failure policy: an error is logged, never raised (the regular
    pass then reports the lease problem)."""
    room = GcReport()
    try:
        root_fd = safefs.open_root(root)
        try:
            pages = _scan(root_fd, temp_max_age_s, room, DryLease())  # type: ignore[arg-type]
            target = room.page_bytes - max(int(room.page_bytes * ROOM_FRACTION), 1)
            _evict_down_to(pages, target, room.page_bytes, _Victims(pages, root_fd, -1, 0.0, threads), DryLease(),
                           room)  # type: ignore[arg-type]
        finally:
            os.close(root_fd)
    except OSError as exc:
        log.warning("tierstore gc %s: the export is full and making room failed: %s", escape(root), exc)
    rep.evicted, rep.evicted_bytes = room.evicted, room.evicted_bytes
    rep.room_evicted, rep.room_bytes = room.evicted, room.evicted_bytes
    rep.vanished, rep.temps_removed, rep.unsafe = room.vanished, room.temps_removed, room.unsafe
    if room.evicted:
        note_space_freed(root)
        log.warning("tierstore gc %s: the export is full (%d bytes of pages found): %d least recently used pages "
                    "(%d bytes) unlinked without the gc lease to make room; if this repeats, max_bytes is above "
                    "what the export (or its quota) holds: lower --max-bytes", escape(root), room.page_bytes,
                    room.evicted, room.evicted_bytes)


def _collect_locked(root_fd: int, max_bytes: int, low_watermark: float, grace_s: float, temp_max_age_s: float,
                    lease: Lease, dry_run: bool, rep: GcReport, threads: int) -> None:
    trash_fd = _open_trash(root_fd, rep)
    if trash_fd is None:
        return
    try:
        if trash_fd >= 0:
            _sweep_trash(trash_fd, grace_s, rep)
        pages = _scan(root_fd, temp_max_age_s, rep, lease)
        # Only what gc can free counts; evicted pages wait in the trash for the grace period and
        # are counted again by the next pass until they are unlinked.
        rep.total_before = rep.page_bytes + rep.temp_bytes + rep.trash_bytes
        live = rep.total_before - rep.trash_bytes
        if _after_scan_hook is not None:
            _after_scan_hook()
        if rep.total_before > max_bytes and dry_run:
            live = _plan_down_to(pages, int(max_bytes * low_watermark), live, grace_s, rep)
        elif rep.total_before > max_bytes:
            victims = _Victims(pages, root_fd, trash_fd, grace_s, threads)
            live = _evict_down_to(pages, int(max_bytes * low_watermark), live, victims, lease, rep)
        rep.total_after = live + rep.trash_bytes
    finally:
        if trash_fd >= 0:
            os.close(trash_fd)


def _plan_down_to(pages: _ScanTable, target: int, live: int, grace_s: float, rep: GcReport) -> int:
    """A dry run's eviction: the LRU prefix ``_evict_down_to`` would evict, counted in ``rep``
    (with a grace period, its bytes as the trash's); the live bytes after."""
    for i in pages.lru_order():
        if live <= target:
            break
        rep.evicted += 1
        rep.evicted_bytes += pages.size[i]
        rep.trash_bytes += pages.size[i] if grace_s > 0 else 0
        live -= pages.size[i]
    return live


class _Victims:
    """Evicts a batch: its directories spread over ``threads`` threads, each directory's victims
    by one ``_Evictor`` (its own fd and report), merged into the pass's report on the caller's
    thread. Unlinks wait on the file system (an online discard on ext4 ``-o discard``, a round
    trip on NFS), so several in flight pay even on 2 cores. Threading: one caller thread."""

    def __init__(self, pages: _ScanTable, root_fd: int, trash_fd: int, grace_s: float, threads: int) -> None:
        self.pages, self.root_fd, self.trash_fd, self.grace_s = pages, root_fd, trash_fd, grace_s
        self.pool = (ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tierstore-gc-evict")
                     if threads > 1 else None)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()

    def _one_dir(self, victims: list[int]) -> GcReport:
        part = GcReport()
        evictor = _Evictor(self.pages, self.root_fd, self.trash_fd, self.grace_s, part)
        try:
            for i in victims:
                evictor.evict(i)
        finally:
            evictor.close()
        return part

    def evict(self, batch: list[int], rep: GcReport) -> int:
        """Evict ``batch`` (page indexes); the bytes freed. Merges the counts into ``rep``."""
        dir_of = self.pages.dir_of
        by_dir: dict[int, list[int]] = {}
        for i in batch:
            by_dir.setdefault(dir_of[i], []).append(i)
        groups = list(by_dir.values())
        parts = self.pool.map(self._one_dir, groups) if self.pool is not None else map(self._one_dir, groups)
        freed = 0
        for part in parts:
            freed += part.evicted_bytes
            rep.evicted += part.evicted
            rep.evicted_bytes += part.evicted_bytes
            rep.trash_bytes += part.trash_bytes
            rep.vanished += part.vanished
            rep.skipped_recent += part.skipped_recent
            rep.unsafe.extend(part.unsafe[:max(0, 100 - len(rep.unsafe))])
        return freed


def _evict_down_to(pages: _ScanTable, target: int, live: int, victims: _Victims, lease: Lease, rep: GcReport) -> int:
    """Evict in LRU order until ``live`` bytes are at most ``target``; the live bytes after.

    Batch by batch: a batch is the LRU prefix (at most ``_EVICT_BATCH`` pages) that brings
    ``live`` to the target if every victim goes, so the pages evicted are the same as one at a
    time in LRU order; within a batch the order does not matter (all go), so it is evicted
    directory by directory (one open each) on several threads. Victims skipped (hit since the
    scan) or gone make the next batch longer. The lease is renewed before each batch (a batch
    takes seconds even at 10 ms per operation: far less than a third of the lease's ttl)."""
    order = pages.lru_order()
    try:
        while live > target:
            batch, need = [], live - target
            for i in order:
                batch.append(i)
                need -= pages.size[i]
                if need <= 0 or len(batch) >= _EVICT_BATCH:
                    break
            if not batch:
                break  # every page tried
            if not lease.renew_if_due():
                rep.lease_lost = True
                log.warning("tierstore gc: lease lost to another node; stopping")
                break
            live -= victims.evict(batch, rep)
    finally:
        victims.close()
    return live


class GcDaemon:
    """Background mode: ``collect`` every ``interval_s`` in one daemon thread per process.

    A hung mount hangs only this thread (daemon: it never blocks shutdown); the lease makes
    nodes take turns.
    """

    _running: dict[str, GcDaemon] = {}
    _guard = threading.Lock()

    def __init__(self, root: str, max_bytes: int, interval_s: float, metrics: TierMetrics | None = None, **kw: object):
        self.root, self.max_bytes, self.interval_s, self.metrics, self.kw = root, max_bytes, interval_s, metrics, kw
        self.last: GcReport | None = None
        self.runs = 0
        self._unsafe_said: list[str] = []  # the entries last warned about: a standing one is said once
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"tierstore-gc:{root}", daemon=True)

    @classmethod
    def ensure(cls, root: str, max_bytes: int, interval_s: float, metrics: TierMetrics | None = None) -> GcDaemon:
        """The process's daemon for ``root``, started on first use."""
        with cls._guard:
            d = cls._running.get(root)
            if d is None or not d._thread.is_alive():
                d = cls._running[root] = cls(root, max_bytes, interval_s, metrics)
                d._thread.start()
            return d

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.last = rep = collect(self.root, self.max_bytes, metrics=self.metrics, **self.kw)  # type: ignore[arg-type]
                self.runs += 1
                if rep.refused or rep.lease_problem:  # collect leaves saying it to its caller
                    log.warning("tierstore background gc of %s: %s; nothing done, retrying in %.0f s", self.root,
                                rep.refused or rep.lease_problem, self.interval_s)
                if rep.unsafe and rep.unsafe != self._unsafe_said:
                    log.warning("tierstore background gc of %s: %d entries not followed, not touched (%s); "
                                "`tierstore fsck %s` lists them", self.root, len(rep.unsafe),
                                "; ".join(rep.unsafe[:3]) + ("; ..." if len(rep.unsafe) > 3 else ""), self.root)
                self._unsafe_said = rep.unsafe
            except Exception:  # a gc pass must never take the engine down
                log.exception("tierstore background gc of %s failed; retrying in %.0f s", self.root, self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        with GcDaemon._guard:
            if GcDaemon._running.get(self.root) is self:
                del GcDaemon._running[self.root]

