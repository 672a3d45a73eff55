"""Read and verify any page file: the one verify-then-serve path of every general reader.

Every reader that serves a page it did not write byte for byte itself (an engine's pages not
in its own exact format, the shared backlog, the head-slice fallback, fsck, ``read_page``)
goes through ``read_page_fd``; the engine's own fast read (own_read.py) makes the same checks
with the same ``authenticate`` and ``sealed_pages.open_sealed`` steps. Shared rules:

- Failures are typed ``PageError``s (errors.py), never partial data; an ``OSError`` of a read
  is mapped by ``page_io.read_error``.
- Before a payload is allocated or read, the file size and the header are checked against the
  expected layout (``format.max_file_size``, ``format.check_payload_bound``): memory is
  bounded by the layout, not by the file.
- With a fleet key (``mac``), a page is served only if its MAC trailer verifies (mac.py); with
  an encryption key (``sealer``), only if it is sealed and opens (sealed_pages.py).
- Functions do not log.

Operations: ``read_page_fd`` (read and verify a page on an fd ``page_io.open_page`` checked),
``read_page`` (the same from a path), ``verify_in_pieces`` (the same checks through one small
buffer, for fsck; ``in_pieces_applies`` says when), ``inspect_page`` (verify with no
expectation, for fsck), ``authenticate`` (the one place a page's authenticity is decided).

Threading: every function is reentrant and uses only its own file descriptors; buffers
passed in belong to the calling thread for the call's duration.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import xxhash

from tierstore.errors import PageCorrupt, PageFormatError, PageSealedCorrupt, PageTruncated
from tierstore.format.header import (
    HEADER_ALIGN,
    MAC_TRAILER_LEN,
    MAX_PAGE_BYTES,
    Codec,
    PageExpectation,
    PageHeader,
    check_expectation,
    check_header_shape,
    check_payload_bound,
    decode_header,
    header_len_of,
    max_file_size,
)
from tierstore.format.mac import PageMac, PageUnauthenticated
from tierstore.format.page import decode_payload
from tierstore.format.sealing import KeyRing
from tierstore.fs import safefs
from tierstore.rootstore.page_io import open_page, read_error, readinto_exact
from tierstore.rootstore.sealed_pages import read_sealed

__all__ = ["authenticate", "in_pieces_applies", "inspect_page", "read_page", "read_page_fd", "verify_in_pieces"]


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
    engine's own fast read, ``page_files.PageFiles``): the keyed tag over the raw header bytes and
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
    ``sealer`` (``sealed_pages.open_sealed``); with ``keyless`` (fsck without the key) it is checked by its
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
            return read_sealed(fd, header, path, key, out, sealer=sealer, keyless=keyless)
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


def read_page_body(body: bytes | memoryview, where: str, expect: PageExpectation | None, out: memoryview,
                   *, mac: PageMac | None = None, sealer: KeyRing | None = None, keyless: bool = False) -> PageHeader:
    """``read_page_fd`` on a page file held in memory (an object's body): the same checks, in
    the same order, on an in-memory file (``memfd_create``) holding ``body``; ``where`` names
    it in errors. Failure policy: ``read_page_fd``'s."""
    fd = os.memfd_create("tierstore-page", os.MFD_CLOEXEC)
    try:
        safefs.write_all(fd, body)
        return read_page_fd(fd, os.fstat(fd), where, expect, out, mac=mac, sealer=sealer, keyless=keyless)
    finally:
        os.close(fd)


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
