"""Page-file operations: one flat function per operation on one page file.

Every store (the ``IOEngine`` of any tier, fsck, the test and demo writers) reads and writes
page files through these functions and nothing else; each one's failure policy is in its
docstring. Shared rules:

- Failures are typed ``PageError``s (errors.py), never partial data. An ``OSError`` of a read
  is mapped by ``read_error``: ENOENT, ESTALE (an NFS file deleted under us) and ENOTDIR mean
  ``PageMissing``, anything else ``PageIOError`` with the errno. A failed write is a
  ``PageStoreError``, whose kind comes from the errno (``enospc``, ``readonly``, ...).
- Publishing is atomic (``publish``): a reader sees a whole page under a final name or none.
- Functions do not log, except ``publish``'s O_DIRECT fallback (a condition an operator should
  know about).

Operations: ``publish`` (temp + optional fsync + rename, O_DIRECT when asked),
``publish_page`` (an encoded page, unless one exists); ``probe_odirect``; ``open_page``,
``read_plan`` and ``read_own_page`` (the engine's fast read of a file it would have written:
page-cache check, O_DIRECT, hashing piece by piece); ``read_page`` (read and verify any page),
``inspect_page`` (verify with no expectation, for fsck); ``remove_damaged`` (remove a bad page
once, only if it is still the file that was read); ``pwritev_all`` / ``preadv_upto`` /
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
from pathlib import Path
from typing import Any

from tierstore.directio import ALIGN, O_DIRECT
from tierstore.errors import (
    PageCorrupt,
    PageError,
    PageFormatError,
    PageIOError,
    PageMissing,
    PageStoreError,
    PageTruncated,
)
from tierstore.format import (
    HEADER_ALIGN,
    Codec,
    HeaderTemplate,
    PageExpectation,
    PageHeader,
    PageLayout,
    check_expectation,
    check_gaps,
    checksum,
    decode_header,
    decode_payload,
    header_len_of,
)

__all__ = [
    "O_DIRECT", "MISSING_ERRNOS", "FileIdentity", "file_identity", "inspect_page", "open_page",
    "preadv_upto", "probe_odirect", "publish", "publish_page", "pwritev_all", "read_error",
    "read_own_page", "read_page", "read_plan", "readinto_exact", "remove_damaged",
]

MISSING_ERRNOS = (errno.ENOENT, errno.ESTALE, errno.ENOTDIR)
logger = logging.getLogger("tierstore.pagefile")
FileIdentity = tuple[int, int, int]  # (st_dev, st_ino, st_ctime_ns): one file, not one name


# ------------------------------------------------------------------ errors and raw I/O
def read_error(exc: OSError, doing: str, path: str | Path, key: bytes | None) -> PageError:
    """The typed error of a failed read step (see the module docstring)."""
    if exc.errno in MISSING_ERRNOS:
        return PageMissing("no such page" if doing == "open" else "page vanished while reading", path=path, key=key)
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
def publish(final: str, tmp: str, pieces: list[Any], *, key: bytes | None = None, fsync: bool = False,
            direct: bool = False, exact_len: int = 0) -> None:
    """Write ``pieces`` to ``tmp`` (a unique name beside ``final``), then rename it to ``final``.

    A missing fan-out directory is created. ``direct``: open with O_DIRECT (the pieces are
    aligned and padded to ALIGN); the padding is cut off afterwards to ``exact_len`` bytes. If
    the O_DIRECT write is refused at run time (EINVAL: another file system under the root?),
    the first ``exact_len`` bytes of the first piece are rewritten buffered, with a warning.
    ``fsync``: the data is on disk before the rename.

    Failure policy: any OSError removes the temp file and raises ``PageStoreError`` with the
    errno (its kind: ``enospc``, ``readonly``, ``permission``, ``io``); ``final`` is untouched.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (O_DIRECT if direct else 0)
    try:
        try:
            fd = os.open(tmp, flags, 0o644)
        except FileNotFoundError:
            _make_dirs(os.path.dirname(final))
            fd = os.open(tmp, flags, 0o644)
    except OSError as exc:
        raise PageStoreError(f"cannot create temp file: {exc.strerror}", errno=exc.errno, path=tmp, key=key) from exc
    try:
        try:
            _write_pieces(fd, tmp, pieces, direct, exact_len)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise PageStoreError(f"cannot write page: {exc.strerror}", errno=exc.errno, path=final, key=key) from exc


