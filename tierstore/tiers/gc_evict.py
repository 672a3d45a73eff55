"""A shared-root gc pass's eviction: the least recently stamped pages of a scan
(``gc_scan.ScanTable``) evicted until the live bytes reach a target (``evict_down_to``), or
counted as a dry run would evict them (``plan_down_to``: the same LRU prefix). The pass is
``tiers/gc.py``.

A victim is re-``stat``ed first (a page hit since the scan is skipped), then renamed into the
trash (the name vanishes atomically: new readers get a clean miss; a reader that already has it
open keeps reading the whole file, which it verifies), then unlinked after the grace period by
a later pass's trash sweep; with grace 0 it is unlinked at its place at once (the same
visibility as a rename followed by an unlink, one operation less). ENOENT/ESTALE mean another
evictor got there first. Eviction stops as soon as the lease is lost.

Scale (docs/measurements/fsck.md): victims are taken in LRU order, batch by batch (each batch
exactly the LRU prefix that reaches the target, so the set evicted is the same as one victim at
a time), and each batch is evicted directory by directory through one checked directory fd per
directory, ``threads`` directories at a time: per victim one ``lstat`` and one ``unlink`` (or
``rename``), never a directory walk from the root. The cost left is the file system's own
unlink: 0.1-1 ms per file on this machine's ext4, which is mounted ``-o discard`` (the freed
blocks are trimmed while the unlink waits), and a round trip on NFS; several in flight hide
most of it.

Hostile roots: every unlink/rename is an ``*at`` call on the directory fd that was checked
(opened with ``O_NOFOLLOW`` relative to the root's fd), after re-checking the victim's (device,
inode, mtime) (safefs.py): a directory swapped for a symlink since the scan, or a page replaced
since, is noted unsafe and never followed.
Threading: ``evict_down_to`` runs on the pass's thread and evicts on ``Victims``' private pool;
each ``_Evictor`` belongs to one pool thread.
"""

from __future__ import annotations

import os
import stat
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from itertools import islice

from tierstore.errors import GONE_ERRNOS
from tierstore.fs import safefs
from tierstore.fs.lease import Lease
from tierstore.fs.mapper import host_tag
from tierstore.index.eviction import victims_until
from tierstore.tiers.gc_report import GC_LOG, UNSAFE_LISTED, GcReport, note_unsafe
from tierstore.tiers.gc_scan import ScanTable

_EVICT_BATCH = 4096  # victims per batch evicted in directory order


def plan_down_to(pages: ScanTable, target: int, live: int, grace_s: float, rep: GcReport) -> int:
    """A dry run's eviction: the LRU prefix ``evict_down_to`` would evict, counted in ``rep``
    (with a grace period, its bytes as the trash's); the live bytes after."""
    for i in victims_until(pages.lru_order(), pages.size, live, target):
        rep.evicted += 1
        rep.evicted_bytes += pages.size[i]
        rep.trash_bytes += pages.size[i] if grace_s > 0 else 0
        live -= pages.size[i]
    return live


class _Evictor:
    """Evicts victims given in directory order through one checked fd per directory.
    Threading: one thread; ``close`` releases the fd."""

    def __init__(self, pages: ScanTable, root_fd: int, trash_fd: int, grace_s: float, rep: GcReport) -> None:
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
            note_unsafe(self.rep, "/".join(parts), f"{exc.reason} since the scan")
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
            note_unsafe(rep, "/".join((*pages.dirs[pages.dir_of[i]], name)), "replaced since the scan")
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


class Victims:
    """Evicts a batch: its directories spread over ``threads`` threads, each directory's victims
    by one ``_Evictor`` (its own fd and report), merged into the pass's report on the caller's
    thread. Unlinks wait on the file system (an online discard on ext4 ``-o discard``, a round
    trip on NFS), so several in flight pay even on 2 cores. Threading: one caller thread."""

    def __init__(self, pages: ScanTable, root_fd: int, trash_fd: int, grace_s: float, threads: int) -> None:
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
            rep.unsafe.extend(part.unsafe[:max(0, UNSAFE_LISTED - len(rep.unsafe))])
        return freed


def evict_down_to(pages: ScanTable, target: int, live: int, victims: Victims, lease: Lease, rep: GcReport) -> int:
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
            batch = list(islice(victims_until(order, pages.size, live, target), _EVICT_BATCH))
            if not batch:
                break  # every page tried
            if not lease.renew_if_due():
                rep.lease_lost = True
                GC_LOG.warning("tierstore gc: lease lost to another node; stopping")
                break
            live -= victims.evict(batch, rep)
    finally:
        victims.close()
    return live
