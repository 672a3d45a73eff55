"""Page-file operations: one flat function per operation on one page file.

Every store (the ``IOEngine`` of any tier, fsck, the test and demo writers) reads and writes
page files through these functions and nothing else; each one's failure policy is in its
docstring. Shared rules:

- Failures are typed ``PageError``s (errors.py), never partial data. An ``OSError`` of a read
  is mapped by ``read_error``: ENOENT, ESTALE (an NFS file deleted under us) and ENOTDIR mean
  ``PageMissing``, anything else ``PageIOError`` with the errno. A failed write is a
  ``PageStoreError``, whose kind comes from the errno (``enospc``, ``readonly``, ...).
- Publishing is atomic (``publish``): a reader sees a whole page under a final name or none.
- Functions do not log, except ``publish``'s O_DIRECT fallback and ``RankDir``'s reopen of a
  removed or replaced directory (conditions an operator should know about).
- A root others can write to (issue 17): page files are opened ``O_NOFOLLOW|O_NONBLOCK`` and
  served only if ``fstat`` says regular file with one link (else ``PageUnsafe``, never removed:
  a FIFO fails at once instead of blocking an I/O thread); temps are created ``O_EXCL|O_NOFOLLOW``
  with mode 0600 unless the caller says otherwise; ``RankDir`` reaches a fan-out directory
  through directory fds opened without following links (safefs.py), and the ``*_at``/``dir_fd``
  forms act relative to it, so a directory swapped for a symlink never redirects a write or
  an unlink outside the root. Before a payload is allocated or read, the file size and the
  header are checked against the expected layout (``format.max_file_size``,
  ``format.check_payload_bound``): memory is bounded by the layout, not by the file.
- With a fleet key (``mac``), a page is served only if its MAC trailer verifies (mac.py).

Operations: ``publish`` (temp + optional fsync + rename, O_DIRECT when asked),
``publish_page`` (an encoded page, unless one exists); ``probe_odirect``; ``open_page``,
``RankDir`` (the directory fds of one group/rank), ``read_plan`` and ``read_own_page`` (the engine's fast read of a file it would have written:
page-cache check, O_DIRECT, hashing piece by piece); ``read_page`` (read and verify any page),
``read_page_fd`` (the same on an fd ``open_page`` checked), ``verify_in_pieces`` (the same checks
through one small buffer, for fsck), ``inspect_page`` (verify with no expectation, for fsck); ``remove_damaged`` / ``remove_damaged_at`` (remove a bad page once, only
if it is still the regular, single-link file that was read); ``pwritev_all`` / ``preadv_upto`` /
``readinto_exact`` (vectored I/O that retries short calls).

Threading: every function is reentrant and uses only its own file descriptors; buffers
passed in belong to the calling thread for the call's duration.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import xxhash

from tierstore.errors import (
    GONE_ERRNOS,
    PageCorrupt,
    PageError,
    PageFormatError,
    PageIOError,
    PageMissing,
    PageSealedCorrupt,
    PageStoreError,
    PageTruncated,
    PageUnsafe,
)
from tierstore.format.mac import PageMac, PageUnauthenticated
from tierstore.format.page import (
    HEADER_ALIGN,
    MAC_TRAILER_LEN,
    MAX_PAGE_BYTES,
    Codec,
    HeaderTemplate,
    PageExpectation,
    PageHeader,
    PageLayout,
    check_expectation,
    check_gaps,
    check_header_shape,
    check_payload_bound,
    decode_header,
    decode_payload,
    header_len_of,
    max_file_size,
    sealed_aad,
    section_sums,
    trailer_len,
)
from tierstore.format.sealing import KeyRing
from tierstore.fs import safefs
from tierstore.fs.directio import ALIGN, O_DIRECT
from tierstore.native import loader as native

__all__ = [
    "O_DIRECT", "FileIdentity", "RankDir", "file_identity", "inspect_page", "open_page",
    "preadv_upto", "probe_odirect", "publish", "publish_page", "pwritev_all", "read_error",
    "check_section_sums", "read_own_page", "read_page", "read_page_fd", "read_plan", "readinto_exact", "remove_damaged",
    "remove_damaged_at", "temp_flags",
]

logger = logging.getLogger("tierstore.pagefile")
FileIdentity = tuple[int, int, int]  # (st_dev, st_ino, st_ctime_ns): one file, not one name
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# O_NONBLOCK: a FIFO under a page's name opens at once (and is then refused by fstat) instead
# of blocking an I/O thread; on a regular file it changes nothing.
READ_FLAGS = safefs.FILE_FLAGS
# (directory, page) flags of the native kernels' opens: the same as the Python path's.
NATIVE_OPEN_FLAGS = (safefs.DIR_FLAGS, READ_FLAGS)
_LINK_ERRNOS = (errno.ELOOP, errno.EMLINK)


# ------------------------------------------------------------------ errors and raw I/O
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


def _make_dirs(path: str) -> None:
    """``mkdir -p`` for a fan-out directory that is missing (engines create them all at start;
    this covers one removed since, and writers that are not engines)."""
    try:
        os.mkdir(path)
    except FileExistsError:
        pass
    except FileNotFoundError:
        _make_dirs(os.path.dirname(path))
        with contextlib.suppress(FileExistsError):
            os.mkdir(path)


# ------------------------------------------------------------------ publish
def temp_flags(direct: bool) -> int:
    """The open flags of a temp file ``publish`` creates (never an existing file or a link)."""
    return os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC | (O_DIRECT if direct else 0)


def publish(final: str, tmp: str, pieces: list[Any], *, key: bytes | None = None, fsync: bool = False,
            direct: bool = False, exact_len: int = 0, dir_fd: int | None = None, mode: int = 0o600,
            where: str | None = None) -> None:
    """Write ``pieces`` to ``tmp`` (a unique name beside ``final``), then rename it to ``final``.

    ``dir_fd``: ``final`` and ``tmp`` are names in that (checked) directory, ``where`` the path
    for messages; otherwise they are paths and a missing fan-out directory is created. The temp
    is created ``O_EXCL|O_NOFOLLOW`` with ``mode`` (0600; a mode with group bits is set with
    fchmod, whatever the umask). ``direct``: open with O_DIRECT (the pieces are aligned and
    padded to ALIGN); the padding is cut off afterwards to ``exact_len`` bytes. If the O_DIRECT
    write is refused at run time (EINVAL: another file system under the root?), the first
    ``exact_len`` bytes of the first piece are rewritten buffered, with a warning.
    ``fsync``: the data is on disk before the rename.

    Failure policy: any OSError removes the temp file and raises ``PageStoreError`` with the
    errno (its kind: ``enospc``, ``readonly``, ``permission``, ``io``); ``final`` is untouched.
    """
    flags = temp_flags(direct)
    where_tmp = tmp if dir_fd is None else f"{os.path.dirname(where or '')}/{tmp}"
    try:
        try:
            fd = os.open(tmp, flags, mode, dir_fd=dir_fd)
        except FileNotFoundError:
            if dir_fd is not None:
                raise
            _make_dirs(os.path.dirname(final))
            fd = os.open(tmp, flags, mode)
    except OSError as exc:
        raise PageStoreError(f"cannot create temp file: {exc.strerror}", errno=exc.errno, path=where_tmp,
                             key=key) from exc
    try:
        try:
            if mode & 0o070:
                os.fchmod(fd, mode)  # a fleet sharing a group: the umask must not take its bits
            _write_pieces(fd, where_tmp, pieces, direct, exact_len)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if dir_fd is None:
            os.replace(tmp, final)
        else:
            os.replace(tmp, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise PageStoreError(f"cannot write page: {exc.strerror}", errno=exc.errno, path=where or final,
                             key=key) from exc


def _write_pieces(fd: int, tmp: str, pieces: list[Any], direct: bool, exact_len: int) -> None:
    """``publish``'s write step on the open temp ``fd`` (O_DIRECT padding cut, EINVAL fallback)."""
    try:
        pwritev_all(fd, pieces)
    except OSError as exc:
        if not (direct and exc.errno == errno.EINVAL):
            raise
        import fcntl  # Linux/Unix only, like O_DIRECT itself

        logger.warning("O_DIRECT write refused (%s); rewriting %s buffered", exc.strerror, tmp)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~O_DIRECT)
        os.ftruncate(fd, 0)
        pwritev_all(fd, [memoryview(pieces[0])[:exact_len], *pieces[1:]])
        return
    if direct and exact_len % ALIGN:  # the last block was padded for O_DIRECT
        os.ftruncate(fd, exact_len)


