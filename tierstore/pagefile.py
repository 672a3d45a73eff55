"""Reading and publishing one page file (buffered I/O).

- ``write_and_rename``: the atomic publish every writer uses (the IOEngine too): write the
  pieces to a unique temp file beside the final name (creating missing fan-out directories;
  O_DIRECT on request, rewritten buffered if refused at run time), optionally fsync, then
  rename into place. On any error the temp is removed and a ``PageStoreError`` carries the
  errno.
- ``publish_page``: header + payload through ``write_and_rename``; an existing final file
  counts as stored (content-addressed: same key and namespace means the same bytes).
- ``read_page``: read and verify a page into a caller-owned buffer. Verifies the header
  checksum, namespace, key/group/rank, layout, exact file size and every section checksum;
  raises a typed ``PageError`` and never returns partial data.
- ``inspect_page``: the same verification with no expectation (used by fsck).

- ``pwritev_all`` / ``preadv_upto`` / ``readinto_exact``: vectored I/O that retries short
  calls; the IOEngine's O_DIRECT paths use them too.

ENOENT and ESTALE both mean "missing" (an NFS file deleted under us is just gone).
Threading: functions are reentrant; each call uses only its own file descriptors.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from pathlib import Path
from typing import Any

from tierstore.errors import PageIOError, PageMissing, PageStoreError, PageTruncated
from tierstore.format import (
    HEADER_ALIGN,
    Codec,
    PageExpectation,
    PageHeader,
    check_expectation,
    decode_header,
    decode_payload,
    header_len_of,
)

_MISSING_ERRNOS = (errno.ENOENT, errno.ESTALE, errno.ENOTDIR)
O_DIRECT = getattr(os, "O_DIRECT", 0)
logger = logging.getLogger("tierstore.pagefile")


def _advance(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes from a list of buffers (after a short vectored I/O call)."""
    while views and n >= len(views[0]):
        n -= len(views[0])
        views.pop(0)
    if n:
        views[0] = views[0][n:]


def pwritev_all(fd: int, pieces: list[Any]) -> None:
    """Write ``pieces`` back to back from offset 0, retrying short writes."""
    views = [v for v in (memoryview(p).cast("B") for p in pieces) if len(v)]
    offset = 0
    while views:
        n = os.pwritev(fd, views, offset)
        if n <= 0:
            raise OSError(errno.EIO, "write returned 0 bytes")
        offset += n
        _advance(views, n)


def preadv_upto(fd: int, bufs: list[memoryview], offset: int) -> int:
    """Read into ``bufs`` from ``offset`` until they are full or the file ends; the end offset."""
    views = [b for b in bufs if len(b)]
    while views:
        n = os.preadv(fd, views, offset)
        if n == 0:
            break
        offset += n
        _advance(views, n)
    return offset


def make_dirs(path: str) -> None:
    """``mkdir -p`` for a fan-out directory that is missing (engines create them all at start;
    this covers one removed since, and writers that are not engines)."""
    try:
        os.mkdir(path)
    except FileExistsError:
        pass
    except FileNotFoundError:
        make_dirs(os.path.dirname(path))
        with contextlib.suppress(FileExistsError):
            os.mkdir(path)


def write_and_rename(final: str, tmp: str, pieces: list[Any], *, key: bytes | None = None, fsync: bool = False,
                     direct: bool = False, exact_len: int = 0, truncate_to: int = 0) -> None:
    """Write ``pieces`` to ``tmp`` and rename it to ``final`` (see the module docstring).

    ``direct``: open with O_DIRECT (the pieces are aligned and padded); if the write is refused
    at run time (another file system under the root?), the first piece is rewritten buffered,
    ``exact_len`` bytes. ``truncate_to``: cut the padding off after an O_DIRECT write.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (O_DIRECT if direct else 0)
    try:
        try:
            fd = os.open(tmp, flags, 0o644)
        except FileNotFoundError:
            make_dirs(os.path.dirname(final))
            fd = os.open(tmp, flags, 0o644)
    except OSError as exc:
        raise PageStoreError(f"cannot create temp file: {exc.strerror}", errno=exc.errno, path=tmp, key=key) from exc
    try:
        try:
            try:
                pwritev_all(fd, pieces)
            except OSError as exc:
                if not (direct and exc.errno == errno.EINVAL):
                    raise
                logger.warning("O_DIRECT write refused (%s); rewriting %s buffered", exc.strerror, tmp)
                os.close(fd)
                fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC)
                pwritev_all(fd, [memoryview(pieces[0])[:exact_len]])
                truncate_to = 0
            if truncate_to:
                os.ftruncate(fd, truncate_to)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise PageStoreError(f"cannot write page: {exc.strerror}", errno=exc.errno, path=final, key=key) from exc


def publish_page(
    final: Path,
    tmp: Path,
    header: bytes,
    pieces: list[bytes | memoryview],
    *,
    fsync: bool = False,
    key: bytes | None = None,
) -> bool:
    """Atomically publish a page; returns False if it already existed (nothing written)."""
    if final.exists():
        return False
    write_and_rename(str(final), str(tmp), [header, *pieces], key=key, fsync=fsync)
    return True


def _open_for_read(path: Path, key: bytes | None) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as exc:
        if exc.errno in _MISSING_ERRNOS:
            raise PageMissing("no such page", path=path, key=key) from exc
        raise PageIOError(f"cannot open page: {exc.strerror}", errno=exc.errno, path=path, key=key) from exc


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


def readinto_exact(fd: int, buf: memoryview, offset: int, path: str) -> None:
    """Fill ``buf`` from ``offset``; PageTruncated if the file ends first."""
    while buf:
        n = os.preadv(fd, [buf], offset)
        if n == 0:
            raise PageTruncated("file ended while reading the page", path=path)
        offset += n
        buf = buf[n:]


def read_page(
    path: Path,
    expect: PageExpectation | None,
    out: memoryview,
    decompressor: object | None = None,
) -> PageHeader:
    """Read, verify and decode a page into ``out`` (``layout.nbytes`` bytes)."""
    spath = str(path)
    key = expect.key if expect else None
    fd = _open_for_read(path, key)
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
            if exc.errno in _MISSING_ERRNOS:
                raise PageMissing("page vanished while reading", path=path, key=key) from exc
            raise PageIOError(f"read failed: {exc.strerror}", errno=exc.errno, path=path, key=key) from exc
    finally:
        os.close(fd)
    return header


def inspect_page(path: Path, decompressor: object | None = None) -> PageHeader:
    """Fully verify a page with no expectation; returns its header."""
    fd = _open_for_read(path, None)
    try:
        header = _read_header(fd, str(path), os.fstat(fd).st_size)
    finally:
        os.close(fd)
    out = memoryview(bytearray(header.layout.nbytes))
    read_page(path, None, out, decompressor)
    return header
