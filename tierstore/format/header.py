"""Page file format v3: the header of a page file (its preamble, key and section table), its
trailers' lengths, and the checks a header must pass before a payload is read.

Byte layout (all integers little-endian; documented in docs/DESIGN.md):

    preamble (72 bytes)
      0  8  magic  b"TSKVPAGE"
      8  2  format version (FORMAT_VERSION, 3)
     10  2  flags (FLAG_MAC, FLAG_SEALED or 0; readers reject unknown bits)
     12  4  header_len: payload starts here; a multiple of HEADER_ALIGN (4096)
     16  8  payload_len
     24 16  namespace digest
     40  4  group index        44 1 group kind         45 1 codec
     46  2  key length         48 4 token count        52 4 rank
     56  4  head start         60 4 head count         64 2 number of sections
     66  6  reserved (0)
     72  .  key bytes
      .  .  section table: per section u16 name length, name (utf-8), u8 dtype code, u8 ndim,
            ndim x u32 dims, u64 raw length, u64 stored offset (from payload start),
            u64 stored length, u64 xxh3-64 of the raw (uncompressed) bytes
      .  .  zero padding up to header_len - 8
      header_len - 8  8  xxh3-64 of header[0 : header_len - 8]
    payload: each section at its stored offset (format/page.py).
    trailer (only with flag FLAG_MAC, MAC_TRAILER_LEN bytes): the keyed tag of mac.PageMac over
            the header and the stored payload (opt-in fleet key, ``mac_key_file``).
    trailer (only with flag FLAG_SEALED, SEALED_TRAILER_LEN bytes): the payload is AES-256-GCM
            ciphertext (sealing.py, ``encryption_key_file``; codec NONE only), the section
            checksums are the ciphertext's, and the trailer holds the GCM tag, the key id and
            the nonce. The authenticated data is ``sealed_aad``: the header with every checksum
            zeroed. The canonical promise is then the plaintext's (the decrypted page buffer).

There are no timestamps or host names in a header: the same tokens give the same bytes.
``header_template.HeaderTemplate`` patches one writer's exact header in place; its offsets
come from the structs below (``PREAMBLE_OFFSETS``, ``encode_section_entry``).

Nothing here executes code from a file: the header is parsed with ``struct`` only, and a
header must be self-consistent (a checksum-valid crafted one too): sections inside the payload,
codec NONE sections at their layout offsets, and a page buffer of at most ``MAX_PAGE_BYTES``
(readers allocate the size a header declares), and a ZSTD payload of at most
``zstd_payload_bound(layout)`` bytes (``check_payload_bound``), so a reader never allocates
more than the layout it expects, whatever a header declares.
Threading: pure functions over immutable values; safe from any thread.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from functools import lru_cache

from tierstore.errors import (
    PageCorrupt,
    PageForeign,
    PageFormatError,
    PageKeyMismatch,
    PageTruncated,
)
from tierstore.format.checksums import checksum
from tierstore.format.page_layout import (
    DTYPES,
    PageLayout,
    SectionSpec,
    align_up,
    zstd_frame_bound,
    zstd_payload_bound,
)

MAGIC = b"TSKVPAGE"
# 2: the bytes of version 1 in a tree with one fan-out level (mapper.py).
# 3: alignment gaps are zero (canonical bytes, format/page.py) and readers reject non-zero ones.
# The namespace digest covers this number, so a tree of another version is another namespace:
# never read as ours (fsck reports it and leaves it alone; ``read_page`` refuses its pages).
FORMAT_VERSION = 3
HEADER_ALIGN = 4096
MAX_HEADER_LEN = 1 << 24  # a header larger than 16 MiB is garbage, not a page
# A page buffer larger than this is garbage or hostile, not a page: readers such as
# ``page_read.inspect_page`` allocate what a header declares, so the bound is checked here.
MAX_PAGE_BYTES = 64 << 30
FLAG_MAC = 0x1  # a MAC trailer follows the payload (mac.py)
FLAG_SEALED = 0x2  # the payload is encrypted; a sealing trailer follows it (sealing.py)
KNOWN_FLAGS = FLAG_MAC | FLAG_SEALED
MAC_TRAILER_LEN = 40  # mac.TRAILER_LEN (tests check they agree)
SEALED_TRAILER_LEN = 44  # sealing.TRAILER_LEN (tests check they agree)
# The preamble's fields in order (the table in the module docstring): one source for the
# struct and for the byte offset of each field (``PREAMBLE_OFFSETS``, used by HeaderTemplate).
_PREAMBLE_FIELDS = (
    ("magic", "8s"), ("version", "H"), ("flags", "H"), ("header_len", "I"), ("payload_len", "Q"),
    ("namespace", "16s"), ("group_index", "I"), ("group_kind", "B"), ("codec", "B"),
    ("key_len", "H"), ("token_count", "I"), ("rank", "I"), ("head_start", "I"),
    ("head_count", "I"), ("n_sections", "H"),
)
_PREAMBLE = struct.Struct("<" + "".join(f for _, f in _PREAMBLE_FIELDS) + "6x")
PREAMBLE_OFFSETS: dict[str, int] = {
    name: struct.calcsize("<" + "".join(f for _, f in _PREAMBLE_FIELDS[:i]))
    for i, (name, _) in enumerate(_PREAMBLE_FIELDS)
}
TOKEN_COUNT_FIELD = struct.Struct("<I")  # the preamble's token_count field
_SECTION_NAME_LEN = struct.Struct("<H")
_SECTION_FIXED = struct.Struct("<BB")
_SECTION_TAIL = struct.Struct("<QQQQ")  # raw length, stored offset, stored length, checksum
CHECKSUM_FIELD = struct.Struct("<Q")
PREAMBLE_LEN = _PREAMBLE.size  # 72


class Codec(IntEnum):
    NONE = 0
    ZSTD = 1


class GroupKind(IntEnum):
    """Kind of KV-cache group a page belongs to; decides how hits are computed."""

    ATTENTION = 0
    SLIDING_WINDOW = 1
    MAMBA = 2
    MLA = 3


# The section table's dtype codes (page_layout.DTYPES, part of the format) back to names.
_DTYPE_BY_CODE = {code: name for name, (code, _) in DTYPES.items()}


@dataclass(frozen=True)
class PageMeta:
    """Identity of one page: whose it is and which tokens it holds."""

    namespace: bytes  # 16-byte digest (identity.Namespace.digest_bytes)
    key: bytes  # full chunk key (the block hash that ends the chunk)
    group_index: int
    group_kind: GroupKind
    token_count: int
    rank: int = 0
    head_start: int = 0
    head_count: int = 0

    def __post_init__(self) -> None:
        if len(self.namespace) != 16:
            raise PageFormatError("namespace digest must be 16 bytes")
        if not 0 < len(self.key) <= 0xFFFF:
            raise PageFormatError("key must be 1..65535 bytes")


@dataclass(frozen=True)
class SectionEntry:
    spec: SectionSpec
    stored_offset: int
    stored_len: int
    checksum: int


@dataclass(frozen=True)
class PageHeader:
    meta: PageMeta
    codec: Codec
    sections: tuple[SectionEntry, ...]
    header_len: int
    payload_len: int
    flags: int = 0
    layout: PageLayout = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", PageLayout(tuple(e.spec for e in self.sections)))

    @property
    def has_mac(self) -> bool:
        return bool(self.flags & FLAG_MAC)

    @property
    def sealed(self) -> bool:
        return bool(self.flags & FLAG_SEALED)

    @property
    def file_size(self) -> int:
        return self.header_len + self.payload_len + trailer_len(self.flags)


@dataclass(frozen=True)
class PageExpectation:
    """What a reader expects a file to be; any disagreement is a typed error."""

    namespace: bytes
    key: bytes
    group_index: int
    rank: int = 0
    layout: PageLayout | None = None


def trailer_len(flags: int) -> int:
    """Bytes after the payload of a page with header ``flags``."""
    return (MAC_TRAILER_LEN if flags & FLAG_MAC else 0) + (SEALED_TRAILER_LEN if flags & FLAG_SEALED else 0)


def max_file_size(layout: PageLayout, header_len: int) -> int:
    """Largest valid file of a page of ``layout`` with an ``header_len``-byte header (either
    codec, with a MAC trailer): readers refuse a larger file before reading its payload."""
    return header_len + max(layout.nbytes, zstd_payload_bound(layout)) + max(MAC_TRAILER_LEN, SEALED_TRAILER_LEN)


def sealed_aad(header: PageHeader) -> bytes:
    """The authenticated data of a sealed page (sealing.py): its header as ``encode_header``
    writes it with every section checksum zero (``HeaderTemplate.fill`` with zero sums gives
    the same bytes)."""
    entries = [SectionEntry(e.spec, e.stored_offset, e.stored_len, 0) for e in header.sections]
    return encode_header(header.meta, header.codec, entries, header.payload_len, header.flags)


def encode_header(meta: PageMeta, codec: Codec, sections: Sequence[SectionEntry], payload_len: int,
                  flags: int = 0) -> bytes:
    """Serialize a header, padded to HEADER_ALIGN, with its checksum in the last 8 bytes.
    ``flags``: FLAG_MAC when a MAC trailer will follow the payload (0: the golden bytes)."""
    if flags & ~KNOWN_FLAGS:
        raise ValueError(f"unknown header flags {flags:#x}")
    table = b"".join(encode_section_entry(e) for e in sections)
    body_len = PREAMBLE_LEN + len(meta.key) + len(table) + CHECKSUM_FIELD.size
    header_len = align_up(body_len, HEADER_ALIGN)
    pre = _PREAMBLE.pack(
        MAGIC, FORMAT_VERSION, flags, header_len, payload_len, meta.namespace, meta.group_index,
        int(meta.group_kind), int(codec), len(meta.key), meta.token_count, meta.rank,
        meta.head_start, meta.head_count, len(sections),
    )
    buf = bytearray(header_len)
    pos = 0
    for part in (pre, meta.key, table):
        buf[pos : pos + len(part)] = part
        pos += len(part)
    buf[-8:] = CHECKSUM_FIELD.pack(checksum(memoryview(buf)[:-8]))
    return bytes(buf)


def encode_section_entry(e: SectionEntry) -> bytes:
    """One entry of the section table; its checksum is its last ``CHECKSUM_FIELD.size`` bytes."""
    name = e.spec.name.encode()
    return b"".join((
        _SECTION_NAME_LEN.pack(len(name)), name,
        _SECTION_FIXED.pack(DTYPES[e.spec.dtype][0], len(e.spec.shape)),
        struct.pack(f"<{len(e.spec.shape)}I", *e.spec.shape),
        _SECTION_TAIL.pack(e.spec.nbytes, e.stored_offset, e.stored_len, e.checksum),
    ))


def header_len_of(prefix: bytes | memoryview, *, path: str | None = None) -> int:
    """Header length announced by a file's first bytes; raises if they are not a page."""
    if len(prefix) < PREAMBLE_LEN:
        if len(prefix) == 0 or bytes(prefix[:len(MAGIC)]) == MAGIC[:len(prefix)]:
            raise PageTruncated(f"file has {len(prefix)} bytes, shorter than a page preamble", path=path)
        raise PageFormatError("not a tierstore page (bad magic)", path=path)
    magic, version, flags, header_len = struct.unpack_from("<8sHHI", prefix)
    if magic != MAGIC:
        raise PageFormatError("not a tierstore page (bad magic)", path=path)
    if version != FORMAT_VERSION:
        raise PageFormatError(f"unsupported page format version {version}; this tierstore reads {FORMAT_VERSION}", path=path)
    if flags & ~KNOWN_FLAGS:
        raise PageFormatError(f"unknown header flags {flags:#x}", path=path)
    if header_len % HEADER_ALIGN or not PREAMBLE_LEN < header_len <= MAX_HEADER_LEN:
        raise PageFormatError(f"bad header length {header_len}", path=path)
    return header_len