def publish_page(final: Path, tmp: Path, header: bytes, pieces: list[bytes | memoryview], *,
                 fsync: bool = False, key: bytes | None = None) -> bool:
    """Publish an encoded page (``format.encode_page``) unless ``final`` exists; False if it did.

    Names are content addresses (same key and namespace: same bytes), so an existing file
    counts as stored. Failure policy: ``publish``'s.
    """
    if final.exists():
        return False
    publish(str(final), str(tmp), [header, *pieces], key=key, fsync=fsync)
    return True


def probe_odirect(directory: Path) -> tuple[bool, str]:
    """Whether an aligned O_DIRECT write and read-back work in ``directory``; (ok, reason).

    Failure policy: never raises; every OSError is a (False, reason) answer. The probe file is
    removed (a killed prober leaves ``.odirect-probe.*.tmp``, which fsck recognises).
    """
    if not O_DIRECT:
        return False, "O_DIRECT is not available on this platform"
    path = directory / f".odirect-probe.{os.getpid()}.{threading.get_ident()}.tmp"
    buf = mmap.mmap(-1, ALIGN)
    try:
        buf.write(b"tierstore-odirect-probe".ljust(ALIGN, b"\0"))
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | O_DIRECT, 0o644)
        try:
            if os.pwrite(fd, buf, 0) != ALIGN:
                return False, "short O_DIRECT write"
            back = mmap.mmap(-1, ALIGN)
            try:
                if os.preadv(fd, [back], 0) != ALIGN or back[:] != buf[:]:
                    return False, "O_DIRECT read-back differs"
            finally:
                back.close()
        finally:
            os.close(fd)
        return True, "probe write+read ok"
    except OSError as exc:
        return False, f"{exc.strerror} (errno {exc.errno})"
    finally:
        buf.close()
        with contextlib.suppress(OSError):
            os.unlink(path)