def _write_pieces(fd: int, tmp: str, pieces: list[Any], direct: bool, exact_len: int) -> None:
    """``publish``'s write step on the open temp ``fd`` (O_DIRECT padding cut, EINVAL fallback)."""
    try:
        pwritev_all(fd, pieces)
    except OSError as exc:
        if not (direct and exc.errno == errno.EINVAL):
            raise
        logger.warning("O_DIRECT write refused (%s); rewriting %s buffered", exc.strerror, tmp)
        with open(tmp, "r+b", buffering=0) as f:  # a plain descriptor on the same file
            f.truncate(0)
            pwritev_all(f.fileno(), [memoryview(pieces[0])[:exact_len]])
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
def open_page(path: str | Path, key: bytes | None) -> tuple[int, os.stat_result]:
    """Open a page file for reading: (fd, fstat). The caller closes the fd.

    Failure policy: ``read_error``'s mapping; ``PageFormatError`` (fd closed) if it is not a
    regular file.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise read_error(exc, "open", path, key) from exc
    try:
        st = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        raise read_error(exc, "read", path, key) from exc
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise PageFormatError("not a regular file", path=str(path), key=key)
    return fd, st


def file_identity(st: os.stat_result) -> FileIdentity:
    """What tells one file from another published later under the same name."""
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


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
    sums: list[int] | None = None
    for start, end, first_sec, last_sec in plan:
        if not already_read:
            readinto_exact(fd, file_buf[start:end], start, path)
        if sums is None:
            sums = tmpl.parse(file_buf[:hl], key)
            if sums is None:
                return None
        for i in range(first_sec, last_sec):
            o, e = layout.spans[i]
            if checksum(page[o:e]) != sums[i]:
                raise PageCorrupt(f"section {layout.sections[i].name!r} checksum mismatch", path=path, key=key)
    check_gaps(layout, page, path=path, key=key)  # canonical bytes: the gaps are not hashed
    return sums


def remove_damaged(path: str, served: FileIdentity | None) -> bool:
    """Remove the page file at ``path`` if it is still the file that was read (``served``);
    True if removed. A different file under the name (republished since) is left alone.

    Failure policy: never raises; a file that is gone or cannot be removed is left (False).
    Races an unlink by another process only in the window between stat and unlink.
    """
    try:
        if served is not None and file_identity(os.stat(path)) != served:
            return False
        os.unlink(path)
    except OSError:
        return False
    return True


# ------------------------------------------------------------------ read and verify any page
def _read_header(fd: int, path: str, file_size: int) -> PageHeader:
    first = os.pread(fd, HEADER_ALIGN, 0)
    header_len = header_len_of(first, path=path)
    buf = first if header_len <= len(first) else first + os.pread(fd, header_len - len(first), len(first))
    header = decode_header(buf, path=path)
    if file_size < header.file_size:
        raise PageTruncated(f"file has {file_size} bytes, header says {header.file_size}", path=path)
    if file_size > header.file_size:
        raise PageTruncated(f"file has {file_size} bytes, more than the {header.file_size} its header says", path=path)
    return header


def read_page(path: Path, expect: PageExpectation | None, out: memoryview,
              decompressor: object | None = None) -> PageHeader:
    """Read, verify and decode a page into ``out`` (``layout.nbytes`` bytes); its header.

    Verifies the header checksum, namespace, key/group/rank and layout (``expect``), the exact
    file size and every section checksum. Failure policy: a typed ``PageError`` (missing, io,
    truncated, checksum, format, foreign, key_mismatch); ``out`` then holds garbage.
    """
    spath = str(path)
    key = expect.key if expect else None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise read_error(exc, "open", path, key) from exc
    try:
        try:
            header = _read_header(fd, spath, os.fstat(fd).st_size)
            if expect is not None:
                check_expectation(header, expect, path=spath)
            out = memoryview(out).cast("B")
            if header.codec == Codec.NONE and len(out) == header.payload_len:
                readinto_exact(fd, out, header.header_len, spath)
                decode_payload(header, None, out, path=spath)
            else:
                payload = memoryview(bytearray(header.payload_len))
                readinto_exact(fd, payload, header.header_len, spath)
                decode_payload(header, payload, out, decompressor, path=spath)
        except OSError as exc:
            raise read_error(exc, "read", path, key) from exc
    finally:
        os.close(fd)
    return header


def inspect_page(path: Path, decompressor: object | None = None) -> PageHeader:
    """Fully verify a page with no expectation; its header. Failure policy: ``read_page``'s."""
    fd, st = open_page(path, None)
    try:
        try:
            header = _read_header(fd, str(path), st.st_size)
        except OSError as exc:
            raise read_error(exc, "read", path, None) from exc
    finally:
        os.close(fd)
    out = memoryview(bytearray(header.layout.nbytes))
    read_page(path, None, out, decompressor)
    return header
