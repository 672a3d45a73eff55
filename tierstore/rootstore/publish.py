"""Page-file publication: a page file appears whole under its final name, or not at all, and
never replaces an entry that already has that name (create-only).

Every writer (the ``IOEngine``'s Python path, the test and demo writers) publishes through
``publish``: the pieces go to a unique temp beside the final name (created
``O_EXCL|O_NOFOLLOW``, mode 0600 unless the caller says otherwise: never an existing file or a
link), optionally fsynced, then given the final name by ``place``, which never replaces an
entry: ``renameat2(RENAME_NOREPLACE)`` where the file system has it, else ``link(2)`` of the
temp to the final name and ``unlink(2)`` of the temp. Names are content addresses (same key and
namespace: same bytes), so EEXIST from either means the page is stored already: the temp is
removed and ``publish`` answers False ("not stored by us"). Why create-only: with rename-over,
eight processes racing to store one page left one file but reported ``stored`` up to six times,
and a rename could replace a page another writer had published a moment before (a reader that
opened it keeps the old inode, but the name changed under it). With ``dir_fd`` (a fan-out
directory ``RankDir`` opened without following links) both names are relative to it, so a
directory swapped for a symlink never redirects a write outside the root. Also
``publish_page`` (an encoded page, unless one exists) and ``probe_odirect`` (whether O_DIRECT
works under a directory).

Which primitive: a ``CreateOnly`` per root (``PageFiles`` holds one; the native kernels read
and set the same choice) starts with ``renameat2`` and switches to ``link`` for good the first
time the file system refuses the flag (ENOSYS, EINVAL: NFS, EOPNOTSUPP: some FUSE), so
renameat2 is not retried on every page; callers without one share a memo per device
(``memo_for``). ``NOREPLACE_AVAILABLE`` is False where libc has no ``renameat2`` (then ``link``
everywhere; tests set it False to force the fallback). On ``link``'s EEXIST the temp's link
count is checked: 2 means our own link went through (an NFS LINK answered twice), and the page
counts as ours.

The link window: between ``link`` and the temp's ``unlink`` the page has two links, and every
reader refuses a page with more than one link (it could be a hard link to a file outside the
root). The temp is unlinked at once, and readers look twice before refusing
(``page_io.past_link_window``: a load's ``open_page``, and ``PageFiles``' check before a store,
which would otherwise move the page aside as a planted hard link). A load that still meets the
window (an NFS client whose cached attributes outlive the retries) is a miss of kind
``unsafe``: the tier counts a miss and forgets the key in its own bookkeeping only (the local
index's row; the file stays, still found by the page index's listings, and the next store of
the key, ``stored=False``, commits the row again, as does the next start's reconciling scan),
so no page is lost. Local disks have renameat2, so the window is met on NFS-like roots. A temp whose unlink fails after the link is left with the page's second link
(logged; the stale-temp sweep removes it once its writer is gone): the page is stored.

Failure policy: a failed write is a ``PageStoreError``, whose kind comes from the errno
(``enospc``, ``readonly``, ...), and leaves no temp behind; the final name is untouched. An
existing final name is not a failure (False). Log lines: ``publish``'s O_DIRECT fallback, the
switch to ``link`` (once per memo) and a temp left linked (conditions an operator should know
about).

Threading: every function is reentrant and uses only its own file descriptors; buffers
passed in belong to the calling thread for the call's duration. A ``CreateOnly`` is shared by
threads: its one flag only ever goes from renameat2 to link (a race switches it twice).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import stat
import threading
from pathlib import Path
from typing import Any

from tierstore.errors import PageStoreError, PageUnsafe
from tierstore.fs.directio import ALIGN, O_DIRECT
from tierstore.rootstore.page_io import CLOEXEC, pwritev_all

__all__ = ["NOREPLACE_AVAILABLE", "NOREPLACE_REFUSED", "RENAME_NOREPLACE", "CreateOnly", "memo_for", "place",
           "probe_odirect", "publish", "publish_page", "renameat2", "temp_flags"]

logger = logging.getLogger("tierstore.pagefile")

RENAME_NOREPLACE = 1  # linux/fs.h
_AT_FDCWD = -100
# renameat2's errnos that mean "this file system (or kernel) has no RENAME_NOREPLACE": NFS
# answers EINVAL, kernels before 3.15 ENOSYS, some FUSE servers EOPNOTSUPP.
NOREPLACE_REFUSED = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP})


def _libc_renameat2() -> Any:
    """glibc's ``renameat2`` (2.28 and later) through ctypes (the call releases the GIL), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _libc_renameat2()