# ------------------------------------------------------------------ the engine's fast read
def open_page(path: str | Path, key: bytes | None, *, dir_fd: int | None = None,
              where: str | None = None) -> tuple[int, os.stat_result]:
    """Open a page file for reading: (fd, fstat). The caller closes the fd. ``dir_fd``: ``path``
    is a name in that checked directory (``where``: the path for messages).

    Failure policy: ``read_error``'s mapping; ``PageUnsafe`` (fd closed) for a symlink (not
    followed), a FIFO, device or directory (opened non-blocking, never read) or a file with more
    than one link.
    """
    where = str(where if where is not None else path)
    try:
        fd = os.open(path, READ_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in _LINK_ERRNOS:
            raise PageUnsafe("a symlink under a page's name: not followed, not served", path=where, key=key) from None
        raise read_error(exc, "open", where, key) from exc
    try:
        st = os.fstat(fd)
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
    most once per ``RANK_DIR_REOPEN_MIN_S``; the call that found it retries once on the new fd,
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
            if now - self._reopened_at < RANK_DIR_REOPEN_MIN_S:
                return -1
            self._reopened_at = now
        fd = self._reopen(create, stale)
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


# The CPU-cache-sized piece of a warm load (read_plan; docs/DESIGN.md §6, the page store on one root).
WARM_PIECE_BYTES = 1 << 20


def read_plan(layout: PageLayout, header_len: int, piece_bytes: int) -> list[tuple[int, int, int, int]]:
    """File pieces (start, end, first section, end section) of a page with an ``header_len``-byte
    header: whole sections, about ``piece_bytes`` each (the CPU cache that still holds a piece
    when it is hashed); the first piece also holds the header, the last reaches the end.
    Pure; no failure."""
    plan: list[tuple[int, int, int, int]] = []
    start, first = 0, 0
    spans = layout.spans
    for i, (_, e) in enumerate(spans):
        if header_len + e - start >= piece_bytes or i == len(spans) - 1:
            end = header_len + (e if i < len(spans) - 1 else layout.nbytes)
            plan.append((start, end, first, i + 1))
            start, first = end, i + 1
    if not plan:  # a layout without sections
        plan.append((0, header_len + layout.nbytes, 0, 0))
    return plan


def read_direct(fd: int, padded_file: memoryview, file_len: int, path: str) -> bool:
    """Read the whole file with O_DIRECT into ``padded_file`` (aligned, ALIGN-padded); False if
    this file system refuses O_DIRECT here (the fd is left buffered, nothing was read).

    Failure policy: ``PageTruncated`` if the file is shorter than ``file_len``; other OSErrors
    propagate (the caller maps them with ``read_error``).
    """
    import fcntl  # Linux/Unix only, like O_DIRECT itself

    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | O_DIRECT)
        end = preadv_upto(fd, [padded_file], 0)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        return False
    if end < file_len:
        raise PageTruncated("file ended while reading the page", path=path)
    return True