@lru_cache(maxsize=256)
def expected_header_len(layout: PageLayout, key_len: int) -> int:
    """The header length of every page of ``layout`` whose key is ``key_len`` bytes, of either
    codec: a section entry's size depends on its name and shape only, never on the codec."""
    table = sum(len(encode_section_entry(SectionEntry(sp, 0, 0, 0))) for sp in layout.sections)
    return align_up(PREAMBLE_LEN + key_len + table + CHECKSUM_FIELD.size, HEADER_ALIGN)


def check_header_shape(header: bytes | memoryview, header_len: int, layout: PageLayout, key_len: int, *,
                       path: str | None = None) -> None:
    """Refuse, before anything is parsed, a header whose length or section count is not the
    expected layout's (``header``: its ``header_len`` bytes, which passed ``header_len_of``).

    The parse is a Python loop over the declared sections, up to 65,535 of them (about 450 ms
    of GIL for a crafted, checksum-valid header); a reader that knows the layout it wants
    checks these two numbers first, so no header costs more to reject than one of its own
    pages costs to read. The header checksum is verified first (an xxh3 of the bytes, no
    parse), so damage is still told from a foreign page. Failure policy: ``PageCorrupt`` for a
    header checksum mismatch, else ``PageFormatError`` (not a page of this layout)."""
    view = memoryview(header)
    if len(view) < header_len:
        raise PageTruncated(f"file ends inside its {header_len}-byte header", path=path)
    (stored_sum,) = CHECKSUM_FIELD.unpack_from(view, header_len - 8)
    if checksum(view[: header_len - 8]) != stored_sum:
        raise PageCorrupt("header checksum mismatch", path=path)
    want = expected_header_len(layout, key_len)
    (nsec,) = struct.unpack_from("<H", view, PREAMBLE_OFFSETS["n_sections"])
    if header_len != want or nsec != len(layout.sections):
        raise PageFormatError(f"header of {header_len} bytes with {nsec} sections; pages of the expected layout "
                              f"have {want} bytes and {len(layout.sections)} sections: not parsed", path=path)


