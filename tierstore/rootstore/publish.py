"""Page-file publication: a page file appears whole under its final name, or not at all.

Every writer (the ``IOEngine``'s Python path, the test and demo writers) publishes through
``publish``: the pieces go to a unique temp beside the final name (created
``O_EXCL|O_NOFOLLOW``, mode 0600 unless the caller says otherwise: never an existing file or a
link), optionally fsynced, then renamed over the final name. With ``dir_fd`` (a fan-out
directory ``RankDir`` opened without following links) both names are relative to it, so a
directory swapped for a symlink never redirects a write outside the root. Also
``publish_page`` (an encoded page, unless one exists) and ``probe_odirect`` (whether O_DIRECT
works under a directory).

Failure policy: a failed write is a ``PageStoreError``, whose kind comes from the errno
(``enospc``, ``readonly``, ...), and leaves no temp behind; the final name is untouched. The
only log line is ``publish``'s O_DIRECT fallback (a condition an operator should know about).

Threading: every function is reentrant and uses only its own file descriptors; buffers
passed in belong to the calling thread for the call's duration.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import threading
from pathlib import Path
from typing import Any

from tierstore.errors import PageStoreError
from tierstore.fs.directio import ALIGN, O_DIRECT
from tierstore.rootstore.page_io import CLOEXEC, pwritev_all

__all__ = ["probe_odirect", "publish", "publish_page", "temp_flags"]

logger = logging.getLogger("tierstore.pagefile")


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