def clear_direct(fd: int) -> None:
    """Turn O_DIRECT off on ``fd`` again (after ``read_direct``) for unaligned reads."""
    import fcntl

    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~O_DIRECT)


def check_section_sums(layout: PageLayout, got: Sequence[int], want: Sequence[int], first: int, *, path: str,
                       key: bytes) -> None:
    """Raise ``PageCorrupt`` naming the first section whose computed sum (``got``, sections
    ``first`` onwards) differs from the header's (``want``, every section)."""
    for i, c in enumerate(got, first):
        if c != want[i]:
            raise PageCorrupt(f"section {layout.sections[i].name!r} checksum mismatch", path=path, key=key)


def read_own_page(fd: int, tmpl: HeaderTemplate, file_buf: memoryview, page: memoryview, layout: PageLayout,
                  plan: list[tuple[int, int, int, int]], *, key: bytes, path: str, verify: bool,
                  already_read: bool) -> list[int] | None:
    """Read a file of exactly ``tmpl.header_len + layout.nbytes`` bytes into ``file_buf`` (the
    header lands right before ``page``) and check it in place: the header's section checksums and zero alignment gaps.

    None: the header is not byte for byte ``tmpl``'s for ``key`` (the caller takes
    ``read_page``, which names the error). ``verify=False``: the sections are not hashed (the
    caller checks the bytes against the returned sums) and the file is read in one request.
    Otherwise the file is read piece by piece (``plan``) and each piece's sections are hashed as
    soon as it lands, while it is in the CPU cache. ``already_read``: ``file_buf`` already holds
    the file (``read_direct``).

    Failure policy: ``PageCorrupt`` naming the first bad section; ``PageTruncated`` if the file
    ends early; other OSErrors propagate (the caller maps them with ``read_error``).
    """
    hl = tmpl.header_len
    if not verify:
        if not already_read:
            readinto_exact(fd, file_buf[: hl + layout.nbytes], 0, path)
        parsed = tmpl.parse(file_buf[:hl], key)
        if parsed is not None:
            check_gaps(layout, page, path=path, key=key)  # the caller hashes only the sections
        return parsed
    sums: list[int] | None
    if not already_read:
        fused = native.read_and_hash(fd, file_buf, hl, plan, layout.spans)
        if fused is not None and fused[0] == plan[-1][1]:
            # One GIL release for the whole page (native/loader.py); a short or failed read falls
            # through to the piece-by-piece path below, which names the error.
            sums = tmpl.parse(file_buf[:hl], key)
            if sums is None:
                return None
            check_section_sums(layout, fused[1], sums, 0, path=path, key=key)
            check_gaps(layout, page, path=path, key=key)
            return sums
    sums = None
    for start, end, first_sec, last_sec in plan:
        if not already_read:
            readinto_exact(fd, file_buf[start:end], start, path)
        if sums is None:
            sums = tmpl.parse(file_buf[:hl], key)
            if sums is None:
                return None
        check_section_sums(layout, section_sums(layout.spans, page, first_sec, last_sec), sums, first_sec,
                           path=path, key=key)
    check_gaps(layout, page, path=path, key=key)  # canonical bytes: the gaps are not hashed
    return sums


