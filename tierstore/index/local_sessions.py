"""IndexHome: where a ``LocalIndex`` lives under its local root, and who is alive there.

Contract: ``<local_root>/.tierstore`` and its ``sessions`` directory are opened (created when
missing) through ``safefs``: a symlink or non-directory there is refused with ``ConfigError``,
never followed; so is an ``index.sqlite`` (or its ``-wal``/``-shm``) that is not a regular
file. ``check_unchanged`` re-checks, after sqlite opened the database by path, that ``.tierstore`` is
still the directory checked. Each open index holds an ``flock`` on its own session file
``sessions/<session>.lock`` until ``close`` or death; ``reap_dead_sessions`` takes the lock of
every other session file it can, so those sessions' processes are dead: their files are removed
and their ids returned (the index drops their reservations and reconciles). A file that is not a
regular file, or vanished, is left alone.

Threading: used by ``LocalIndex`` at open and close only (one thread); not thread-safe.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
from pathlib import Path

from tierstore.errors import ConfigError
from tierstore.fs import safefs

INDEX_DIR = ".tierstore"
INDEX_NAME = "index.sqlite"
SESSIONS_DIR = "sessions"


class IndexHome:
    """``<root>/.tierstore`` of one local index and its session lock (module docstring)."""

    def __init__(self, root: Path) -> None:
        """Open the directories and check the database files; ``fresh``: no database yet."""
        self.root = root
        self.dir = root / INDEX_DIR
        self.db_path = self.dir / INDEX_NAME
        self._meta_fd, self._sessions_fd = self._open_meta_dirs()
        self._session_fd = -1
        self.session = ""
        self.fresh = self._check_db_file()

    def _open_meta_dirs(self) -> tuple[int, int]:
        """Open (creating) ``.tierstore`` and ``.tierstore/sessions`` without following a link."""
        root_fd = safefs.open_root(self.root)
        try:
            meta_fd = safefs.open_dir_path(root_fd, (INDEX_DIR,), create=True)
        except safefs.UnsafeEntry as exc:
            raise ConfigError(
                f"{self.root / INDEX_DIR} is {'a symlink' if exc.reason == 'symlink' else 'not a directory'}: "
                "tierstore keeps its local index there and never follows a link (remove it, or set "
                '"local_root" to a directory only this service writes)') from None
        finally:
            os.close(root_fd)
        try:
            sessions_fd = safefs.open_dir_path(meta_fd, (SESSIONS_DIR,), create=True)
        except safefs.UnsafeEntry as exc:
            os.close(meta_fd)
            raise ConfigError(f"{self.root / INDEX_DIR / SESSIONS_DIR}: {exc}; remove it") from None
        except BaseException:
            os.close(meta_fd)
            raise
        return meta_fd, sessions_fd

    def _check_db_file(self) -> bool:
        """True when the database does not exist yet; ConfigError if something else is there."""
        fresh = True
        for name in (INDEX_NAME, INDEX_NAME + "-wal", INDEX_NAME + "-shm"):
            try:
                st = safefs.lstat_at(name, self._meta_fd)
            except FileNotFoundError:
                continue
            try:
                safefs.check_regular(st, name)
            except safefs.UnsafeEntry as exc:
                self.close_fds()
                raise ConfigError(f"{self.root / INDEX_DIR / name}: {exc}; tierstore never follows a link "
                                  "there: remove it") from None
            if name == INDEX_NAME:
                fresh = False
        return fresh

    def check_unchanged(self, db: sqlite3.Connection) -> None:
        """After sqlite opened the database by path: ConfigError (closing ``db`` and the
        directories) unless ``.tierstore`` is still the directory checked."""
        try:
            same = safefs.identity(os.stat(self.dir, follow_symlinks=False)) == safefs.identity(os.fstat(self._meta_fd))
        except OSError:
            same = False
        if not same:
            db.close()
            self.close_fds()
            raise ConfigError(f"{self.dir} was replaced while the local index was being opened; retry, "
                              "and check who else writes under local_root")

    def root_has_namespaces(self) -> bool:
        """Whether the root holds any directory besides ``.tierstore`` (pages to reconcile)."""
        try:
            with os.scandir(self.root) as it:
                return any(e.is_dir(follow_symlinks=False) and e.name != INDEX_DIR for e in it)
        except OSError:
            return False

    # ------------------------------------------------------------------ sessions
    def open_session(self, session: str) -> None:
        """Create and lock this process's session file (held until ``close`` or death)."""
        fd = os.open(f"{session}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=self._sessions_fd)
        fcntl.flock(fd, fcntl.LOCK_EX)  # held until close or death: liveness of this process's session
        self.session, self._session_fd = session, fd

    def reap_dead_sessions(self) -> list[str]:
        """Ids of the other sessions whose process died; their lock files are removed."""
        dead = []
        for name in os.listdir(self._sessions_fd):
            sid = name[:-len(".lock")]
            if not name.endswith(".lock") or sid == self.session:
                continue
            try:
                fd, _ = safefs.open_regular(name, self._sessions_fd)
            except OSError:
                continue  # vanished, or not a lock file we wrote: left alone
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue  # alive
            dead.append(sid)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=self._sessions_fd)
            os.close(fd)
        return dead

    def close(self) -> None:
        """Remove and unlock this process's session file, then close the directories."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{self.session}.lock", dir_fd=self._sessions_fd)
        os.close(self._session_fd)
        self.close_fds()

    def close_fds(self) -> None:
        for fd in (self._meta_fd, self._sessions_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