def decode_header(buf: bytes | memoryview, *, path: str | None = None) -> PageHeader:
    """Parse and verify a header. ``buf`` holds at least the whole header."""
    buf = memoryview(buf)
    return _checked_header(buf, header_len_of(buf, path=path), path)


def decode_header_any_version(buf: bytes | memoryview, *, path: str | None = None) -> tuple[int, PageHeader]:
    """(format version, header) of a page of any version with this header layout (1 to 3).

    For reports on older trees only (``fsck --deep``): nothing is ever served from such a page.
    Checks as ``decode_header`` except the version."""
    buf = memoryview(buf)
    if len(buf) < PREAMBLE_LEN or bytes(buf[: len(MAGIC)]) != MAGIC:
        raise PageFormatError("not a tierstore page (bad magic)", path=path)
    _, version, _, header_len = struct.unpack_from("<8sHHI", buf)
    if not 1 <= version <= FORMAT_VERSION:
        raise PageFormatError(f"unknown page format version {version}", path=path)
    patched = bytearray(buf[:PREAMBLE_LEN])
    struct.pack_into("<H", patched, 8, FORMAT_VERSION)
    header_len_of(patched, path=path)  # magic, flags, header length
    return version, _checked_header(buf, header_len, path)


def _checked_header(buf: memoryview, header_len: int, path: str | None) -> PageHeader:
    """The header of ``header_len`` bytes at the start of ``buf``, its checksum verified."""
    if len(buf) < header_len:
        raise PageTruncated(f"file ends inside its {header_len}-byte header", path=path)
    (stored_sum,) = CHECKSUM_FIELD.unpack_from(buf, header_len - 8)
    if checksum(buf[: header_len - 8]) != stored_sum:
        raise PageCorrupt("header checksum mismatch", path=path)
    try:
        return _parse_header(buf, header_len)
    except (struct.error, UnicodeDecodeError, ValueError, PageFormatError) as exc:
        # The checksum matched, so this is a writer bug or a crafted file, not bit rot.
        raise PageFormatError(f"inconsistent header: {exc}", path=path) from exc