def remove_damaged(path: str, served: FileIdentity | None) -> bool:
    """Remove the page file at ``path`` if it is still the file that was read (``served``);
    True if removed. A different file under the name (republished since) is left alone.
    Path-based (the directories are followed); the engine uses ``remove_damaged_at``.

    Failure policy: never raises; a file that is gone or cannot be removed is left (False).
    """
    try:
        dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
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


# ------------------------------------------------------------------ read and verify any page
def _parse_checked(hbytes: bytes, path: str, file_size: int, expect: PageExpectation | None) -> PageHeader:
    """Parse the header (its checksum first), then check the exact file size, the expectation
    and the zstd payload bound. Failure policy: the typed ``PageError`` of the first check
    that fails."""
    header = decode_header(hbytes, path=path)
    if file_size < header.file_size:
        raise PageTruncated(f"file has {file_size} bytes, header says {header.file_size}", path=path)
    if file_size > header.file_size:
        raise PageTruncated(f"file has {file_size} bytes, more than the {header.file_size} its header says", path=path)
    if expect is not None:
        check_expectation(header, expect, path=path)
    check_payload_bound(header, path=path)
    return header


def _read_header(fd: int, path: str, file_size: int,
                 expect: PageExpectation | None = None) -> tuple[PageHeader, bytes]:
    """The verified header of the open page and its bytes (``_parse_checked``). With an
    expected layout, a file larger than any page of it is refused before the rest of the header
    is read, and a header of another length or section count (``check_header_shape``) before
    it is parsed."""
    layout = expect.layout if expect is not None else None
    first = os.pread(fd, HEADER_ALIGN, 0)
    header_len = header_len_of(first, path=path)
    if layout is not None and file_size > max_file_size(layout, header_len):
        raise PageFormatError(f"file has {file_size} bytes, more than any page of the expected layout "
                              f"({max_file_size(layout, header_len)}); not read", path=path)
    buf = first if header_len <= len(first) else first + os.pread(fd, header_len - len(first), len(first))
    hbytes = buf[:header_len]
    if layout is not None:
        assert expect is not None
        check_header_shape(hbytes, header_len, layout, len(expect.key), path=path)
    return _parse_checked(hbytes, path, file_size, expect), hbytes


def authenticate(mac: PageMac, header_bytes: bytes | memoryview, payload: Any, trailer: bytes | None, *,
                 path: str, key: bytes | None, check_content: Callable[[], None]) -> None:
    """The authentication step of every reader that serves a page (``read_page_fd`` and the
    engine's own fast read, ``rankdir.PageFiles``): the keyed tag over the raw header bytes and
    the stored payload (``mac.PageMac.verify``). This is the one place where a page's
    authenticity is decided; another authenticator of the same bytes (an AEAD) belongs here.

    Failure policy: a tag that does not verify (none, another key's, an algorithm not
    installed here) is ``PageUnauthenticated`` (kind "mac": not verifiable with this key, a
    miss that is never removed: during a key rotation, or on a node without ``blake3``, the
    page is someone's good page). Before that is raised, ``check_content()`` runs the content
    checks that need no key (checksums, gaps, identity): damage they find raises its own
    ``PageError`` instead (bad content, removed like any damaged page)."""
    try:
        mac.verify(header_bytes, payload, trailer, path=path)
    except PageUnauthenticated as exc:
        check_content()
        exc.key = key
        raise


