"""Sealed pages (``encryption_key_file``): the verify-then-serve step of a sealed page, and
``SealedPages``, the file bytes of one rank directory's sealed pages.

Every reader of a sealed page opens it through ``open_sealed``: decrypt (the tag verified),
then check that the plaintext's alignment gaps are zero. ``read_sealed`` is the general
reader's (``page_read.read_page_fd``) step for a sealed page; ``check_sealed_sums`` checks a
sealed page's ciphertext checksums, the content check that needs no key.

Store path: ``SealedPages.seal`` fills the header with zero checksums (the authenticated data,
``format.sealed_aad``), encrypts the slot's plaintext after it (``sealing.KeyRing.seal``, the key the page key names:
ciphertext, then the trailer) and fills the header again with the ciphertext's checksums;
``PageFiles`` publishes the two buffers. Load path: ``SealedPages.open`` reads the header, accepts it only
if it is byte for byte this writer's (``HeaderTemplate.parse``; anything else goes to the
general reader, which names why), reads the ciphertext and trailer, and decrypts into the slot
(``open_sealed``: the tag, then the plaintext's zero gaps). Failure policy: a typed
``PageError`` (``PageUnauthenticated`` for a page this key does not open, never removed;
``PageSealedCorrupt`` for damage a reader without the key finds: reported, never removed).

Threading: the functions are reentrant. ``SealedPages``: any number of I/O threads at once;
each has its own two buffers (a header and a page's ciphertext plus trailer, allocated at its
first page), valid until its next call.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from tierstore.errors import PageCorrupt, PageSealedCorrupt
from tierstore.format.checksums import section_sums
from tierstore.format.header import SEALED_TRAILER_LEN, PageHeader, sealed_aad, trailer_len
from tierstore.format.header_template import HeaderTemplate
from tierstore.format.mac import PageUnauthenticated
from tierstore.format.page_layout import PageLayout, check_gaps
from tierstore.format.sealing import KeyRing
from tierstore.rootstore.page_io import readinto_exact

__all__ = ["SealedPages", "check_sealed_sums", "open_sealed", "read_sealed"]


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
    """The verify-then-serve step of a sealed page (``page_read.read_page_fd`` and the engine's
    own read, ``page_files.PageFiles``): decrypt ``sealed`` (ciphertext, then the trailer) into ``out``, then
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


def read_sealed(fd: int, header: PageHeader, path: str, key: bytes | None, out: memoryview, *,
                sealer: KeyRing | None, keyless: bool) -> PageHeader:
    """``page_read.read_page_fd`` of a sealed page whose header was checked (codec none:
    ``format._parse_header`` refuses others): the payload and trailer read into a buffer of
    their own and opened into ``out`` (``open_sealed``); with ``keyless`` only the ciphertext
    checksums are checked and ``out`` holds the ciphertext (never serve it)."""
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


class _Buffers(threading.local):
    def __init__(self) -> None:
        self.header = bytearray()
        self.sealed = bytearray()


class SealedPages:
    """Seal and open the pages of one layout (module docstring)."""

    def __init__(self, ring: KeyRing, layout: PageLayout) -> None:
        self.ring, self.layout = ring, layout
        self._nbytes = layout.nbytes
        self._zero_sums = (0,) * len(layout.sections)
        self._local = _Buffers()

    def _buffers(self, header_len: int) -> tuple[memoryview, memoryview]:
        local = self._local
        if len(local.header) != header_len:
            local.header = bytearray(header_len)
        if not local.sealed:
            local.sealed = bytearray(self._nbytes + SEALED_TRAILER_LEN)
        return memoryview(local.header), memoryview(local.sealed)

    def seal(self, tmpl: HeaderTemplate, key: bytes, plaintext: memoryview,
             token_count: int) -> tuple[memoryview, memoryview]:
        """The header and the sealed payload (ciphertext, then the trailer) of a page whose
        plaintext (gaps zeroed by the caller) is ``plaintext``."""
        header, sealed = self._buffers(tmpl.header_len)
        tmpl.fill(header, key, token_count, self._zero_sums)
        self.ring.seal(header, plaintext, sealed, key)  # the key whose id starts the page key
        tmpl.fill(header, key, token_count, section_sums(self.layout.spans, sealed[:self._nbytes]))
        return header, sealed

    def open(self, fd: int, tmpl: HeaderTemplate, key: bytes, out: memoryview, path: str) -> bool:
        """Read the sealed page on ``fd`` (a file of exactly this writer's size) and open it into
        ``out``; False if its header is not byte for byte this writer's (nothing decrypted)."""
        header, sealed = self._buffers(tmpl.header_len)
        readinto_exact(fd, header, 0, path)
        sums = tmpl.parse(header, key)
        if sums is None:
            return False
        token_count = int.from_bytes(header[tmpl.token_off:tmpl.token_off + 4], "little")
        readinto_exact(fd, sealed, tmpl.header_len, path)
        tmpl.fill(header, key, token_count, self._zero_sums)
        open_sealed(self.ring, header, sealed, out, layout=self.layout, sums=sums, path=path, key=key)
        return True