# Whether a new CreateOnly tries renameat2 first (module docstring); tests set it False.
NOREPLACE_AVAILABLE = _RENAMEAT2 is not None


def renameat2(src: str, dst: str, *, dir_fd: int | None, flags: int) -> None:
    """renameat2(2) of ``src`` to ``dst`` (names in ``dir_fd``, or paths). Failure policy:
    OSError with the errno (ENOSYS where libc has no renameat2; FileExistsError for EEXIST)."""
    if _RENAMEAT2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not in this libc", src, None, dst)
    fd = _AT_FDCWD if dir_fd is None else dir_fd
    if _RENAMEAT2(fd, os.fsencode(src), fd, os.fsencode(dst), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), src, None, dst)


class CreateOnly:
    """How one root publishes create-only: ``use_link`` False (renameat2 with RENAME_NOREPLACE)
    until its file system refuses that flag, then True for good (``link`` + ``unlink``).
    ``native.page_calls`` reads and sets the same flag (its ``PublishMemo`` protocol)."""

    __slots__ = ("use_link", "where")

    def __init__(self, where: str = "") -> None:
        self.use_link = not NOREPLACE_AVAILABLE
        self.where = where  # the root, for the log line

    def fall_back(self, why: str) -> None:
        """renameat2's flag was refused here: use link(2) from now on (logged once)."""
        if not self.use_link:
            self.use_link = True
            logger.info("tierstore: renameat2(RENAME_NOREPLACE) is refused under %s (%s); pages are published "
                        "with link(2) and unlink(2) of the temp there", self.where or "this root", why)


_MEMOS: dict[int, CreateOnly] = {}  # st_dev -> the memo of callers that bring none


def memo_for(final: str, dir_fd: int | None) -> CreateOnly:
    """The shared memo of the file system that holds ``final`` (or ``dir_fd``), for callers
    without their own. Failure policy: a failed stat raises OSError (``publish`` names it)."""
    dev = os.fstat(dir_fd).st_dev if dir_fd is not None else os.stat(os.path.dirname(final) or ".").st_dev
    memo = _MEMOS.get(dev)
    if memo is None:
        memo = _MEMOS.setdefault(dev, CreateOnly(f"device {dev:#x}"))
    return memo