def check_sealed_sums(layout: PageLayout, want: Sequence[int], ciphertext: memoryview, *, path: str,
                      key: bytes | None, keyless: bool) -> None:
    """The content check of a sealed page that needs no key: every section checksum of the
    ciphertext. Failure policy: ``PageSealedCorrupt`` when ``keyless`` (damage a reader without
    the key cannot authenticate: reported, never removed), else ``PageCorrupt``."""
    got = section_sums(layout.spans, ciphertext)
    for spec, c, w in zip(layout.sections, got, want, strict=True):
        if c != w:
            cls = PageSealedCorrupt if keyless else PageCorrupt
            raise cls(f"section {spec.name!r}: ciphertext checksum mismatch", path=path, key=key)


def open_sealed(sealer: KeyRing | None, aad: bytes | memoryview, sealed: memoryview, out: memoryview, *,
                layout: PageLayout, sums: Sequence[int], path: str, key: bytes | None) -> None:
    """The verify-then-serve step of a sealed page (``read_page_fd`` and the engine's own read,
    ``rankdir.PageFiles``): decrypt ``sealed`` (ciphertext, then the trailer) into ``out``, then
    check that the plaintext's alignment gaps are zero.

    Failure policy: with no ``sealer`` (this node has no ``encryption_key_file``), or a tag that
    does not verify (another key, a moved or forged page), ``PageUnauthenticated`` (kind "mac":
    a miss, never removed), unless the ciphertext checksums show damage first
    (``PageCorrupt``: removed like any damaged page when a sealer is given)."""
    n = len(out)
    if sealer is None:
        check_sealed_sums(layout, sums, sealed[:n], path=path, key=key, keyless=True)
        raise PageUnauthenticated("page is encrypted and this node has no key (setting \"encryption_key_file\"): "
                                  "not verifiable here, not served, left in place", path=path, key=key)
    try:
        sealer.open(aad, sealed, out, path=path, key=key)
    except PageUnauthenticated:
        check_sealed_sums(layout, sums, sealed[:n], path=path, key=key, keyless=False)
        raise
    check_gaps(layout, out, path=path, key=key)


def read_page_fd(fd: int, st: os.stat_result, path: str, expect: PageExpectation | None, out: memoryview,
                 *, mac: PageMac | None = None, sealer: KeyRing | None = None, keyless: bool = False) -> PageHeader:
    """Verify, then serve: the page read on an fd ``open_page`` opened and checked (the caller
    closes it) into ``out``, and its header. Every general reader goes through here (an
    engine's pages not byte for byte its own, the shared backlog, the head-slice fallback,
    fsck, ``read_page``); the engine's own fast read makes the same checks with the same
    ``authenticate`` and ``open_sealed`` steps.

    Order (nothing is allocated before the checks that bound it): the file size against the
    expected layout, the header checksum, the exact file size, the expectation (namespace,
    key, group, rank, layout), the zstd payload bound, then the payload is read (codec NONE
    straight into ``out``), its MAC trailer verified when ``mac`` is given, and every section
    checksum and gap checked. A sealed page (``format.FLAG_SEALED``) is decrypted with
    ``sealer`` (``open_sealed``); with ``keyless`` (fsck without the key) it is checked by its
    ciphertext checksums only and ``out`` holds the ciphertext: never serve it. A reader with
    ``sealer`` serves only sealed pages. Failure policy: a typed ``PageError``; a page that
    cannot be authenticated with ``mac`` or ``sealer`` is ``PageUnauthenticated`` (kind "mac",
    never removed) unless its content is damaged (``authenticate``); ``out`` then holds garbage.
    """
    key = expect.key if expect else None
    try:
        header, hbytes = _read_header(fd, path, st.st_size, expect)
        out = memoryview(out).cast("B")
        if header.sealed:
            return _read_sealed(fd, header, path, key, out, sealer=sealer, keyless=keyless)
        in_place = header.codec == Codec.NONE and len(out) == header.payload_len
        payload = out if in_place else memoryview(bytearray(header.payload_len))
        readinto_exact(fd, payload, header.header_len, path)

        def content() -> None:
            decode_payload(header, None if in_place else payload, out, path=path)

        if sealer is not None:
            content()
            raise PageUnauthenticated("page is not encrypted and this node has a key (setting "
                                      "\"encryption_key_file\"): not served, left in place", path=path, key=key)
        if mac is not None:
            if not header.has_mac:
                content()
                raise PageUnauthenticated("page has no MAC tag (a fleet key is configured): not verifiable with this "
                                          "key, not served, left in place", path=path, key=key)
            trailer = os.pread(fd, MAC_TRAILER_LEN, header.header_len + header.payload_len)
            authenticate(mac, hbytes, payload, trailer, path=path, key=key, check_content=content)
        content()
    except OSError as exc:
        raise read_error(exc, "read", path, key) from exc
    return header


