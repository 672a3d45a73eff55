"""The page buffer of format v3: named, typed sections and the bytes between them.

A page is one KV-cache group x one stored chunk x all layers of that group (x one rank's
slice). Its page buffer is the concatenation of named, typed sections (``SectionSpec``), each
at the first SECTION_ALIGN multiple after the previous one (``PageLayout``); with codec NONE a
page file's payload is byte for byte this buffer (format/page.py, format/header.py).

Canonical bytes (format 3): the alignment gaps between sections (``PageLayout.gaps``, <
SECTION_ALIGN bytes each) are zero. Writers zero them (``zero_gaps``; ``kernels.GroupCopier.gather``
on both backends zeroes them in the same pass as its copy); readers reject a buffer whose gap
bytes are not zero (``check_gaps``): section checksums do not cover the gaps, so this check is
what keeps a stale byte (a previous page's, possibly another tenant's) from travelling through
a shared tree unnoticed.

Bounds: ``zstd_frame_bound`` and ``zstd_payload_bound`` are the most zstd can emit for a
section and for a layout's sections: a reader never allocates more than the layout it expects,
whatever a header or a frame declares.
Threading: immutable values and pure functions; safe from any thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from tierstore.errors import PageCorrupt, PageFormatError

SECTION_ALIGN = 64
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


def align_up(n: int, to: int) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return (n + to - 1) // to * to


def zstd_frame_bound(raw_len: int) -> int:
    """Largest zstd frame for ``raw_len`` input bytes (ZSTD_COMPRESSBOUND) plus the frame
    header and checksum room: what a writer can legitimately produce."""
    small = ((128 << 10) - raw_len) >> 11 if raw_len < (128 << 10) else 0
    return raw_len + (raw_len >> 8) + small + 64


def zstd_payload_bound(layout: PageLayout) -> int:
    """Largest ZSTD payload of a page of ``layout`` (each frame at most ``zstd_frame_bound``,
    aligned to SECTION_ALIGN)."""
    return sum(align_up(zstd_frame_bound(s.nbytes), SECTION_ALIGN) for s in layout.sections)


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
            pos = align_up(pos + s.nbytes, SECTION_ALIGN)
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


ZERO_GAP = bytes(SECTION_ALIGN)  # the only content a gap may have (gaps are < SECTION_ALIGN)


def nonzero_gap(layout: PageLayout, buf: bytes | memoryview) -> tuple[int, int] | None:
    """The first alignment gap of a page buffer of ``layout`` holding a non-zero byte, or None."""
    view = memoryview(buf).cast("B")
    for a, b in layout.gaps:
        if view[a:b] != ZERO_GAP[: b - a]:
            return a, b
    return None


def zero_gaps(layout: PageLayout, buf: memoryview | bytearray) -> None:
    """Write zeros into every alignment gap of a writable page buffer of ``layout``."""
    view = memoryview(buf).cast("B")
    for a, b in layout.gaps:
        view[a:b] = ZERO_GAP[: b - a]


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
