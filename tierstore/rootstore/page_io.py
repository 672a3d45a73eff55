"""Page-file I/O: the steps every reader and writer of one page file shares.

Every store (the ``IOEngine`` of any tier, fsck, the test and demo writers) opens, reads and
writes page files through these functions; each one's failure policy is in its docstring.
Shared rules:

- Failures are typed ``PageError``s (errors.py), never partial data. An ``OSError`` of a read
  is mapped by ``read_error``: ENOENT, ESTALE (an NFS file deleted under us) and ENOTDIR mean
  ``PageMissing``, anything else ``PageIOError`` with the errno.
- A root others can write to (issue 17): page files are opened ``O_NOFOLLOW|O_NONBLOCK``
  (``READ_FLAGS``; the native kernels open with the same flags, ``NATIVE_OPEN_FLAGS``) and
  served only if ``fstat`` says regular file with one link (``open_page``; else ``PageUnsafe``,
  never removed: a FIFO fails at once instead of blocking an I/O thread). A file with exactly
  two links is looked at again a few times over ``LINK_WINDOW_S`` first (``past_link_window``):
  it may be a page another writer is publishing with ``link(2)`` (``publish.place``'s fallback
  where ``renameat2`` has no ``RENAME_NOREPLACE``), between the link and the unlink of its temp.
  Only the stat is retried; a file still linked twice is refused as before (kind ``unsafe``: a
  miss, never removed). On NFS another client's window can outlast the retries (attributes
  cached up to ``acregmin``): that load is one miss.
- Functions do not log.

Operations: ``open_page`` (the checked open of a page file), ``past_link_window`` (a second
look at a twice-linked file), ``read_error`` (the typed error
of a failed read step), ``pwritev_all`` / ``preadv_upto`` / ``readinto_exact`` (vectored I/O
that retries short calls).

Threading: every function is reentrant and uses only its own file descriptors; buffers
passed in belong to the calling thread for the call's duration.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierstore.errors import (
    GONE_ERRNOS,
    PageError,
    PageIOError,
    PageMissing,
    PageTruncated,
    PageUnsafe,
)
from tierstore.fs import safefs

__all__ = [
    "CLOEXEC", "LINK_WINDOW_S", "NATIVE_OPEN_FLAGS", "READ_FLAGS", "open_page", "past_link_window", "preadv_upto",
    "pwritev_all", "read_error", "readinto_exact",
]

CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# O_NONBLOCK: a FIFO under a page's name opens at once (and is then refused by fstat) instead
# of blocking an I/O thread; on a regular file it changes nothing.
READ_FLAGS = safefs.FILE_FLAGS
# (directory, page) flags of the native kernels' opens: the same as the Python path's.
NATIVE_OPEN_FLAGS = (safefs.DIR_FLAGS, READ_FLAGS)
_LINK_ERRNOS = (errno.ELOOP, errno.EMLINK)
# The pauses before each second look at a twice-linked file (``past_link_window``): a link(2)
# publisher drops its temp name right after the link, microseconds on a local file system and
# one round trip on NFS; ~60 ms in all, paid only by files with two links (10 ms was too short
# where the publisher's thread waited its turn for a CPU: a kernel-NFS client in a guest beside
# a busy CI worker, 1 load of 353 refused).
LINK_WINDOW_S = (0.001, 0.003, 0.006, 0.02, 0.03)


def past_link_window(st: os.stat_result, restat: Callable[[], os.stat_result]) -> os.stat_result:
    """``st`` again (``restat()``) while it is a regular file with exactly two links, after each
    pause of ``LINK_WINDOW_S``: the page a link(2) publisher has linked in and is about to drop
    its temp name of (module docstring). The last stat; anything else is returned at once.

    Failure policy: ``restat``'s OSError propagates (the caller's mapping applies)."""
    for pause in LINK_WINDOW_S:
        if not (stat.S_ISREG(st.st_mode) and st.st_nlink == 2):
            break
        time.sleep(pause)
        st = restat()
    return st


def read_error(exc: OSError, doing: str, path: str | Path, key: bytes | None) -> PageError:
    """The typed error of a failed read step (see the module docstring)."""
    if exc.errno in GONE_ERRNOS:  # the errno kept: ESTALE (another client replaced it) is counted
        return PageMissing("no such page" if doing == "open" else "page vanished while reading", path=path, key=key,
                           errno=exc.errno)
    return PageIOError(f"{'cannot open page' if doing == 'open' else 'read failed'}: {exc.strerror}",
                       errno=exc.errno, path=path, key=key)


def _advance(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes from a list of buffers (after a short vectored I/O call)."""
    while views and n >= len(views[0]):
        n -= len(views[0])
        views.pop(0)
    if n:
        views[0] = views[0][n:]


def pwritev_all(fd: int, pieces: list[Any]) -> None:
    """Write ``pieces`` back to back from offset 0, retrying short writes; raises OSError."""
    views = [v for v in (memoryview(p).cast("B") for p in pieces) if len(v)]
    offset = 0
    while views:
        n = os.pwritev(fd, views, offset)
        if n <= 0:
            raise OSError(errno.EIO, "write returned 0 bytes")
        offset += n
        _advance(views, n)


def preadv_upto(fd: int, bufs: list[memoryview], offset: int) -> int:
    """Read into ``bufs`` from ``offset`` until they are full or the file ends; the end offset.
    Raises OSError."""
    views = [b for b in bufs if len(b)]
    while views:
        n = os.preadv(fd, views, offset)
        if n == 0:
            break
        offset += n
        _advance(views, n)
    return offset


def readinto_exact(fd: int, buf: memoryview, offset: int, path: str) -> None:
    """Fill ``buf`` from ``offset``; PageTruncated if the file ends first, OSError otherwise."""
    while buf:
        n = os.preadv(fd, [buf], offset)
        if n == 0:
            raise PageTruncated("file ended while reading the page", path=path)
        offset += n
        buf = buf[n:]


def open_page(path: str | Path, key: bytes | None, *, dir_fd: int | None = None,
              where: str | None = None) -> tuple[int, os.stat_result]:
    """Open a page file for reading: (fd, fstat). The caller closes the fd. ``dir_fd``: ``path``
    is a name in that checked directory (``where``: the path for messages).

    Failure policy: ``read_error``'s mapping; ``PageUnsafe`` (fd closed) for a symlink (not
    followed), a FIFO, device or directory (opened non-blocking, never read) or a file with more
    than one link (two links: after ``past_link_window``'s second looks).
    """
    where = str(where if where is not None else path)
    try:
        fd = os.open(path, READ_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in _LINK_ERRNOS:
            raise PageUnsafe("a symlink under a page's name: not followed, not served", path=where, key=key) from None
        raise read_error(exc, "open", where, key) from exc
    try:
        st = past_link_window(os.fstat(fd), lambda: os.fstat(fd))
    except OSError as exc:
        os.close(fd)
        raise read_error(exc, "read", where, key) from exc
    # 0 links: removed since the open (gc, another node): its bytes are still the page read
    # and verified like any other; only a second link could reach a file outside the root.
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        os.close(fd)
        what = (f"{st.st_nlink} links (tierstore never hard-links a page)" if stat.S_ISREG(st.st_mode)
                else f"not a regular file (file type {stat.S_IFMT(st.st_mode):#o})")
        raise PageUnsafe(f"{what}: not served, left for fsck", path=where, key=key)
    return fd, st
