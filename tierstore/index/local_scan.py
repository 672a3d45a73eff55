"""The reconciling scan of a local root: make a ``LocalIndex`` agree with the files on disk.

Contract (``Reconciler.run``): walk the root (``scan_pages``: iterative, ``safefs.walk``, never
deeper than the page layout, never following a link, never entering a hidden directory), then
drop the rows of vanished files, add unindexed pages and fix sizes, in transactions of at most
``_RECONCILE_CHUNK`` rows so stores reserve in between, and evict down to the cap. It never
indexes a file modified after the scan started (its writer commits it); a page modified less
than ``_SETTLE_S`` before is indexed only ``_SETTLE_S`` after the start, if its file still exists
and its writer has not committed it by then, so an eviction never deletes a page before its
writer's commit lands. Temp files of dead writers on this host are removed (``stale_temps``: the
one rule; temp names whose pid no process can have, or of a live writer, are left alone).
What the scan saw is returned as a ``ReconcileReport``.

The scan writes nothing to sqlite itself: it calls the index's row methods (``page_sizes``,
``drop_vanished``, ``index_found``, ``index_settled``, ``evict_now``), which own the SQL.

Threading: ``start`` runs the scan on one background thread (its failures are logged: the
accounting stays approximate until the next start); ``run`` scans in the caller's thread.
``stop`` makes a running scan return at its next check and joins the thread (30 s at most).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from tierstore.fs import safefs
from tierstore.fs.mapper import locate
from tierstore.fs.stale_temps import PID_LIMIT, temp_writer, writer_gone

log = logging.getLogger("tierstore.tiers.local_index")  # the index's log: what operators filter on

_RECONCILE_CHUNK = 2000  # rows per reconcile transaction: stores reserve in between
_PAGE_DEPTH = 4  # <namespace>/g<i>/r<j>/<aa>: the scan never descends deeper
# A page written this recently before a scan may still await its writer's commit: indexing it
# first could let an eviction delete it before that commit lands (a row for a deleted file).
# The scan indexes such pages only after this delay, if their writer has not.
_SETTLE_S = 5.0

Found = dict[str, tuple[int, int]]  # relative path -> (size, mtime ns)


class ScannedIndex(Protocol):
    """What the scan reads and changes of its ``local_index.LocalIndex`` (which owns it)."""

    root: Path
    path: Path | str

    def page_sizes(self) -> dict[str, int]: ...
    def drop_vanished(self, relpaths: list[str]) -> int: ...
    def index_found(self, found: list[tuple[str, tuple[int, int]]], known: dict[str, int]) -> tuple[int, int]: ...
    def index_settled(self, found: list[tuple[str, tuple[int, int]]]) -> int: ...
    def evict_now(self) -> None: ...


@dataclass
class ReconcileReport:
    scanned_files: int = 0
    added: int = 0
    dropped: int = 0
    resized: int = 0
    temps_removed: int = 0
    seconds: float = 0.0


class Reconciler:
    """The reconciling scan of one ``LocalIndex`` (module docstring)."""

    def __init__(self, index: ScannedIndex) -> None:
        self.index = index
        self.root: Path = index.root
        self.last: ReconcileReport | None = None  # the report of the scan ``start`` ran
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Scan on a background thread; ``last`` holds its report once it finished."""
        self._thread = threading.Thread(target=self._run_in_background, name=f"tierstore-reconcile:{self.root}",
                                        daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the background scan, if any; False on timeout."""
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.running

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def _run_in_background(self) -> None:
        try:
            self.last = self.run()
        except (sqlite3.Error, OSError) as exc:
            log.warning("tierstore local index %s: reconciling scan failed (%s); accounting stays "
                        "approximate until the next start", self.index.path, exc)

    def run(self) -> ReconcileReport:
        """Make the index agree with the files under the root (see the module docstring)."""
        t0 = time.monotonic()
        started = time.time()
        rep = ReconcileReport()
        found, recent = self._scan(rep, started)
        if self._stop.is_set():
            return rep
        rows = self.index.page_sizes()
        gone = [rel for rel in rows if rel not in found]
        for i in range(0, len(gone), _RECONCILE_CHUNK):
            rep.dropped += self.index.drop_vanished(gone[i:i + _RECONCILE_CHUNK])
        items = list(found.items())
        for i in range(0, len(items), _RECONCILE_CHUNK):
            if self._stop.is_set():
                return rep
            added, resized = self.index.index_found(items[i:i + _RECONCILE_CHUNK], rows)
            rep.added += added
            rep.resized += resized
        self.index.evict_now()
        if recent and not self._stop.wait(max(0.0, started + _SETTLE_S - time.time())):
            rep.added += self.index.index_settled(list(recent.items()))
            self.index.evict_now()
        rep.seconds = time.monotonic() - t0
        log.info("tierstore local index %s reconciled: %s", self.index.path, rep)
        return rep

    def _scan(self, rep: ReconcileReport, started: float) -> tuple[Found, Found]:
        """``scan_pages`` of the root, until ``stop``."""
        return scan_pages(self.root, rep, started, self._stop)


def scan_pages(root: Path, rep: ReconcileReport, started: float, stop: threading.Event) -> tuple[Found, Found]:
    """Pages under the root (relative path -> size, mtime ns), removing dead writers' temps;
    (settled pages, pages written less than ``_SETTLE_S`` before ``started``).

    Iterative and never following a link (``safefs.walk``); only directories at page depth
    hold pages; files modified after ``started`` belong to a live writer that commits them.
    """
    found: Found = {}
    recent: Found = {}
    root_fd = safefs.open_root(root)
    try:
        for listing in safefs.walk(root_fd, max_depth=_PAGE_DEPTH, descend=_descend):
            if stop.is_set():
                break
            if len(listing.parts) != _PAGE_DEPTH:
                continue
            base = "/".join(listing.parts)
            for name, st in listing.entries:
                if not stat.S_ISREG(st.st_mode):
                    continue
                rep.scanned_files += 1
                if name.endswith(".tmp"):
                    rep.temps_removed += remove_dead_temp(listing.fd, name, st)
                    continue
                rel = f"{base}/{name}"
                if st.st_nlink != 1 or st.st_mtime > started or locate(root, root / rel) is None:
                    continue
                (recent if st.st_mtime > started - _SETTLE_S else found)[rel] = (st.st_size, st.st_mtime_ns)
    finally:
        os.close(root_fd)
    return found, recent


def remove_dead_temp(dir_fd: int, name: str, st: os.stat_result) -> bool:
    """Remove a temp whose writer is provably gone (``stale_temps``: the one rule)."""
    writer = temp_writer(name)
    if writer is None or not 0 < writer.pid <= PID_LIMIT:
        return False  # not a name tierstore writes: left alone
    if not writer_gone(writer, st.st_mtime)[0]:
        return False  # a live process (maybe another rank) may still be writing it
    try:
        safefs.unlink_at(name, dir_fd, safefs.identity(st))
    except OSError:
        return False  # vanished, or replaced since the listing: nothing done
    return True


def _descend(parts: tuple[str, ...]) -> bool:
    """Enter page-layout directories only: never ``.tierstore`` or any hidden directory."""
    return not parts[-1].startswith(".")