def _read_sealed(fd: int, header: PageHeader, path: str, key: bytes | None, out: memoryview, *,
                 sealer: KeyRing | None, keyless: bool) -> PageHeader:
    """``read_page_fd`` of a sealed page (codec none: ``format._parse_header`` refuses others)."""
    if len(out) != header.payload_len:
        raise ValueError(f"output buffer has {len(out)} bytes, page needs {header.payload_len}")
    sealed = memoryview(bytearray(header.payload_len + trailer_len(header.flags)))
    readinto_exact(fd, sealed, header.header_len, path)
    sums = [e.checksum for e in header.sections]
    if keyless:
        check_sealed_sums(header.layout, sums, sealed[:header.payload_len], path=path, key=key, keyless=True)
        out[:] = sealed[:header.payload_len]
        return header
    open_sealed(sealer, sealed_aad(header), sealed, out, layout=header.layout, sums=sums, path=path, key=key)
    return header


def in_pieces_applies(st: os.stat_result, header: PageHeader) -> bool:
    """Whether ``verify_in_pieces`` can verify this page: codec none, a payload that is the
    layout's buffer and a file of exactly the header's size (its trailer included)."""
    return (header.codec == Codec.NONE and header.payload_len == header.layout.nbytes
            and st.st_size == header.file_size)


