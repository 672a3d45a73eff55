"""SealedPages: the file bytes of one rank directory's sealed pages (``encryption_key_file``).

Store path: ``seal`` fills the header with zero checksums (the authenticated data,
``format.sealed_aad``), encrypts the slot's plaintext after it (``sealing.KeyRing.seal``, the key the page key names:
ciphertext, then the trailer) and fills the header again with the ciphertext's checksums;
``PageFiles`` publishes the two buffers. Load path: ``open`` reads the header, accepts it only
if it is byte for byte this writer's (``HeaderTemplate.parse``; anything else goes to the
general reader, which names why), reads the ciphertext and trailer, and decrypts into the slot
(``pageops.open_sealed``: the tag, then the plaintext's zero gaps). Failure policy: a typed
``PageError`` (``PageUnauthenticated`` for a page this key does not open, never removed).

Threading: any number of I/O threads at once; each has its own two buffers (a header and a
page's ciphertext plus trailer, allocated at its first page), valid until its next call.
"""

from __future__ import annotations

import threading

from tierstore.format.page import SEALED_TRAILER_LEN, HeaderTemplate, PageLayout, section_sums
from tierstore.format.sealing import KeyRing
from tierstore.rootstore import pageops


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
        pageops.readinto_exact(fd, header, 0, path)
        sums = tmpl.parse(header, key)
        if sums is None:
            return False
        token_count = int.from_bytes(header[tmpl.token_off:tmpl.token_off + 4], "little")
        pageops.readinto_exact(fd, sealed, tmpl.header_len, path)
        tmpl.fill(header, key, token_count, self._zero_sums)
        pageops.open_sealed(self.ring, header, sealed, out, layout=self.layout, sums=sums, path=path, key=key)
        return True