def place(tmp: str, final: str, *, dir_fd: int | None, memo: CreateOnly) -> bool:
    """Give the written temp ``tmp`` the name ``final`` unless an entry has it: True placed (the
    temp name is gone), False an entry has that name (the temp is left for the caller).
    ``memo`` picks renameat2 or link (module docstring) and learns a refusal.

    Failure policy: any other OSError propagates with the temp in place (the caller removes
    it); after a successful link a failed unlink of the temp is logged, not raised (the page
    is stored)."""
    if not memo.use_link:
        try:
            renameat2(tmp, final, dir_fd=dir_fd, flags=RENAME_NOREPLACE)
            return True
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in NOREPLACE_REFUSED:
                raise
            memo.fall_back(exc.strerror or str(exc.errno))
    try:
        os.link(tmp, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    except FileExistsError:
        # NFS: a LINK the server did but answered twice says EEXIST; our temp's second link
        # says the final name is ours.
        if os.stat(tmp, dir_fd=dir_fd, follow_symlinks=False).st_nlink < 2:
            return False
    try:
        os.unlink(tmp, dir_fd=dir_fd)  # at once: until then the page has two links and loads refuse it
    except OSError as exc:
        logger.warning("tierstore: the temp %s of a published page could not be removed (%s): the page keeps a "
                       "second link, and loads refuse it, until the stale-temp sweep removes the temp", tmp,
                       exc.strerror or exc)
    return True


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


def temp_flags(direct: bool) -> int:
    """The open flags of a temp file ``publish`` creates (never an existing file or a link)."""
    return os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | CLOEXEC | (O_DIRECT if direct else 0)


def publish(final: str, tmp: str, pieces: list[Any], *, key: bytes | None = None, fsync: bool = False,
            direct: bool = False, exact_len: int = 0, dir_fd: int | None = None, mode: int = 0o600,
            where: str | None = None, memo: CreateOnly | None = None) -> bool:
    """Write ``pieces`` to ``tmp`` (a unique name beside ``final``), then give it the name
    ``final`` unless an entry has it (``place``): True published, False an entry had the name
    (a page: names are content addresses; the temp is removed, nothing else touched).
    ``memo``: the root's ``CreateOnly`` (default: ``memo_for`` the file system).

    ``dir_fd``: ``final`` and ``tmp`` are names in that (checked) directory, ``where`` the path
    for messages; otherwise they are paths and a missing fan-out directory is created. The temp
    is created ``O_EXCL|O_NOFOLLOW`` with ``mode`` (0600; a mode with group bits is set with
    fchmod, whatever the umask). ``direct``: open with O_DIRECT (the pieces are aligned and
    padded to ALIGN); the padding is cut off afterwards to ``exact_len`` bytes. If the O_DIRECT
    write is refused at run time (EINVAL: another file system under the root?), the first
    ``exact_len`` bytes of the first piece are rewritten buffered, with a warning.
    ``fsync``: the data is on disk before the final name is given.

    Failure policy: any OSError removes the temp file and raises ``PageStoreError`` with the
    errno (its kind: ``enospc``, ``readonly``, ``permission``, ``io``); ``final`` is untouched.
    An existing final name is False, not an error.
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
        placed = place(tmp, final, dir_fd=dir_fd, memo=memo if memo is not None else memo_for(final, dir_fd))
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise PageStoreError(f"cannot write page: {exc.strerror}", errno=exc.errno, path=where or final,
                             key=key) from exc
    if not placed:
        with contextlib.suppress(OSError):  # never published: a leftover is a stale temp for the sweep
            os.unlink(tmp, dir_fd=dir_fd)
    return placed


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
    """Publish an encoded page (``format.encode_page``) unless ``final`` exists; False if it did
    (checked first, and again by ``publish``'s create-only ``place``: a racing writer's page).

    Names are content addresses (same key and namespace: same bytes), so an existing file
    counts as stored. Failure policy: ``publish``'s.
    """
    if final.exists():
        return False
    return publish(str(final), str(tmp), [header, *pieces], key=key, fsync=fsync)


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


def move_planted_aside(dir_fd: int, name: str, st: os.stat_result, final: str, key: bytes) -> bool:
    """Make room for the page under a name that holds something no load serves (``open_page``
    refuses it as unsafe and never removes it, so counting it stored would block the key for
    good): a FIFO, socket, device, symlink, hard-linked file or directory is renamed aside in
    the same checked directory, to ``.<name>.planted-<random>`` (rename(2) moves the entry
    itself, never what a link points to; fsck reports it as foreign and ``--repair``
    quarantines it: nothing is deleted, it may be someone's data). Why not replaced by the
    page's rename as before: pages are published create-only (``place``), which
    never replaces an entry. Logged; True when moved (the caller counts ``planted_replaced``).
    Failure policy: an entry that cannot be moved raises ``PageUnsafe`` (not stored, left for
    fsck --repair); one gone meanwhile is room made (False)."""
    what = f"file type {stat.S_IFMT(st.st_mode):#o}" if not stat.S_ISREG(st.st_mode) else f"{st.st_nlink} links"
    kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a link" if stat.S_ISLNK(st.st_mode) else "an entry"
    aside = f".{name}.planted-{os.urandom(6).hex()}"
    try:
        os.rename(name, aside, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise PageUnsafe(f"{kind} under the page's name could not be moved aside ({exc.strerror}): not "
                         "stored, left for fsck --repair", path=final, key=key) from None
    logger.warning("tierstore: %s under the page name %s is not a page (%s); moved aside to %s (fsck --repair "
                   "quarantines it) and the page stored", kind, final, what, aside)
    return True