def verify_in_pieces(fd: int, st: os.stat_result, header: PageHeader, hbytes: bytes, path: str, buf: memoryview,
                     *, mac: PageMac | None = None,
                     check_piece: Callable[[int, memoryview], tuple[str, str] | None] | None = None,
                     ) -> tuple[str, str] | None:
    """Verify a codec-none page whose header was decoded and checked (``hbytes``: its raw
    bytes), reading the payload once, in order, through ``buf`` a piece at a time: memory stays
    ``len(buf)`` whatever size the page declares (fsck of a huge page, or of a page a planted
    manifest makes huge). Checked: every section checksum, every alignment gap zero, with
    ``mac`` the tag over the header and the stored payload (``authenticate``, the tag hashed
    from the same pieces), and ``check_piece(section index, bytes)`` on each section's bytes in
    order (``fsck --deep``'s value check; pieces start at multiples of ``len(buf)``, a multiple
    of 64): its first finding, (kind, message), is returned; None when it found nothing.
    Callers check ``in_pieces_applies`` first.

    Failure policy: ``PageCorrupt`` (a bad section or gap), ``PageTruncated``,
    ``PageUnauthenticated`` (as ``authenticate``: only when the content checks pass); other
    OSErrors are mapped by ``read_error``."""
    key, base, total = header.meta.key, header.header_len, header.payload_len
    spans, gaps = header.layout.spans, header.layout.gaps
    hashers = [xxhash.xxh3_64() for _ in spans]
    found: list[tuple[str, str]] = []

    def scan() -> Iterator[memoryview]:
        pos, first_sec, first_gap = 0, 0, 0
        while pos < total:
            end = min(pos + len(buf), total)
            piece = buf[:end - pos]
            readinto_exact(fd, piece, base + pos, path)
            while first_sec < len(spans) and spans[first_sec][1] <= pos:
                first_sec += 1
            i = first_sec
            while i < len(spans) and spans[i][0] < end:
                part = piece[max(spans[i][0], pos) - pos:min(spans[i][1], end) - pos]
                hashers[i].update(part)
                if check_piece is not None and not found and len(part):
                    bad = check_piece(i, part)
                    if bad is not None:
                        found.append(bad)
                i += 1
            while not header.sealed and first_gap < len(gaps) and gaps[first_gap][1] <= pos:  # ciphertext gaps
                first_gap += 1
            i = first_gap
            while not header.sealed and i < len(gaps) and gaps[i][0] < end:
                a, b = max(gaps[i][0], pos), min(gaps[i][1], end)
                if any(piece[a - pos:b - pos]):
                    raise PageCorrupt(f"non-zero bytes in the alignment gap at page bytes {gaps[i][0]}..{gaps[i][1]}: "
                                      "not a canonical format-3 page; it is not served", path=path, key=key)
                i += 1
            pos = end
            yield piece

    pieces = scan()

    def content() -> None:  # the rest of the scan, then every section's sum
        for _ in pieces:
            pass
        for e, h in zip(header.sections, hashers, strict=True):
            if h.intdigest() != e.checksum:
                if header.sealed:  # verified without the key (callers decrypt sealed pages whole)
                    raise PageSealedCorrupt(f"section {e.spec.name!r}: ciphertext checksum mismatch", path=path, key=key)
                raise PageCorrupt(f"section {e.spec.name!r} checksum mismatch", path=path, key=key)

    try:
        if mac is not None and not header.sealed:
            if not header.has_mac:
                content()
                raise PageUnauthenticated("page has no MAC tag (a fleet key is configured): not verifiable with this "
                                          "key, not served, left in place", path=path, key=key)
            trailer = os.pread(fd, MAC_TRAILER_LEN, base + total)
            authenticate(mac, hbytes, pieces, trailer, path=path, key=key, check_content=content)
        content()
    except OSError as exc:
        raise read_error(exc, "read", path, key) from exc
    return found[0] if found else None


def read_page(path: Path, expect: PageExpectation | None, out: memoryview,
              decompressor: object | None = None, *, mac: PageMac | None = None,
              sealer: KeyRing | None = None) -> PageHeader:
    """Read, verify and decode a page into ``out`` (``layout.nbytes`` bytes); its header.

    Verifies the header checksum, namespace, key/group/rank and layout (``expect``), the exact
    file size, the MAC (``mac``) and every section checksum. Failure policy: a typed
    ``PageError`` (missing, io, truncated, checksum, format, foreign, key_mismatch, unsafe,
    mac); ``out`` then holds garbage. ``decompressor`` is accepted for compatibility, unused.
    """
    spath = str(path)
    fd, st = open_page(spath, expect.key if expect else None)
    try:
        return read_page_fd(fd, st, spath, expect, out, mac=mac, sealer=sealer)
    finally:
        os.close(fd)


def inspect_page(path: Path, decompressor: object | None = None, *, max_page_bytes: int = MAX_PAGE_BYTES,
                 mac: PageMac | None = None, sealer: KeyRing | None = None) -> PageHeader:
    """Fully verify a page with no expectation; its header. The page buffer its header declares
    is allocated only if it is at most ``max_page_bytes`` (fsck passes the manifest's layout
    size) and the zstd payload is within its bound. Failure policy: ``read_page``'s."""
    spath = str(path)
    fd, st = open_page(spath, None)
    try:
        try:
            header, _ = _read_header(fd, spath, st.st_size)
        except OSError as exc:
            raise read_error(exc, "read", spath, None) from exc
        if header.layout.nbytes > max_page_bytes:
            raise PageFormatError(f"header declares a {header.layout.nbytes}-byte page, more than "
                                  f"{max_page_bytes}; not read", path=spath)
        check_payload_bound(header, path=spath)
        out = memoryview(bytearray(header.layout.nbytes))
        return read_page_fd(fd, st, spath, None, out, mac=mac, sealer=sealer, keyless=sealer is None)
    finally:
        os.close(fd)
