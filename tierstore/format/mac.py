"""Opt-in page authentication: a keyed MAC over a page's header and payload (fleet secret).

Threat model (docs/DESIGN.md gets the long form): xxh3 checksums detect accidents (bit rot,
torn writes), not forgery: anyone who can write the root can write a page with valid checksums.
With a key file configured, every page carries a tag (``TRAILER_LEN`` bytes:
``b"TSMAC"``, algorithm id, 2 reserved bytes, 32-byte tag) computed over the whole header and the
stored payload, and a reader serves a page only if the tag verifies; a user without the key
can delete or replay pages of the same fleet key, never forge one. A writer with the key can
still write any page (the key is the fleet's identity), and an old page of the same key stays
valid (no freshness).

Algorithms (``PageMac.algorithm``): keyed BLAKE3 when the ``blake3`` package is installed,
otherwise keyed BLAKE2b (hashlib), with a warning once per process naming ``pip install
blake3``. Measured on 2 MiB pages by ``python -m tierstore.format.mac``;
HMAC-SHA256 is the slowest of the three and is not offered. Both keyed hashes release the GIL
for large buffers. A verifier accepts either algorithm (neither is forgeable without the key).
The key file is read through safefs (regular file, one link, at most 4 KiB), must be owned by the
running user and not world-readable; its bytes (hex text or raw, at least 16 bytes) are
hashed to a 32-byte key.

Threading: a ``PageMac`` is immutable; ``tag``/``verify`` are safe from any thread.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
import struct
import sys
import threading
import time
from collections.abc import Iterable

from tierstore.errors import ConfigError, PageCorrupt
from tierstore.fs import safefs

try:
    import blake3 as _blake3
except ImportError:  # optional: BLAKE2b is the fallback
    _blake3 = None

logger = logging.getLogger(__name__)

TAG_LEN = 32
_MAGIC = b"TSMAC"
_TRAILER = struct.Struct(f"<5sB2x{TAG_LEN}s")
TRAILER_LEN = _TRAILER.size  # 40
ALG_BLAKE2B = 1
ALG_BLAKE3 = 2
_NAMES = {ALG_BLAKE2B: "blake2b", ALG_BLAKE3: "blake3"}
MAX_KEY_FILE = 4096
MIN_KEY_BYTES = 16
_LEN = struct.Struct("<Q")

Payload = bytes | bytearray | memoryview | Iterable[bytes | bytearray | memoryview]


class PageUnauthenticated(PageCorrupt):
    """A key is configured and the page's tag does not verify with it (no tag, another key's
    tag, an algorithm not installed here): never served, and never removed either
    (``errors.UNVERIFIABLE_KINDS``: not verifiable with this key is not damage)."""

    kind = "mac"


def _pieces(payload: Payload) -> Iterable[bytes | bytearray | memoryview]:
    return (payload,) if isinstance(payload, (bytes, bytearray, memoryview)) else payload


_fallback_warned = threading.Event()


def warn_blake2b_fallback() -> None:
    """Warn, once per process, that tags are written with keyed BLAKE2b because the ``blake3``
    package is missing: several times slower per CPU-second, so a MAC on a fast path costs
    many more cores. Called when a ``PageMac`` picks its algorithm (a node starting with a key).

    Failure policy: none (a log record; the BLAKE2b MAC is as unforgeable as BLAKE3's)."""
    if _fallback_warned.is_set():
        return
    _fallback_warned.set()
    logger.warning("tierstore: the blake3 package is not installed, so page MACs (setting \"mac_key_file\") use "
                   "keyed BLAKE2b, several times slower per CPU-second than BLAKE3: pip install blake3")


class PageMac:
    def __init__(self, key: bytes, algorithm: int | None = None):
        if len(key) < MIN_KEY_BYTES:
            raise ConfigError(f"the fleet key must have at least {MIN_KEY_BYTES} bytes, got {len(key)}")
        self._key = hashlib.blake2b(key, digest_size=32, person=b"tierstore-mac").digest()
        if algorithm is None:
            algorithm = ALG_BLAKE3 if _blake3 is not None else ALG_BLAKE2B
            if _blake3 is None:
                warn_blake2b_fallback()
        if algorithm == ALG_BLAKE3 and _blake3 is None:
            raise ConfigError("mac algorithm blake3 needs the blake3 package (pip install blake3)")
        self.algorithm = algorithm

    @classmethod
    def from_key_file(cls, path: str | os.PathLike[str], algorithm: int | None = None) -> PageMac:
        """Read the fleet key from ``path`` (see the module docstring for the checks)."""
        raw = safefs.read_secret_file(path, what="fleet key file", setting='"mac_key_file"',
                                      mode_mask=stat.S_IROTH | stat.S_IWOTH | stat.S_IWGRP, cap=MAX_KEY_FILE)
        text = raw.strip()
        try:
            key = bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            key = raw
        return cls(key, algorithm)

    @property
    def name(self) -> str:
        return _NAMES[self.algorithm]

    def _digest(self, algorithm: int, header: bytes | memoryview, payload: Payload) -> bytes:
        if algorithm == ALG_BLAKE3:
            if _blake3 is None:
                raise PageUnauthenticated("page tagged with blake3, which is not installed here: not verifiable on "
                                          "this node (pip install 'tierstore[mac]', or the blake3 package)")
            h = _blake3.blake3(key=self._key)
        else:
            h = hashlib.blake2b(key=self._key, digest_size=TAG_LEN)
        h.update(_LEN.pack(len(header)))
        h.update(header)
        for piece in _pieces(payload):
            h.update(piece)
        return h.digest()

    def tag(self, header_bytes: bytes | memoryview, payload: Payload) -> bytes:
        """The trailer to append after the payload (``TRAILER_LEN`` bytes)."""
        return _TRAILER.pack(_MAGIC, self.algorithm, self._digest(self.algorithm, header_bytes, payload))

    def verify(self, header_bytes: bytes | memoryview, payload: Payload, trailer: bytes | memoryview | None,
               *, path: str | None = None) -> None:
        """Raise ``PageUnauthenticated`` unless ``trailer`` is a valid tag of header + payload."""
        if trailer is None or len(trailer) != TRAILER_LEN:
            raise PageUnauthenticated("page has no MAC tag (a fleet key is configured): not verifiable with this "
                                      "key", path=path)
        magic, algorithm, tag = _TRAILER.unpack(bytes(trailer))
        if magic != _MAGIC:
            raise PageUnauthenticated("page has no MAC tag (a fleet key is configured): not verifiable with this "
                                      "key", path=path)
        if algorithm not in _NAMES:
            raise PageUnauthenticated(f"MAC tag of unknown algorithm {algorithm} (a newer tierstore's?): not "
                                      "verifiable here", path=path)
        try:
            digest = self._digest(algorithm, header_bytes, payload)
        except PageUnauthenticated as exc:
            exc.path = path
            raise
        if not hmac.compare_digest(tag, digest):
            raise PageUnauthenticated("MAC tag mismatch: not written with this fleet key (another key's page, "
                                      "or forged); not verifiable with this key", path=path)


def bench(page_bytes: int = 2 << 20, repeats: int = 50) -> dict[str, float]:
    """Microseconds per page for each candidate (HMAC-SHA256 for comparison)."""
    buf = os.urandom(page_bytes)
    key = os.urandom(32)
    cands = {"blake2b": lambda: hashlib.blake2b(buf, key=key, digest_size=32).digest(),
             "hmac-sha256": lambda: hmac.new(key, buf, hashlib.sha256).digest()}
    if _blake3 is not None:
        cands["blake3"] = lambda: _blake3.blake3(buf, key=key).digest()
    out = {}
    for name, fn in cands.items():
        fn()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        out[name] = (time.perf_counter() - t0) / repeats * 1e6
    return out


if __name__ == "__main__":
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 2 << 20
    for alg, us in bench(size).items():
        print(f"{alg:12s} {us:9.1f} us per {size >> 10} KiB page  {size / us / 1e3:7.2f} GB/s")