def _parse_header(buf: memoryview, header_len: int) -> PageHeader:
    (_, _, flags, _, payload_len, ns, group_index, kind, codec, key_len, token_count, rank,
     head_start, head_count, nsec) = _PREAMBLE.unpack_from(buf, 0)
    pos = PREAMBLE_LEN
    key = bytes(buf[pos : pos + key_len])
    pos += key_len
    entries = []
    for _ in range(nsec):
        (name_len,) = _SECTION_NAME_LEN.unpack_from(buf, pos)
        pos += _SECTION_NAME_LEN.size
        name = bytes(buf[pos : pos + name_len]).decode()
        pos += name_len
        code, ndim = _SECTION_FIXED.unpack_from(buf, pos)
        pos += _SECTION_FIXED.size
        shape = struct.unpack_from(f"<{ndim}I", buf, pos)
        pos += 4 * ndim
        raw_len, off, stored_len, csum = _SECTION_TAIL.unpack_from(buf, pos)
        pos += _SECTION_TAIL.size
        if code not in _DTYPE_BY_CODE:
            raise ValueError(f"unknown dtype code {code}")
        spec = SectionSpec(name, _DTYPE_BY_CODE[code], tuple(shape))
        if spec.nbytes != raw_len:
            raise ValueError(f"section {name!r}: raw length {raw_len} != shape size {spec.nbytes}")
        if off + stored_len > payload_len:
            raise ValueError(f"section {name!r} runs past the payload")
        entries.append(SectionEntry(spec, off, stored_len, csum))
    if pos > header_len - 8:
        raise ValueError("section table runs past the header")
    meta = PageMeta(ns, key, group_index, GroupKind(kind), token_count, rank, head_start, head_count)
    header = PageHeader(meta, Codec(codec), tuple(entries), header_len, payload_len, flags)
    if header.layout.nbytes > MAX_PAGE_BYTES:
        raise ValueError(f"layout declares {header.layout.nbytes} bytes, more than any page ({MAX_PAGE_BYTES})")
    if header.sealed and (header.codec != Codec.NONE or header.flags & FLAG_MAC):
        raise ValueError("a sealed page is codec none and carries no MAC trailer")

    if header.codec == Codec.NONE:
        lay = header.layout
        if any(e.stored_offset != o or e.stored_len != e.spec.nbytes for e, o in zip(entries, lay.offsets, strict=True)):
            raise ValueError("uncompressed sections are not at their layout offsets")
        if payload_len != lay.nbytes:
            raise ValueError("payload length disagrees with the layout")
    return header


