"""Page file format v3: the bytes of one page file, and nothing about where it lives.

A page is one KV-cache group x one stored chunk x all layers of that group (x one rank's
slice). Its payload is the concatenation of named, typed sections (``PageLayout``); the
header describes everything needed to check the file without vLLM. Byte layout (all
integers little-endian; documented in docs/DESIGN.md):

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
    payload: each section at its stored offset (multiples of SECTION_ALIGN), gaps zero.
    trailer (only with flag FLAG_MAC, MAC_TRAILER_LEN bytes): the keyed tag of mac.PageMac over
            the header and the stored payload (opt-in fleet key, ``mac_key_file``).
    trailer (only with flag FLAG_SEALED, SEALED_TRAILER_LEN bytes): the payload is AES-256-GCM
            ciphertext (sealing.py, ``encryption_key_file``; codec NONE only), the section
            checksums are the ciphertext's, and the trailer holds the GCM tag, the key id and
            the nonce. The authenticated data is ``sealed_aad``: the header with every checksum
            zeroed. The canonical promise is then the plaintext's (the decrypted page buffer).

With codec NONE the payload is byte-for-byte the page buffer of ``PageLayout`` (same offsets),
so a load is one ``readinto`` plus checksums. With codec ZSTD each section is one zstd frame,
at the first SECTION_ALIGN multiple after the previous frame.
There are no timestamps or host names in a page: the same tokens give the same bytes.
``HeaderTemplate`` is one writer's exact codec-NONE header with the variable fields (key, token
count, checksums) patched in place; its offsets come from the structs below.

Canonical bytes (format 3). Every byte of a file is determined by the page's content: the
alignment gaps between sections (``PageLayout.gaps``, < SECTION_ALIGN bytes each; in a ZSTD
payload the padding between frames) are zero. Writers: every copy into a page buffer writes
its gaps (``kernels.GroupCopier.gather`` on both backends zeroes them in the same pass;
``decode_payload`` zeroes them in its output), and ``encode_page`` zeroes them in what it
writes whatever its input held. Readers reject a file whose gap bytes are not zero
(``check_gaps``, called by ``decode_payload``, hence by ``pagefile.read_page`` and fsck):
section checksums do not cover the gaps, so this check is what keeps a stale byte (a previous
page's, possibly another tenant's) from travelling through a shared tree unnoticed. Format 2
did not zero the gaps of layouts that have any (Mamba/GDN states whose size is not a multiple
of SECTION_ALIGN); its trees are another namespace and are refused (see FORMAT_VERSION).
The files under tests/golden/ pin these bytes: a change that alters them must change
FORMAT_VERSION (``python -m tierstore.testing.golden --write`` regenerates them).

Nothing here executes code from a file: the header is parsed with ``struct`` only, and a
header must be self-consistent (a checksum-valid crafted one too): sections inside the payload,
codec NONE sections at their layout offsets, and a page buffer of at most ``MAX_PAGE_BYTES``
(readers allocate the size a header declares), and a ZSTD payload of at most
``zstd_payload_bound(layout)`` bytes (what zstd can emit for the layout's sections), so a reader
never allocates more than the layout it expects, whatever a header or a frame declares
(frames are decoded by ``safe_zstd`` into the page buffer, with a hard output cap).
Threading: pure functions over immutable values; safe from any thread. A ZSTD compressor or
decompressor object must not be shared between threads (callers pass their own).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from functools import cached_property, lru_cache

import xxhash

from tierstore.errors import (
    PageCorrupt,
    PageForeign,
    PageFormatError,
    PageKeyMismatch,
    PageTruncated,
)
from tierstore.format import safe_zstd

MAGIC = b"TSKVPAGE"
# 2: the bytes of version 1 in a tree with one fan-out level (mapper.py).
# 3: alignment gaps are zero (canonical bytes, see above) and readers reject non-zero ones.
# The namespace digest covers this number, so a tree of another version is another namespace:
# never read as ours (fsck reports it and leaves it alone; ``read_page`` refuses its pages).
FORMAT_VERSION = 3
HEADER_ALIGN = 4096
SECTION_ALIGN = 64
MAX_HEADER_LEN = 1 << 24  # a header larger than 16 MiB is garbage, not a page
# A page buffer larger than this is garbage or hostile, not a page: readers such as
# ``pagefile.inspect_page`` allocate what a header declares, so the bound is checked here.
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
_TOKEN_COUNT = struct.Struct("<I")  # the preamble's token_count field
_SECTION_NAME_LEN = struct.Struct("<H")
_SECTION_FIXED = struct.Struct("<BB")
_SECTION_TAIL = struct.Struct("<QQQQ")  # raw length, stored offset, stored length, checksum
_CHECKSUM = struct.Struct("<Q")
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


# dtype name -> (code, itemsize). Codes are part of the format: never renumber.
DTYPES: dict[str, tuple[int, int]] = {
    "uint8": (1, 1),
    "int8": (2, 1),
    "float16": (3, 2),
    "bfloat16": (4, 2),
    "float32": (5, 4),
    "float8_e4m3fn": (6, 1),
    "float8_e5m2": (7, 1),
    "int32": (8, 4),
    "int64": (9, 8),
    "float64": (10, 8),
    "int16": (11, 2),
    "float8_e4m3fnuz": (12, 1),
    "float8_e5m2fnuz": (13, 1),
}
_DTYPE_BY_CODE = {code: name for name, (code, _) in DTYPES.items()}


def checksum(data: bytes | memoryview) -> int:
    """xxh3-64 of ``data`` (the checksum used for sections and headers)."""
    return xxhash.xxh3_64_intdigest(data)


# A hasher of many spans in one GIL-free call, installed by ``native.loader`` once its kernels
# are compiled (None before, or without numba): this module describes bytes and imports no I/O
# layer; the layer that can hash faster plugs in here. It returns None to decline (small spans).
SpanHasher = Callable[[Sequence[tuple[int, int]], memoryview, int, int], "list[int] | None"]
_span_hasher: SpanHasher | None = None


def install_span_hasher(hasher: SpanHasher) -> None:
    """Hash sections with ``hasher`` from now on (``native.loader``, after its self-check)."""
    global _span_hasher
    _span_hasher = hasher


def section_sums(spans: Sequence[tuple[int, int]], data: memoryview, first: int = 0,
                 end: int | None = None) -> list[int]:
    """``checksum`` of ``data[o:e]`` for the spans ``first`` to ``end``, equal to
    ``[checksum(data[o:e]) ...]`` byte for byte. The I/O threads' hot path: once the native
    kernels are compiled, large spans are hashed in one GIL-free call (``install_span_hasher``)."""
    end = len(spans) if end is None else end
    if _span_hasher is not None:
        got = _span_hasher(spans, data, first, end)
        if got is not None:
            return got
    return [checksum(data[o:e]) for o, e in spans[first:end]]


U64_MASK = (1 << 64) - 1


def checksum_as_int64(value: int) -> int:
    """A checksum (or any 64-bit pattern) as the int64 with the same bits: device tensors hold
    int64; ``v & U64_MASK`` turns it back."""
    value &= U64_MASK
    return value - (1 << 64) if value >= 1 << 63 else value


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def zstd_frame_bound(raw_len: int) -> int:
    """Largest zstd frame for ``raw_len`` input bytes (ZSTD_COMPRESSBOUND) plus the frame
    header and checksum room: what a writer can legitimately produce."""
    small = ((128 << 10) - raw_len) >> 11 if raw_len < (128 << 10) else 0
    return raw_len + (raw_len >> 8) + small + 64


def zstd_payload_bound(layout: PageLayout) -> int:
    """Largest ZSTD payload of a page of ``layout`` (each frame at most ``zstd_frame_bound``,
    aligned to SECTION_ALIGN)."""
    return sum(_align(zstd_frame_bound(s.nbytes), SECTION_ALIGN) for s in layout.sections)


def max_file_size(layout: PageLayout, header_len: int) -> int:
    """Largest valid file of a page of ``layout`` with an ``header_len``-byte header (either
    codec, with a MAC trailer): readers refuse a larger file before reading its payload."""
    return header_len + max(layout.nbytes, zstd_payload_bound(layout)) + max(MAC_TRAILER_LEN, SEALED_TRAILER_LEN)


@dataclass(frozen=True)
class SectionSpec:
    """One named tensor of a page: for example one layer's K/V block or one Mamba state."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise PageFormatError(f"unknown dtype {self.dtype!r}; known: {sorted(DTYPES)}")
        if not self.name or len(self.name.encode()) > 0xFFFF:
            raise PageFormatError(f"bad section name {self.name!r}")
        if len(self.shape) > 255 or any(d < 0 or d > 0xFFFFFFFF for d in self.shape):
            raise PageFormatError(f"bad section shape {self.shape!r}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class PageLayout:
    """The ordered sections of a page and their offsets in a page buffer."""

    sections: tuple[SectionSpec, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "sections", tuple(self.sections))
        names = [s.name for s in self.sections]
        if len(set(names)) != len(names):
            raise PageFormatError(f"duplicate section names in layout: {names}")
        if len(self.sections) > 0xFFFF:
            raise PageFormatError("too many sections in one page")

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        out, pos = [], 0
        for s in self.sections:
            out.append(pos)
            pos = _align(pos + s.nbytes, SECTION_ALIGN)
        return tuple(out)

    @cached_property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """(start, end) of each section in a page buffer."""
        return tuple((o, o + s.nbytes) for o, s in zip(self.offsets, self.sections, strict=True))

    @cached_property
    def gaps(self) -> tuple[tuple[int, int], ...]:
        """(start, end) of each non-empty alignment gap between sections in a page buffer;
        canonical pages hold zeros there (< SECTION_ALIGN bytes each)."""
        spans = self.spans
        return tuple((e, o) for (_, e), (o, _) in zip(spans, spans[1:], strict=False) if o > e)

    @cached_property
    def nbytes(self) -> int:
        """Bytes of a page buffer (sections at ``offsets``, the last one unpadded)."""
        if not self.sections:
            return 0
        return self.offsets[-1] + self.sections[-1].nbytes

    @property
    def data_bytes(self) -> int:
        """Bytes of tensor data, without alignment padding."""
        return sum(s.nbytes for s in self.sections)

    def index(self, name: str) -> int:
        for i, s in enumerate(self.sections):
            if s.name == name:
                return i
        raise KeyError(name)


def section_checksums(layout: PageLayout, data: memoryview) -> tuple[int, ...]:
    """The checksum of each section of a page buffer of ``layout`` (what the header records)."""
    return tuple(section_sums(layout.spans, memoryview(data).cast("B")))


_ZERO_GAP = bytes(SECTION_ALIGN)  # the only content a gap may have (gaps are < SECTION_ALIGN)


def nonzero_gap(layout: PageLayout, buf: bytes | memoryview) -> tuple[int, int] | None:
    """The first alignment gap of a page buffer of ``layout`` holding a non-zero byte, or None."""
    view = memoryview(buf).cast("B")
    for a, b in layout.gaps:
        if view[a:b] != _ZERO_GAP[: b - a]:
            return a, b
    return None


def zero_gaps(layout: PageLayout, buf: memoryview | bytearray) -> None:
    """Write zeros into every alignment gap of a writable page buffer of ``layout``."""
    view = memoryview(buf).cast("B")
    for a, b in layout.gaps:
        view[a:b] = _ZERO_GAP[: b - a]


def check_gaps(layout: PageLayout, buf: bytes | memoryview, *, path: str | None = None,
               key: bytes | None = None) -> None:
    """Raise PageCorrupt unless every alignment gap of the page buffer ``buf`` is zero.

    The cheap reader check of canonical bytes (at most SECTION_ALIGN - 1 bytes per section):
    a non-zero gap byte is damage the section checksums do not see, or a file from a writer
    that does not zero gaps (format 2 and older, or a bug); such a file is never served.
    """
    bad = nonzero_gap(layout, buf)
    if bad is not None:
        a, b = bad
        name = layout.sections[[e for _, e in layout.spans].index(a)].name
        raise PageCorrupt(f"non-zero bytes in the alignment gap after section {name!r} (page bytes {a}..{b}): "
                          "not a canonical format-3 page (damaged, or written by a writer that does not "
                          "zero gaps); it is not served", path=path, key=key)


def check_stored_gaps(header: PageHeader, payload: bytes | memoryview, *, path: str | None = None) -> None:
    """Raise unless a stored payload is canonical outside its sections: codec NONE, the layout's
    gaps are zero; codec ZSTD, each frame starts at the first SECTION_ALIGN multiple after the
    previous one (PageFormatError otherwise), the padding is zero (PageCorrupt otherwise) and
    the payload ends with the last frame."""
    view = memoryview(payload).cast("B")
    if header.codec == Codec.NONE:
        check_gaps(header.layout, view, path=path, key=header.meta.key)
        return
    pos = 0
    for e in header.sections:
        start = _align(pos, SECTION_ALIGN)
        if e.stored_offset != start:
            raise PageFormatError(f"section {e.spec.name!r}: zstd frame at payload offset {e.stored_offset}, "
                                  f"the canonical place is {start}", path=path, key=header.meta.key)
        if view[pos:start] != _ZERO_GAP[: start - pos]:
            raise PageCorrupt(f"non-zero padding before the zstd frame of section {e.spec.name!r}: not a "
                              "canonical format-3 page; it is not served", path=path, key=header.meta.key)
        pos = start + e.stored_len
    if header.payload_len != pos:
        raise PageFormatError(f"payload runs {header.payload_len - pos} bytes past its last zstd frame",
                              path=path, key=header.meta.key)


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
    table = b"".join(_encode_section_entry(e) for e in sections)
    body_len = PREAMBLE_LEN + len(meta.key) + len(table) + _CHECKSUM.size
    header_len = _align(body_len, HEADER_ALIGN)
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
    buf[-8:] = _CHECKSUM.pack(checksum(memoryview(buf)[:-8]))
    return bytes(buf)


def _encode_section_entry(e: SectionEntry) -> bytes:
    """One entry of the section table; its checksum is its last ``_CHECKSUM.size`` bytes."""
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
    table = sum(len(_encode_section_entry(SectionEntry(sp, 0, 0, 0))) for sp in layout.sections)
    return _align(PREAMBLE_LEN + key_len + table + _CHECKSUM.size, HEADER_ALIGN)


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
    (stored_sum,) = _CHECKSUM.unpack_from(view, header_len - 8)
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
    (stored_sum,) = _CHECKSUM.unpack_from(buf, header_len - 8)
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


def encode_page(
    meta: PageMeta,
    layout: PageLayout,
    data: bytes | memoryview,
    codec: Codec = Codec.NONE,
    compressor: object | None = None,
    flags: int = 0,
) -> tuple[bytes, list[memoryview | bytes]]:
    """Build the header and payload pieces of a page from a page buffer of ``layout``.

    With codec NONE the payload is ``data`` itself (zero-copy) when its alignment gaps are zero,
    else a copy with zero gaps: the file is canonical whatever the gaps of ``data`` held.
    ``compressor`` is a ``zstandard.ZstdCompressor`` owned by the calling thread (required for
    ZSTD; frames depend on its level and on the zstd library version). ``flags``: FLAG_MAC when
    the caller appends a MAC trailer (``mac.PageMac.tag`` over the header and the pieces).
    """
    data = memoryview(data).cast("B")
    if len(data) != layout.nbytes:
        raise ValueError(f"page buffer has {len(data)} bytes, layout needs {layout.nbytes}")
    if codec == Codec.NONE and nonzero_gap(layout, data) is not None:
        # Canonical bytes whatever the caller's buffer held in its gaps (a reused buffer): the
        # file gets a copy with zero gaps; the caller's buffer is left as it is.
        canon = bytearray(data)
        zero_gaps(layout, canon)
        data = memoryview(canon)
    entries: list[SectionEntry] = []
    pieces: list[memoryview | bytes] = []
    if codec == Codec.NONE:
        for spec, off, c in zip(layout.sections, layout.offsets, section_checksums(layout, data), strict=True):
            entries.append(SectionEntry(spec, off, spec.nbytes, c))
        pieces.append(data)
        payload_len = layout.nbytes
    elif codec == Codec.ZSTD:
        if compressor is None:
            raise ValueError("codec ZSTD needs a compressor")
        pos = 0
        for spec, off in zip(layout.sections, layout.offsets, strict=True):
            raw = data[off : off + spec.nbytes]
            frame = compressor.compress(raw)  # type: ignore[attr-defined]
            start = _align(pos, SECTION_ALIGN)
            if start != pos:
                pieces.append(bytes(start - pos))
            entries.append(SectionEntry(spec, start, len(frame), checksum(raw)))
            pieces.append(frame)
            pos = start + len(frame)
        payload_len = pos
    else:
        raise ValueError(f"unknown codec {codec!r}")
    return encode_header(meta, codec, entries, payload_len, flags), pieces


def decode_payload(
    header: PageHeader,
    payload: memoryview | None,
    out: memoryview,
    decompressor: object | None = None,
    *,
    path: str | None = None,
) -> None:
    """Verify every section of ``payload`` and leave the page buffer in ``out``.

    With codec NONE, ``payload=None`` means the payload was read straight into ``out``
    (verify in place, no copy). Raises PageCorrupt on the first bad section or on non-zero
    gap bytes (``check_stored_gaps``; PageFormatError for misplaced zstd frames); ``out`` then
    holds garbage and must not be used. On success the gaps of ``out`` are zero.
    ZSTD frames are decoded by ``safe_zstd.decompress_into`` straight into ``out`` (a frame
    declaring another size than its section is refused before anything is allocated);
    ``decompressor`` is accepted for compatibility and unused.
    """
    out = memoryview(out).cast("B")
    if len(out) != header.layout.nbytes:
        raise ValueError(f"output buffer has {len(out)} bytes, page needs {header.layout.nbytes}")
    if header.codec == Codec.NONE and payload is None:
        check_gaps(header.layout, out, path=path, key=header.meta.key)
    else:
        if payload is not None:
            check_stored_gaps(header, payload, path=path)
        zero_gaps(header.layout, out)  # the output's gaps may hold an earlier page's bytes
    for e, off in zip(header.sections, header.layout.offsets, strict=True):
        raw_len = e.spec.nbytes
        if header.codec == Codec.NONE:
            if payload is not None:
                out[off : off + raw_len] = payload[e.stored_offset : e.stored_offset + raw_len]
        else:
            if payload is None:
                raise ValueError("codec ZSTD needs the stored payload")
            frame = payload[e.stored_offset : e.stored_offset + e.stored_len]
            try:  # straight into the page buffer, never more than the section (safe_zstd.py)
                safe_zstd.decompress_into(frame, out[off : off + raw_len], path=path)
            except PageCorrupt as exc:
                raise PageCorrupt(f"section {e.spec.name!r}: {exc.message}", path=path, key=header.meta.key) from exc
        if checksum(out[off : off + raw_len]) != e.checksum:
            raise PageCorrupt(f"section {e.spec.name!r} checksum mismatch", path=path)


class HeaderTemplate:
    """The exact codec-NONE header of one writer's pages for one key length.

    A writer's pages (same namespace, group, rank, head slice and layout) differ only in the
    key, the token count, the section checksums and the header checksum. ``fill`` patches those
    into a copy of the template; ``parse`` accepts a header only if everything else is byte for
    byte the template's (any other header goes through ``decode_header``, which names the
    error). Every offset comes from this module's own structs (``PREAMBLE_OFFSETS``,
    ``_encode_section_entry``), so the template cannot drift from ``encode_header``.
    Threading: immutable after construction; safe from any thread.
    """

    def __init__(self, proto: PageMeta, layout: PageLayout, flags: int = 0) -> None:
        """``proto``: the writer's identity; only the length of its key matters. ``flags``:
        FLAG_MAC for a writer with a fleet key (the trailer is not part of the template)."""
        key_len = len(proto.key)
        meta = PageMeta(proto.namespace, b"\0" * key_len, proto.group_index, proto.group_kind, 0,
                        proto.rank, proto.head_start, proto.head_count)
        entries = [SectionEntry(sp, o, sp.nbytes, 0) for sp, o in zip(layout.sections, layout.offsets, strict=True)]
        self.blank = encode_header(meta, Codec.NONE, entries, layout.nbytes, flags)  # key, counts, sums: 0
        self.header_len = hl = len(self.blank)
        self.key_len = key_len
        self._key_off = PREAMBLE_LEN
        self._token_off = PREAMBLE_OFFSETS["token_count"]
        self._sum_off = hl - _CHECKSUM.size
        offs, pos = [], PREAMBLE_LEN + key_len
        for e in entries:
            pos += len(_encode_section_entry(e))
            offs.append(pos - _CHECKSUM.size)  # the entry's checksum is its last field
        self.sum_offsets: list[int] = offs
        variable = sorted([(self._key_off, self._key_off + key_len),
                           (self._token_off, self._token_off + _TOKEN_COUNT.size),
                           *[(o, o + _CHECKSUM.size) for o in offs], (self._sum_off, hl)])
        ranges, pos = [], 0
        for a, b in variable:  # the byte ranges every page of this writer shares
            if a > pos:
                ranges.append((pos, a))
            pos = max(pos, b)
        self._const_ranges = ranges
        self._const = b"".join(self.blank[a:b] for a, b in ranges)

    # The template's geometry, for native_page (which checks and fills headers by these rules).
    @property
    def const_ranges(self) -> list[tuple[int, int]]:
        """The byte ranges every page of this writer shares with ``blank``."""
        return self._const_ranges

    @property
    def key_off(self) -> int:
        return self._key_off

    @property
    def token_off(self) -> int:
        return self._token_off

    @property
    def sum_off(self) -> int:
        """Where the header checksum (xxh3 of the bytes before it) is."""
        return self._sum_off

    def fill(self, buf: memoryview | bytearray, key: bytes, token_count: int, sums: Sequence[int]) -> None:
        """Write the header of (key, token_count, section checksums) into ``buf[:header_len]``."""
        buf[: self.header_len] = self.blank
        buf[self._key_off : self._key_off + self.key_len] = key
        _TOKEN_COUNT.pack_into(buf, self._token_off, token_count)
        for o, c in zip(self.sum_offsets, sums, strict=True):
            _CHECKSUM.pack_into(buf, o, c)
        _CHECKSUM.pack_into(buf, self._sum_off, section_sums(((0, self._sum_off),), memoryview(buf).cast("B"))[0])

    def parse(self, hview: memoryview, key: bytes) -> list[int] | None:
        """The section checksums if ``hview`` is exactly this template's header for ``key``;
        None otherwise (the caller then takes ``decode_header``'s slow path)."""
        h = bytes(hview)
        if section_sums(((0, self._sum_off),), memoryview(h))[0] != _CHECKSUM.unpack_from(h, self._sum_off)[0]:
            return None
        if h[self._key_off : self._key_off + self.key_len] != key:
            return None
        if b"".join([h[a:b] for a, b in self._const_ranges]) != self._const:
            return None
        return [_CHECKSUM.unpack_from(h, o)[0] for o in self.sum_offsets]
