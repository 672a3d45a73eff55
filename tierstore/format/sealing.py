"""Opt-in encryption at rest: sealed page bodies and keyed page names (``encryption_key_file``).

Store path: the engine fills a page's plaintext in its staging slot, ``PageSealer.seal`` takes
a fresh 96-bit nonce (``_Nonces``: a random 64-bit prefix per thread and a counter), derives
the write's own AES-256 key from the fleet key and the nonce (``_aead``), encrypts the payload with AES-256-GCM into the
file buffer followed by its trailer (``TRAILER_LEN`` bytes: the GCM tag, ``b"TSENC"``, algorithm id, 2
reserved bytes, the key id, the nonce; the tag first, so ciphertext and tag are one span). The header then records checksums of the
*ciphertext* sections, so a reader without the key can still find damage, and nothing in the
file is a function of the plaintext that a guess could be checked against.
Load path: ``PageSealer.open`` checks the trailer's magic and key id, derives the same key and
decrypts into the caller's buffer; a tag that does not verify is ``PageUnauthenticated`` (kind
"mac": not verifiable with this key, never removed), never served bytes.

Authenticated data (``format.header.sealed_aad``): the whole header with its section checksums
and header checksum zeroed (namespace digest, page name, group, rank and head range, token
count, layout), followed by the trailer's magic, algorithm, key id and nonce: a page moved under
another name, rank, head range or namespace fails to open. Per-write keys: keyed BLAKE2b of
the nonce, so no two writes share an AES key and the 2^32 limit of random GCM nonces under one
key does not apply to a fleet (two writes share a key only if they share a nonce: a 64-bit
prefix drawn per thread, then a counter). Neither step releases the GIL (a 12-byte hash; no
getrandom per page): on the I/O threads each GIL hand-off per page costs throughput beside a
busy Python thread (docs/measurements/encryption.md).

Names (``KeyNamer``): with a key, a page's key, and so its file name and the key in its header,
is keyed BLAKE2b-256 of vLLM's block hash under a subkey of the fleet key: listing the export
says nothing about which prompts were cached, and no block hash is written under the root.
The scheduler and the worker both use the named key (``vllm.manager``), so nothing below them
changes. The key id (the first 8 bytes of a keyed digest of the key) enters the namespace, so
a root never mixes trees of two keys, or encrypted and plain ones.

The key file is exactly 32 random bytes (raw, or 64 hex digits), read through safefs and
checked like ``mac_key_file``: owned by the running user, not readable by others.

Threading: ``PageSealer`` and ``KeyNamer`` are immutable; every method is safe from any thread
(``cryptography``'s AES-GCM releases the GIL for large buffers).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import struct
import threading

from tierstore.errors import ConfigError
from tierstore.format.mac import PageUnauthenticated
from tierstore.fs import safefs

try:
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
except ImportError:  # optional: only an engine with encryption_key_file needs it
    AESGCM = None  # type: ignore[assignment,misc]
    InvalidTag = Exception  # type: ignore[assignment,misc]

KEY_BYTES = 32
KEY_ID_BYTES = 8
NONCE_BYTES = 12
TAG_BYTES = 16
ALG_AES256_GCM = 1
_MAGIC = b"TSENC"
_TRAILER = struct.Struct(f"<{TAG_BYTES}s5sB2x{KEY_ID_BYTES}s{NONCE_BYTES}s")
TRAILER_LEN = _TRAILER.size  # 44
_SETTING = '"encryption_key_file"'


class _Nonces(threading.local):
    """Unique 96-bit nonces without a syscall per page: a random 64-bit prefix per thread (drawn
    again when its 32-bit counter wraps), then the counter."""

    def __init__(self) -> None:
        self.prefix, self.count = os.urandom(8), 0

    def next(self) -> bytes:
        if self.count == 1 << 32:
            self.prefix, self.count = os.urandom(8), 0
        self.count += 1
        return self.prefix + (self.count - 1).to_bytes(4, "little")


_NONCES = _Nonces()
os.register_at_fork(after_in_child=_NONCES.__init__)  # a child never repeats its parent's nonces


def _derive(key: bytes, person: bytes, data: bytes = b"") -> bytes:
    return hashlib.blake2b(data, key=key, digest_size=32, person=person).digest()


def read_key_file(path: str | os.PathLike[str], setting: str = _SETTING) -> bytes:
    """The 32 key bytes of ``path`` (raw, or 64 hex digits and optional white space).

    Failure policy: ConfigError naming ``setting`` and what to do, for a file that is not a
    regular single-link file, not owned by the running user, readable or writable by others,
    or not 32 bytes."""
    where = os.fsdecode(path)
    raw = safefs.read_secret_file(path, what="key file", setting=setting, mode_mask=stat.S_IRWXO | stat.S_IWGRP,
                                  cap=4096)
    if len(raw) != KEY_BYTES:
        with contextlib.suppress(UnicodeDecodeError, ValueError):
            raw = bytes.fromhex(raw.decode("ascii").strip())
    if len(raw) != KEY_BYTES:
        raise ConfigError(f"the key file {where!r} (setting {setting}) must hold exactly {KEY_BYTES} random bytes "
                          f"(or {2 * KEY_BYTES} hex digits); make one with: head -c {KEY_BYTES} /dev/urandom > FILE "
                          "&& chmod 600 FILE")
    return raw


class KeyNamer:
    """A page's keyed name: keyed BLAKE2b-256 of its block hash (module docstring)."""

    def __init__(self, key: bytes) -> None:
        self._base = hashlib.blake2b(key=_derive(key, b"ts-names"), digest_size=32)

    def __call__(self, block_hash: bytes) -> bytes:
        h = self._base.copy()
        h.update(block_hash)
        return h.digest()


