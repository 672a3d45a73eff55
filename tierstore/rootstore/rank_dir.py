"""RankDir: the held directory of one (namespace, group, rank), and the removal of a damaged
page file in it.

A root others can write to (issue 17): ``RankDir`` reaches a fan-out directory through
directory fds opened without following links (safefs.py), and callers act relative to them
(``dir_fd``), so a directory swapped for a symlink never redirects a write or an unlink
outside the root. The held fd is reopened when the directory was removed or replaced by
another node (NFS gives no notice): the class docstring says when, and how often.
``remove_damaged`` / ``remove_damaged_at`` remove a bad page once, only if it is still the
regular, single-link file that was read (``file_identity``).

Failure policy: each function's docstring. The only log line is ``RankDir``'s reopen of a
removed or replaced directory (a condition an operator should know about).

Threading: ``RankDir`` is safe from any thread (its docstring); the functions are reentrant
and use only their own file descriptors.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Callable

from tierstore.errors import PageError, PageIOError, PageMissing, PageUnsafe
from tierstore.fs import safefs
from tierstore.rootstore.page_io import CLOEXEC

__all__ = [
    "RANK_DIR_CHECK_S", "RANK_DIR_REOPEN_MIN_S", "FileIdentity", "RankDir", "directory_error", "file_identity",
    "remove_damaged", "remove_damaged_at",
]

logger = logging.getLogger("tierstore.pagefile")
FileIdentity = tuple[int, int, int]  # (st_dev, st_ino, st_ctime_ns): one file, not one name

# How often the held rank directory fd is checked against its path (a directory removed and made
# again, or replaced, by another node: NFS gives no notice), and the least time between two
# reopens of a stale fd (a flapping export never turns every call into a reopen).
RANK_DIR_CHECK_S = 2.0
RANK_DIR_REOPEN_MIN_S = 1.0


class RankDir:
    """The directory of one (namespace, group, rank): an fd opened from the root component by
    component without following a symlink (safefs.open_dir_path), and its fan-out directories
    opened per operation relative to it (``fanout``), so no name under the root is ever
    followed out of it. A symlinked component raises ``PageUnsafe``.

    The fd is opened at first use and reopened when it has gone stale: ESTALE (NFS: the
    directory was removed, e.g. ``rm -rf ROOT/<namespace>`` by an operator, and maybe made
    again by another node), ENOENT in a directory with ``st_nlink`` 0 (the same on a local file
    system), or, checked at most every ``RANK_DIR_CHECK_S`` on a call of ``rank_fd``, a path
    that now names another directory (st_dev/st_ino differ: replaced). A stale fd is reopened at
    most once per ``RANK_DIR_REOPEN_MIN_S`` (a store's, which may create it, also right after a
    load's found it gone); the call that found it retries once on the new fd,
    and where the reopen is not allowed yet (or fails) it is answered ``PageMissing``; the next
    call uses the new fd. ``reopens`` counts reopens (``on_reopen`` is called after each, with
    no lock held). Superseded fds stay open until ``close`` (another thread, or the native
    lane, may be using one). ``held_fd`` answers -1 while a check is due, so fd users that must
    not touch the file system (the lane, under the queue's lock) leave the job to a thread that
    calls ``fanout``/``rank_fd`` and runs the check. Threading: safe from any thread.
    """

    def __init__(self, root: str | os.PathLike[str], parts: tuple[str, ...], perms: safefs.Perms = safefs.PRIVATE,
                 on_reopen: Callable[[], None] | None = None):
        self.root, self.parts, self.perms = os.fspath(root), parts, perms
        self._fd = -1
        self._old: list[int] = []
        self._lock = threading.Lock()  # held across the (re)open's file-system calls
        self._closed = False
        self._on_reopen = on_reopen
        self._next_check = 0.0  # monotonic time of the next identity check of the held fd
        self._reopened_at = -RANK_DIR_REOPEN_MIN_S  # monotonic time of the last reopen of a stale fd
        self._gone_seen = False  # the last reopen, not creating, found the directory gone
        self.reopens = 0

    def _reopen(self, create: bool, stale: int) -> int:
        with self._lock:
            if self._fd != stale:
                return self._fd  # another thread reopened it meanwhile
            root_fd = safefs.open_root(self.root)
            try:
                fd = safefs.open_dir_path(root_fd, self.parts, create=create, perms=self.perms)
            finally:
                os.close(root_fd)
            if self._closed:  # closed while this open hung in the file system (``close``)
                os.close(fd)
                raise OSError(errno.EBADF, f"{os.path.join(self.root, *self.parts)}: closed while opening")
            if self._fd >= 0:
                self._old.append(self._fd)
            self._fd = fd
            self._next_check = time.monotonic() + RANK_DIR_CHECK_S
            return fd

    def _reopen_stale(self, create: bool, stale: int) -> int:
        """Reopen the stale fd ``stale`` (module rule: at most once per ``RANK_DIR_REOPEN_MIN_S``):
        the fd to use, or -1 when not allowed yet. Raises what ``_reopen`` raises."""
        with self._lock:
            if self._fd != stale:
                return self._fd
            now = time.monotonic()
            # A creating reopen (a store) is not held back by a look that found the directory
            # gone and could not make it (a load): else an engine that loads the rank every
            # second never recreates a namespace removed under it (found on CephFS and ext4).
            if now - self._reopened_at < RANK_DIR_REOPEN_MIN_S and not (create and self._gone_seen):
                return -1
            self._reopened_at = now
        try:
            fd = self._reopen(create, stale)
        except FileNotFoundError:
            self._gone_seen = not create
            raise
        self._gone_seen = False
        if fd != stale:
            self.reopens += 1
            logger.warning("tierstore: the directory %s was removed or replaced (stale handle); reopened it",
                           os.path.join(self.root, *self.parts))
            if self._on_reopen is not None:
                self._on_reopen()
        return fd

    def _replaced(self, fd: int) -> bool:
        """Whether the held ``fd`` no longer is the directory its path names (removed, stale or
        replaced). A path that cannot be checked counts as not replaced."""
        try:
            held = os.fstat(fd)
        except OSError as exc:
            return exc.errno == errno.ESTALE
        if held.st_nlink == 0:
            return True
        try:
            now = os.lstat(os.path.join(self.root, *self.parts))
        except OSError:
            return False  # nothing newer to open (or the path is unreadable: the calls say why)
        return (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)

    def rank_fd(self, create: bool = False) -> int:
        """The held fd of the rank directory (do not close it); checks it against its path at
        most every ``RANK_DIR_CHECK_S`` (class docstring). Raises ``PageMissing`` when it is
        stale and may not be reopened yet; OSError from opening."""
        fd = self._fd
        if fd < 0:
            return self._reopen(create, fd)
        if time.monotonic() >= self._next_check:
            self._next_check = time.monotonic() + RANK_DIR_CHECK_S
            if self._replaced(fd):
                fd = self._reopen_stale(create, fd)
                if fd < 0:
                    raise PageMissing("the page's directory was removed or replaced (stale handle); it is "
                                      "reopened within a second", path=os.path.join(self.root, *self.parts),
                                      errno=errno.ESTALE)
        return fd

    def held_fd(self) -> int:
        """The held fd of the rank directory, or -1 when it is not open yet or a check of it is
        due; never touches the file system (callers that hold a lock must not wait on it)."""
        return self._fd if time.monotonic() < self._next_check else -1

    def _is_stale(self, fd: int, exc: OSError) -> bool:
        """Whether ``exc``, raised by a call relative to ``fd``, says ``fd`` itself is stale."""
        if exc.errno == errno.ESTALE:
            return True
        if exc.errno != errno.ENOENT:
            return False
        try:
            return os.fstat(fd).st_nlink == 0  # the rank directory itself was removed
        except OSError as err:
            return err.errno == errno.ESTALE

    def _open_fanout(self, name: str, fd: int, create: bool) -> int:
        try:
            return safefs.open_dir(name, fd)
        except FileNotFoundError:
            if not create:
                raise
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, self.perms.dir_mode, dir_fd=fd)
            if self.perms.dir_mode & 0o070:
                os.chmod(name, self.perms.dir_mode, dir_fd=fd, follow_symlinks=False)
        return safefs.open_dir(name, fd)

    def fanout(self, name: str, *, create: bool = False, where: str = "", key: bytes | None = None) -> int:
        """An fd of the fan-out directory ``name`` (the caller closes it); ``create``: make it
        (and the chain above it) when missing. A stale rank directory fd is reopened (class
        docstring) and the call retried once. Raises ``PageUnsafe`` for a symlinked or
        non-directory component, ``PageMissing`` when absent and not ``create`` or when the
        stale fd may not be reopened yet; another OSError (permission denied, I/O) is raised as
        it is with ``create`` (the store names it), else as ``PageIOError`` naming the
        directory and the fix (``directory_error``)."""
        try:
            fd = self.rank_fd(create)
            try:
                return self._open_fanout(name, fd, create)
            except OSError as exc:
                if not self._is_stale(fd, exc):
                    raise
            fd = self._reopen_stale(create, fd)
            if fd < 0:
                raise PageMissing("the page's directory was removed or replaced (stale handle); it is reopened "
                                  "within a second", path=where, key=key, errno=errno.ESTALE)
            return self._open_fanout(name, fd, create)
        except safefs.UnsafeEntry as exc:
            raise PageUnsafe(f"a directory on the way to the page is not one tierstore made ({exc}); "
                             "nothing under it is read or written", path=where, key=key) from None
        except FileNotFoundError as exc:
            raise PageMissing("no such page (its directory is missing)", path=where, key=key) from exc
        except OSError as exc:
            if exc.errno == errno.ESTALE:
                raise PageMissing("the page's directory went stale again right after it was reopened",
                                  path=where, key=key, errno=errno.ESTALE) from exc
            if create:
                raise  # the store names it (PageStoreError, its kind from the errno)
            raise PageIOError(directory_error(exc, where), errno=exc.errno, path=where, key=key) from exc

    def remove_damaged(self, fanout_name: str, name: str, served: FileIdentity, *, where: str = "",
                       key: bytes | None = None) -> bool:
        """``remove_damaged_at`` of ``fanout_name/name`` through this directory's fds (no symlink
        followed); True if removed. Never raises: a fan-out directory that is gone or not ours
        leaves everything untouched (False)."""
        try:
            dir_fd = self.fanout(fanout_name, where=where, key=key)
        except (PageError, OSError):
            return False
        try:
            return remove_damaged_at(dir_fd, name, served)
        finally:
            os.close(dir_fd)

    def close(self, timeout: float | None = None) -> bool:
        """Close the held fds; False if an open hung in the file system (a hard mount whose
        server is gone) held the directory past ``timeout`` (None: wait): that open closes what
        it opens when it returns, so a shutdown never waits on the server."""
        self._closed = True
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            return False
        try:
            for fd in (*self._old, self._fd):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._fd, self._old = -1, []
        finally:
            self._lock.release()
        return True


def directory_error(exc: OSError, where: str) -> str:
    """What to tell an operator about a directory on the way to the page ``where`` that could
    not be opened (permission denied, an I/O error): which directory, and what to do."""
    directory = os.path.dirname(where) if where else "the page's directory"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (f"cannot open the directory {directory}: {exc.strerror}; give the user running tierstore read "
                "and execute permission on it (the whole path under the root), or run `tierstore fsck ROOT`")
    return f"cannot open the directory {directory}: {exc.strerror}; check the file system (`tierstore fsck ROOT`)"


def file_identity(st: os.stat_result) -> FileIdentity:
    """What tells one file from another published later under the same name."""
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


def remove_damaged(path: str, served: FileIdentity | None) -> bool:
    """Remove the page file at ``path`` if it is still the file that was read (``served``);
    True if removed. A different file under the name (republished since) is left alone.
    Path-based (the directories are followed); the engine uses ``remove_damaged_at``.

    Failure policy: never raises; a file that is gone or cannot be removed is left (False).
    """
    try:
        dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | CLOEXEC)
    except OSError:
        return False
    try:
        return remove_damaged_at(dir_fd, os.path.basename(path), served)
    finally:
        os.close(dir_fd)


def remove_damaged_at(dir_fd: int, name: str, served: FileIdentity | None) -> bool:
    """Unlink ``name`` in the checked directory ``dir_fd`` if it is a regular file with one
    link and still the file that was read (``served``: device, inode and ctime compared on an
    ``lstat`` relative to ``dir_fd``); True if removed.

    Failure policy: never raises. Races an unlink by another process only in the window
    between the lstat and the unlink, and only within ``dir_fd``.
    """
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            return False
        if served is not None and file_identity(st) != served:
            return False
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        return False
    return True