def check_payload_bound(header: PageHeader, *, path: str | None = None) -> None:
    """Raise PageFormatError unless a ZSTD header's payload and frames are no larger than zstd
    emits for its layout (``zstd_payload_bound``). Readers call it before allocating or reading
    the payload, after the layout was checked against the one they expect: what they allocate
    is then bounded by that layout, never by what a file declares."""
    if header.codec != Codec.ZSTD:
        return  # codec NONE: payload_len == layout.nbytes (``_parse_header``)
    bound = zstd_payload_bound(header.layout)
    if header.payload_len > bound:
        raise PageFormatError(f"zstd payload of {header.payload_len} bytes, more than zstd emits for the "
                              f"page's layout ({bound}); not a page this tierstore wrote", path=path,
                              key=header.meta.key)
    for e in header.sections:
        if e.stored_len > zstd_frame_bound(e.spec.nbytes):
            raise PageFormatError(f"section {e.spec.name!r}: zstd frame of {e.stored_len} bytes for "
                                  f"{e.spec.nbytes} raw bytes", path=path, key=header.meta.key)


def check_expectation(header: PageHeader, expect: PageExpectation, *, path: str | None = None) -> None:
    """Raise unless the header is the page the reader asked for."""
    m = header.meta
    if m.namespace != expect.namespace:
        raise PageForeign(f"page belongs to namespace {m.namespace.hex()}, expected {expect.namespace.hex()}", path=path, key=expect.key)
    if m.key != expect.key or m.group_index != expect.group_index or m.rank != expect.rank:
        raise PageKeyMismatch(
            f"file holds key {m.key.hex()[:16]}.. group {m.group_index} rank {m.rank}, "
            f"expected key {expect.key.hex()[:16]}.. group {expect.group_index} rank {expect.rank}",
            path=path, key=expect.key,
        )
    if expect.layout is not None and header.layout != expect.layout:
        raise PageFormatError("page layout differs from the namespace's layout", path=path, key=expect.key)