class PageSealer:
    """AES-256-GCM of page payloads under one fleet key (module docstring)."""

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ConfigError(f"an encryption key has exactly {KEY_BYTES} bytes, got {len(key)} "
                              f"(setting {_SETTING})")
        if AESGCM is None or not hasattr(AESGCM, "encrypt_into"):
            raise ConfigError(f"setting {_SETTING} needs the cryptography package, version 46 or later "
                              "(AES-GCM into a caller's buffer): pip install 'tierstore[encrypt]'")
        self._page_key = _derive(key, b"ts-page-keys")
        self.key_id = _derive(key, b"ts-key-id")[:KEY_ID_BYTES]
        self.namer = KeyNamer(key)

    @classmethod
    def from_key_file(cls, path: str | os.PathLike[str]) -> PageSealer:
        return cls(read_key_file(path))

    @property
    def namespace_marker(self) -> str:
        """What enters the namespace identity: the algorithm and the key id."""
        return f"aes-256-gcm/{self.key_id.hex()}"

    def _aead(self, nonce: bytes) -> AESGCM:
        """The AES-GCM of one write: its key is keyed BLAKE2b of the nonce."""
        return AESGCM(hashlib.blake2b(nonce, key=self._page_key, digest_size=32, person=b"ts-page-key").digest())

    def seal(self, aad: bytes | memoryview, plaintext: memoryview, out: memoryview) -> None:
        """Encrypt ``plaintext`` into ``out``: the ciphertext (as long as ``plaintext``), then
        the trailer (``len(out) == len(plaintext) + TRAILER_LEN``). ``aad``: the header with zero
        checksums (``format.header.sealed_aad``)."""
        n = len(plaintext)
        nonce = _NONCES.next()
        rest = _TRAILER.pack(b"", _MAGIC, ALG_AES256_GCM, self.key_id, nonce)[TAG_BYTES:]
        full_aad = bytes(aad) + rest
        self._aead(nonce).encrypt_into(nonce, plaintext, full_aad, out[: n + TAG_BYTES])
        out[n + TAG_BYTES:] = rest

    def open(self, aad: bytes | memoryview, sealed: memoryview, out: memoryview, *, path: str | None = None,
             key: bytes | None = None) -> None:
        """Decrypt ``sealed`` (ciphertext then trailer, as ``seal`` wrote it) into ``out``, or raise
        ``PageUnauthenticated`` (kind "mac": another key's page, a forged or moved one; ``out``
        then holds garbage)."""
        n = len(out)
        _tag, magic, alg, key_id, nonce = _TRAILER.unpack(bytes(sealed[n:]))
        if magic != _MAGIC or alg != ALG_AES256_GCM:
            raise PageUnauthenticated("page is not sealed by a known algorithm: not verifiable with this key",
                                      path=path, key=key)
        if key_id != self.key_id:
            raise PageUnauthenticated(f"page sealed under key id {key_id.hex()}, this node's is {self.key_id.hex()}: "
                                      "not verifiable with this key", path=path, key=key)
        full_aad = bytes(aad) + bytes(sealed[n + TAG_BYTES:])
        try:
            self._aead(nonce).decrypt_into(nonce, sealed[: n + TAG_BYTES], full_aad, out)
        except InvalidTag:
            raise PageUnauthenticated("encrypted page does not open with this key (another key's page, or moved "
                                      "or forged): not verifiable with this key", path=path, key=key) from None


