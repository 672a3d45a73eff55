"""Crash-safe accounting and LRU eviction for the local disk tier.

Contract: one sqlite database in WAL mode at ``<local_root>/.tierstore/index.sqlite`` (LOCAL
disk only: sqlite's locking is not trusted on NFS, and ``LocalIndex`` refuses nothing but
is never pointed at the shared root by tierstore). It records every page file under the
root (path relative to the root, file size, LRU stamp) and the bytes reserved by stores in
flight. A store first ``reserve()``s its upper-bound size: in the same transaction the least
recently used pages are removed from the index until ``used + reserved + size <= cap``, and
their files are unlinked before the store writes anything. So the bytes on disk never exceed
the cap by more than the slack of one page whose size was under-estimated or a page that a
crashed process published but could not index.

Several processes (TP ranks, KV-cache groups) may share one local root: all changes run in
``BEGIN IMMEDIATE`` transactions, and ``used`` is kept by triggers in the same transactions.

Crash safety: WAL with ``synchronous=NORMAL`` survives SIGKILL of any process (an app crash
loses no committed transaction; a power loss may lose the last ones). Each open index holds
an ``flock`` on its own session file; at start, a session file whose lock can be taken
belongs to a dead process: its reservations are dropped and a reconciling scan of the root
runs (bounded by the cap: the root only ever holds what the cap allows). The scan adds
unindexed pages, drops rows of vanished files, fixes sizes, and removes temp files of dead
writers on this host. A fresh index over a non-empty root is reconciled the same way.

The reconciling scan runs on a background thread (``reconcile=None``, the default), so opening
the index -- and the local tier -- does not wait for the page count (about 24 s at 10^6
pages). Until it finishes (``wait_reconciled``, ``reconciling``) the index is correct but
approximate: ``used_bytes`` leaves out pages it has not indexed yet, so the disk may exceed
the cap by up to their bytes, and eviction chooses only among indexed pages (an unindexed page
is never evicted before the scan reaches it). The scan applies its changes in small
transactions, so stores reserve between them; it never indexes a file modified after it
started (its writer commits it), indexes one modified shortly before only ``local_scan._SETTLE_S`` later
if its writer has not committed it by then and never touches a temp of a live writer, so a page being
written is never evicted by it. ``reconcile=True`` scans in the caller's thread.

Untrusted root: ``.tierstore`` and its ``sessions`` directory are opened through ``safefs``
(a symlink there is refused with ``ConfigError``, never followed; a planted ``index.sqlite``
that is not a regular file too); the scan is iterative (``safefs.walk``, never deeper than
the page layout), never follows a link, and skips temp names whose pid no process can have.

Bookkeeping after the write (commit, touch on hit, forget, release) can be ``defer``red to one
background thread per index that applies each batch in a single transaction; only ``reserve``
(which must evict before the write) runs in the caller's thread.

Parts: ``local_sessions.IndexHome`` (the ``.tierstore`` directory and the session lock files),
``local_scan.Reconciler`` (the reconciling scan; it changes rows only through this class's
``page_sizes``/``drop_vanished``/``index_found``/``index_settled``/``evict_now``). This class
owns the sqlite database: reservations, commit, touch, forget, eviction, deferred bookkeeping.

Threading: one ``LocalIndex`` may be used from several threads (one connection, one lock).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tierstore.fs import safefs
from tierstore.index.eviction import SQL_ORDER, victims_until
from tierstore.index.local_scan import Reconciler, ReconcileReport
from tierstore.index.local_sessions import INDEX_DIR, INDEX_NAME, SESSIONS_DIR, IndexHome

__all__ = ["INDEX_DIR", "INDEX_NAME", "SESSIONS_DIR", "Evicted", "LocalIndex", "ReconcileReport"]

log = logging.getLogger(__name__)

_EVICT_BATCH = 32

_SCHEMA = """
CREATE TABLE IF NOT EXISTS pages(path TEXT PRIMARY KEY, size INTEGER NOT NULL, stamp INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS pages_by_stamp ON pages(stamp);
CREATE TABLE IF NOT EXISTS totals(id INTEGER PRIMARY KEY CHECK (id = 0), used INTEGER NOT NULL);
INSERT OR IGNORE INTO totals VALUES (0, 0);
CREATE TABLE IF NOT EXISTS reservations(
    id INTEGER PRIMARY KEY AUTOINCREMENT, session TEXT NOT NULL, bytes INTEGER NOT NULL);
CREATE TRIGGER IF NOT EXISTS pages_ins AFTER INSERT ON pages
    BEGIN UPDATE totals SET used = used + new.size WHERE id = 0; END;
CREATE TRIGGER IF NOT EXISTS pages_del AFTER DELETE ON pages
    BEGIN UPDATE totals SET used = used - old.size WHERE id = 0; END;
CREATE TRIGGER IF NOT EXISTS pages_upd AFTER UPDATE OF size ON pages
    BEGIN UPDATE totals SET used = used - old.size + new.size WHERE id = 0; END;
"""


@dataclass(frozen=True)
class Evicted:
    path: str  # relative to the root
    size: int


class LocalIndex:
    """Accounting + LRU eviction of one local root (see the module docstring)."""

    def __init__(self, root: str | os.PathLike[str], cap_bytes: int | None, *, reconcile: bool | None = None):
        """``reconcile``: None scans in the background when needed (a dead session, or a fresh
        index over a non-empty root); True scans now, in this thread; False never."""
        self.root = Path(root)
        self.cap_bytes = cap_bytes
        self.root.mkdir(parents=True, exist_ok=True)  # the root itself: the operator's path
        self._home = IndexHome(self.root)
        self.path = self._home.db_path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
        self._home.check_unchanged(self._db)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)  # idempotent DDL; executescript commits by itself
        self.on_evict: Callable[[list[Evicted]], None] | None = None  # called by the bookkeeping thread
        self.errors = 0  # deferred batches lost to sqlite errors
        self._qcv = threading.Condition(threading.Lock())
        self._queue: deque[tuple[str, tuple, int]] = deque()
        self._queued = self._applied = 0
        self._stopping = False
        self._keeper: threading.Thread | None = None
        self.session = uuid.uuid4().hex
        self._home.open_session(self.session)
        dead = self._drop_dead_sessions()
        self._reconciler = Reconciler(self)
        if reconcile is None:
            if dead > 0 or (self._home.fresh and self._home.root_has_namespaces()):
                self._reconciler.start()
        elif reconcile:
            self._reconciler.last = self.reconcile()

    def _drop_dead_sessions(self) -> int:
        """Drop reservations of sessions whose process died; returns how many died."""
        dead = self._home.reap_dead_sessions()
        if dead:
            with self._txn():
                self._db.executemany("DELETE FROM reservations WHERE session = ?", [(s,) for s in dead])
            log.warning("tierstore local index %s: %d session(s) ended without closing; reconciling", self.path, len(dead))
        return len(dead)

    # ------------------------------------------------------------------ helpers
    @contextlib.contextmanager
    def _txn(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _totals(self) -> tuple[int, int]:
        used = self._db.execute("SELECT used FROM totals WHERE id = 0").fetchone()[0]
        reserved = self._db.execute("SELECT COALESCE(SUM(bytes), 0) FROM reservations").fetchone()[0]
        return int(used), int(reserved)

    def _evict_locked(self, need: int, keep: str = "") -> list[Evicted]:
        """Remove LRU rows until ``used + reserved + need <= cap``; caller holds a txn."""
        if self.cap_bytes is None:
            return []
        used, reserved = self._totals()
        victims: list[Evicted] = []
        while used + reserved + need > self.cap_bytes:
            rows = self._db.execute(
                f"SELECT path, size FROM pages WHERE path != ? {SQL_ORDER} LIMIT ?", (keep, _EVICT_BATCH)
            ).fetchall()
            if not rows:
                break
            sizes = [int(size) for _, size in rows]
            for j in victims_until(range(len(rows)), sizes, used + reserved + need, self.cap_bytes):
                self._db.execute("DELETE FROM pages WHERE path = ?", (rows[j][0],))
                victims.append(Evicted(rows[j][0], sizes[j]))
                used -= sizes[j]
        return victims

    def _record_locked(self, reservation: int | None, relpath: str, size: int, stamp: int) -> None:
        """Record a published page and drop its reservation; caller holds a txn."""
        if reservation is not None:
            self._db.execute("DELETE FROM reservations WHERE id = ?", (reservation,))
        self._db.execute("INSERT INTO pages(path, size, stamp) VALUES (?, ?, ?) "
                         "ON CONFLICT(path) DO UPDATE SET size = excluded.size, stamp = excluded.stamp",
                         (relpath, size, stamp))

    def _unlink(self, victims: list[Evicted]) -> None:
        safefs.unlink_under(self.root, [v.path for v in victims])

    # ------------------------------------------------------------------ API
    def reserve(self, nbytes: int) -> tuple[int | None, list[Evicted]]:
        """Make room for ``nbytes`` and reserve them; evicted files are already unlinked.

        Returns ``(None, [])`` when the page is larger than the whole cap.
        """
        if self.cap_bytes is not None and nbytes > self.cap_bytes:
            return None, []
        with self._txn() as db:
            victims = self._evict_locked(nbytes)
            cur = db.execute("INSERT INTO reservations(session, bytes) VALUES (?, ?)", (self.session, nbytes))
            rid = int(cur.lastrowid)  # type: ignore[arg-type]
        self._unlink(victims)
        return rid, victims

    # ------------------------------------------------------------------ deferred bookkeeping
    def defer(self, op: str, *args: object) -> None:
        """Queue ``commit`` / ``touch`` / ``forget`` / ``release`` for the bookkeeping thread.

        The thread applies everything queued in one transaction (a few hundred microseconds
        for a whole batch instead of per page, off the caller's thread). Until a commit is
        applied its reservation still counts, so accounting only errs on the safe side; a
        crash loses queued entries and the next start's reconciling scan restores them.
        """
        if op not in ("commit", "touch", "forget", "release"):
            raise ValueError(f"cannot defer {op!r}")
        with self._qcv:
            self._queue.append((op, args, time.time_ns()))
            self._queued += 1
            if self._keeper is None:
                self._keeper = threading.Thread(target=self._bookkeeper, name=f"tierstore-index:{self.root}", daemon=True)
                self._keeper.start()
            self._qcv.notify_all()

    def sync(self, timeout: float | None = None) -> bool:
        """Wait until every deferred change is applied; False on timeout."""
        with self._qcv:
            return self._qcv.wait_for(lambda: self._applied >= self._queued, timeout)

    def _bookkeeper(self) -> None:
        while True:
            with self._qcv:
                self._qcv.wait_for(lambda: self._queue or self._stopping)
                if not self._queue:
                    return
                batch = list(self._queue)
                self._queue.clear()
            victims: list[Evicted] = []
            try:
                victims = self._apply(batch)
            except sqlite3.Error as exc:
                self.errors += 1
                log.warning("tierstore local index %s: %d deferred updates lost (%s); the next "
                            "reconciling scan repairs the accounting", self.path, len(batch), exc)
            self._unlink(victims)
            if victims and self.on_evict is not None:
                self.on_evict(victims)
            with self._qcv:
                self._applied += len(batch)
                self._qcv.notify_all()

    def _apply(self, batch: list[tuple[str, tuple, int]]) -> list[Evicted]:
        with self._txn() as db:
            for op, args, stamp in batch:
                if op == "commit":
                    self._record_locked(*args, stamp)
                elif op == "touch":
                    db.execute("UPDATE pages SET stamp = ? WHERE path = ?", (stamp, args[0]))
                elif op == "forget":
                    db.execute("DELETE FROM pages WHERE path = ?", (args[0],))
                elif op == "release" and args[0] is not None:
                    db.execute("DELETE FROM reservations WHERE id = ?", (args[0],))
            return self._evict_locked(0)

    def release(self, reservation: int | None) -> None:
        if reservation is None:
            return
        with self._txn() as db:
            db.execute("DELETE FROM reservations WHERE id = ?", (reservation,))

    def commit(self, reservation: int | None, relpath: str, size: int) -> list[Evicted]:
        """Record a published page (and drop its reservation); evicts if still over the cap."""
        with self._txn():
            self._record_locked(reservation, relpath, size, time.time_ns())
            victims = self._evict_locked(0, keep=relpath)  # never evict the page just written
        self._unlink(victims)
        return victims

    def touch(self, relpath: str) -> bool:
        """Mark a page as just used; False if the index does not know it."""
        with self._txn() as db:
            cur = db.execute("UPDATE pages SET stamp = ? WHERE path = ?", (time.time_ns(), relpath))
            return cur.rowcount > 0

    def forget(self, relpath: str) -> None:
        """Drop a page whose file vanished or is broken (the caller removes the file)."""
        with self._txn() as db:
            db.execute("DELETE FROM pages WHERE path = ?", (relpath,))

    def contains(self, relpath: str) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM pages WHERE path = ?", (relpath,)).fetchone() is not None

    def used_bytes(self) -> int:
        """Bytes of indexed pages plus bytes reserved by stores in flight."""
        with self._lock:
            used, reserved = self._totals()
        return used + reserved

    def page_bytes(self) -> int:
        with self._lock:
            return self._totals()[0]

    def lru_order(self, limit: int | None = None) -> list[str]:
        """Relative paths, least recently used first (for tests and ``tierstore stats``)."""
        with self._lock:
            q = f"SELECT path FROM pages {SQL_ORDER}"
            rows = self._db.execute(q + (" LIMIT ?" if limit else ""), (limit,) if limit else ()).fetchall()
        return [r[0] for r in rows]

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM pages").fetchone()[0])

    # ------------------------------------------------------------------ reconcile (local_scan)
    @property
    def last_reconcile(self) -> ReconcileReport | None:
        """The report of the scan run at open (background or ``reconcile=True``), once finished."""
        return self._reconciler.last

    @property
    def reconciling(self) -> bool:
        """Whether a background reconciling scan is still running (figures approximate)."""
        return self._reconciler.running

    def wait_reconciled(self, timeout: float | None = None) -> bool:
        """Wait for the background reconciling scan, if any; False on timeout."""
        return self._reconciler.wait(timeout)

    def reconcile(self) -> ReconcileReport:
        """Make the index agree with the files under the root, in this thread (``local_scan``)."""
        return self._reconciler.run()

    def page_sizes(self) -> dict[str, int]:
        """Every indexed page: relative path -> size."""
        with self._lock:
            return dict(self._db.execute("SELECT path, size FROM pages").fetchall())

    def drop_vanished(self, relpaths: list[str]) -> int:
        """Drop the rows of ``relpaths`` whose file is gone (checked inside the transaction, so
        a writer's commit cannot slip in between); how many were dropped."""
        dropped = 0
        with self._txn() as db:
            for rel in relpaths:
                if not os.path.lexists(self.root / rel):
                    dropped += db.execute("DELETE FROM pages WHERE path = ?", (rel,)).rowcount
        return dropped

    def index_found(self, found: list[tuple[str, tuple[int, int]]], known: dict[str, int]) -> tuple[int, int]:
        """Add the scanned pages ``known`` lacks (stamped with their mtime) and fix the sizes that
        differ; (added, resized)."""
        added = resized = 0
        with self._txn() as db:
            for rel, (size, mtime) in found:
                if rel not in known:
                    added += db.execute("INSERT OR IGNORE INTO pages(path, size, stamp) VALUES (?, ?, ?)",
                                        (rel, size, mtime)).rowcount
                elif known[rel] != size:
                    db.execute("UPDATE pages SET size = ? WHERE path = ?", (size, rel))
                    resized += 1
        return added, resized

    def index_settled(self, found: list[tuple[str, tuple[int, int]]]) -> int:
        """Add the scanned pages whose file still exists and that no writer indexed; how many."""
        added = 0
        with self._txn() as db:
            for rel, (size, mtime) in found:
                if os.path.lexists(self.root / rel):
                    added += db.execute("INSERT OR IGNORE INTO pages(path, size, stamp) VALUES (?, ?, ?)",
                                        (rel, size, mtime)).rowcount
        return added

    def evict_now(self) -> None:
        """Evict down to the cap now (unlinking, and telling ``on_evict``)."""
        with self._txn():
            victims = self._evict_locked(0)
        self._unlink(victims)
        if victims and self.on_evict is not None:
            self.on_evict(victims)

    def close(self) -> None:
        self._reconciler.stop()
        with self._qcv:
            self._stopping = True
            self._qcv.notify_all()
        if self._keeper is not None:
            self._keeper.join(30)
        with self._lock:
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("DELETE FROM reservations WHERE session = ?", (self.session,))
            self._db.close()
        self._home.close()
