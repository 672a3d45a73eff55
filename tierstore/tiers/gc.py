"""Shared-tier garbage collection: keep a shared root under ``max_bytes`` with many nodes.

Contract (``tierstore gc ROOT --max-bytes N``, and ``GcDaemon`` in gc_daemon.py as the
background mode): one pass is ``collect``:

1. Take the lease (``lease.py``); if another node holds it, do nothing (report ``busy``). If
   the lease cannot be written because the export is full (ENOSPC, EDQUOT), first unlink a few
   least recently used pages without it (``_make_room``), then take it.
2. Sweep the trash dir ``ROOT/.tierstore-trash``: unlink entries older than ``trash_grace_s``
   (gc_scan.py).
3. Scan every namespace under ROOT (and the root's own probe and lease leftovers, gc_scan.py):
   pages (LRU stamp = mtime), temps (stale ones removed), tierstore's own metadata
   (``metadata_bytes``) and anything else (``other_bytes``, with a warning that names
   ``tierstore fsck``); both counted, never touched, not toward the cap: fsck owns them.
4. If the bytes found exceed ``max_bytes``, evict least-recently-stamped pages until the total
   is at most ``low_watermark * max_bytes`` (gc_evict.py: re-checked, renamed into the trash or,
   with grace 0, unlinked at once).
5. Renew the lease while working; stop evicting as soon as it is lost. Release it.

``dry_run`` changes nothing under ROOT (no lease file, no trash directory, no unlink or
rename) and reports what the real pass would do in the same fields: the pages and bytes it
would evict (the same LRU prefix), the stale temps and the trash entries it would remove.
The plan is the real pass's result when nothing is hit or removed in between.

A ROOT holding entries but no namespace directory is refused (``refused``), as fsck refuses
it: it is probably not a cache directory, and gc would otherwise write its lease and trash
there. So is a ROOT whose format marker (``ROOT/.tierstore-format``, ``mapper.unknown_format``)
names a format or layout this version does not know: a newer tierstore wrote it. A refusal
and a lease problem are returned in the report (``GcReport``, gc_report.py: ``refused``,
``lease_problem``) and logged at debug only: the caller says them once (the CLI as its error
line, ``GcDaemon`` as a warning).

Hostile roots (anything under ROOT is untrusted input): every directory is opened with
``O_NOFOLLOW`` relative to its parent's fd and every unlink/rename is an ``*at`` call on the fd
that was checked (safefs.py); what gc refuses to follow is reported in ``unsafe`` (said by the
caller: the CLI prints it, the daemon warns when it changes). The cap counts only bytes gc can
free: file bytes (``st_size``) of regular, single-link pages at their place, temps and trash
entries. A lease problem (a directory at the lease path) is reported in ``lease_problem``.

No sqlite and no lock on the shared root: everything is files, renames and stats.
Threading: ``collect`` is a plain function (it evicts on a private pool of ``evict_threads``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from tierstore.errors import SPACE_ERRNOS
from tierstore.fs import safefs
from tierstore.fs.deadline import note_space_freed
from tierstore.fs.display import escape
from tierstore.fs.lease import Lease, server_now
from tierstore.fs.mapper import (
    NAMESPACE_DIR_RE,
    RESERVED_PREFIX,
    SILLY_RENAME_PREFIXES,
    unknown_format,
)
from tierstore.metrics import TierMetrics
from tierstore.tiers.gc_evict import Victims, evict_down_to, plan_down_to
from tierstore.tiers.gc_report import GC_LOG, GcReport
from tierstore.tiers.gc_scan import open_trash, scan, sweep_trash

EVICT_THREADS = 8  # unlinks in flight (``--evict-threads``)
ROOM_FRACTION = 0.02  # of the page bytes, evicted without the lease when the export is full
# Called between the scan and the evictions (tests swap a directory for a symlink here).
_after_scan_hook: Callable[[], None] | None = None


def not_a_cache(root_fd: int) -> str | None:
    """Why the directory ``root_fd`` is not a cache root (entries, none a namespace directory),
    or None (a cache root, or empty: a cache not written yet)."""
    # tierstore's own entries (a down tier's probe files too) say nothing about what the root is
    # (a silly-renamed lease, read by one node while another replaced it, says nothing either)
    names = [name for name, _ in safefs.list_dir(root_fd)
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
        GC_LOG.debug("tierstore gc %s: refused: %s", root, rep.refused)
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
            GC_LOG.debug("tierstore gc %s: %s", root, lease.problem)
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
        GC_LOG.warning("tierstore gc %s: %d bytes are not pages gc can free (foreign, hard-linked or unexpected "
                       "files) and do not count toward the cap; `tierstore fsck %s` lists them", escape(root),
                       rep.other_bytes, escape(root))
    if metrics is not None and not dry_run:
        metrics.evicted(rep.evicted, rep.evicted_bytes)
        metrics.set_capacity(rep.total_after, max_bytes)
    if rep.evicted and not dry_run:
        note_space_freed(root)  # this process's tiers on the root stop skipping stores
    rep.seconds = time.monotonic() - t0
    return rep


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
            pages = scan(root_fd, temp_max_age_s, room, DryLease())  # type: ignore[arg-type]
            target = room.page_bytes - max(int(room.page_bytes * ROOM_FRACTION), 1)
            evict_down_to(pages, target, room.page_bytes, Victims(pages, root_fd, -1, 0.0, threads), DryLease(),
                          room)  # type: ignore[arg-type]
        finally:
            os.close(root_fd)
    except OSError as exc:
        GC_LOG.warning("tierstore gc %s: the export is full and making room failed: %s", escape(root), exc)
    rep.evicted, rep.evicted_bytes = room.evicted, room.evicted_bytes
    rep.room_evicted, rep.room_bytes = room.evicted, room.evicted_bytes
    rep.vanished, rep.temps_removed, rep.unsafe = room.vanished, room.temps_removed, room.unsafe
    if room.evicted:
        note_space_freed(root)
        GC_LOG.warning("tierstore gc %s: the export is full (%d bytes of pages found): %d least recently used pages "
                       "(%d bytes) unlinked without the gc lease to make room; if this repeats, max_bytes is above "
                       "what the export (or its quota) holds: lower --max-bytes", escape(root), room.page_bytes,
                       room.evicted, room.evicted_bytes)


def _collect_locked(root_fd: int, max_bytes: int, low_watermark: float, grace_s: float, temp_max_age_s: float,
                    lease: Lease, dry_run: bool, rep: GcReport, threads: int) -> None:
    trash_fd = open_trash(root_fd, rep)
    if trash_fd is None:
        return
    try:
        if trash_fd >= 0:
            sweep_trash(trash_fd, grace_s, rep, server_now(root_fd) if grace_s > 0 and not rep.dry_run else None)
        pages = scan(root_fd, temp_max_age_s, rep, lease)
        # Only what gc can free counts; evicted pages wait in the trash for the grace period and
        # are counted again by the next pass until they are unlinked.
        rep.total_before = rep.page_bytes + rep.temp_bytes + rep.trash_bytes
        live = rep.total_before - rep.trash_bytes
        if _after_scan_hook is not None:
            _after_scan_hook()
        if rep.total_before > max_bytes and dry_run:
            live = plan_down_to(pages, int(max_bytes * low_watermark), live, grace_s, rep)
        elif rep.total_before > max_bytes:
            victims = Victims(pages, root_fd, trash_fd, grace_s, threads)
            live = evict_down_to(pages, int(max_bytes * low_watermark), live, victims, lease, rep)
        rep.total_after = live + rep.trash_bytes
    finally:
        if trash_fd >= 0:
            os.close(trash_fd)