def trailer_key_id(trailer: bytes | memoryview) -> bytes | None:
    """The key id a trailer names (None: not a sealed page's trailer); for fsck's report."""
    if len(trailer) != TRAILER_LEN:
        return None
    _tag, magic, _alg, key_id, _nonce = _TRAILER.unpack(bytes(trailer))
    return key_id if magic == _MAGIC else None


class KeyRing:
    """The keys of a fleet: the default one (``encryption_key_file``) and one per vLLM
    ``cache_salt`` (``tenant_key_files``, each a file the operator provides: tenants' keys are
    not derived from one master). A page key is the sealing key's id followed by that key's
    keyed name of the block hash (``page_key``), so a worker seals with the key the scheduler
    named the page under (``seal``) and a reader opens with the key the trailer names
    (``open``): a reader without that key gets ``PageUnauthenticated`` (a miss, never removed).
    Keys without a known id prefix (callers that name pages themselves) are sealed with the
    default key. Threading: immutable; safe from any thread."""

    def __init__(self, default: PageSealer, tenants: dict[str, PageSealer] | None = None) -> None:
        self.default = default
        self.tenants = dict(tenants or {})
        self.by_id = {s.key_id: s for s in (default, *self.tenants.values())}

    @classmethod
    def from_files(cls, default: str | os.PathLike[str], tenants: dict[str, str] | None = None) -> KeyRing:
        return cls(PageSealer.from_key_file(default),
                   {salt: PageSealer(read_key_file(path, f'"tenant_key_files" ({salt!r})'))
                    for salt, path in (tenants or {}).items()})

    @property
    def namespace_marker(self) -> str:
        """The namespace's record of the ring: the default key's (tenant keys come and go)."""
        return self.default.namespace_marker

    def sealer_for(self, salt: str | None) -> PageSealer | None:
        """The key of a request's ``cache_salt``: its tenant's, else the default; None for a
        salt that has no key while tenants have keys of their own (its pages are not cached:
        sealing them under the default key would let every tenant's key holders read them)."""
        if salt is None:
            return self.default
        sealer = self.tenants.get(salt)
        return sealer if sealer is not None or not self.tenants else None

    @staticmethod
    def page_key(sealer: PageSealer, block_hash: bytes) -> bytes:
        return sealer.key_id + sealer.namer(block_hash)

    def seal(self, aad: bytes | memoryview, plaintext: memoryview, out: memoryview, page_key: bytes) -> None:
        """``PageSealer.seal`` with the key whose id starts ``page_key`` (the default otherwise)."""
        self.by_id.get(bytes(page_key[:KEY_ID_BYTES]), self.default).seal(aad, plaintext, out)

    def open(self, aad: bytes | memoryview, sealed: memoryview, out: memoryview, *, path: str | None = None,
             key: bytes | None = None) -> None:
        """``PageSealer.open`` with the key the trailer names; ``PageUnauthenticated`` when this
        ring does not hold it."""
        key_id = trailer_key_id(sealed[len(out):])
        sealer = self.by_id.get(key_id) if key_id is not None else None
        if sealer is None:
            raise PageUnauthenticated(f"page sealed under key id {key_id.hex() if key_id else '?'}, which this node "
                                      "does not hold: not verifiable with its keys", path=path, key=key)
        sealer.open(aad, sealed, out, path=path, key=key)
