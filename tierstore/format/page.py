"""Page file format v3: the payload codec, from a page buffer to a file's bytes and back.

A page file is a header (format/header.py), the payload, and an optional trailer (MAC or
sealing). With codec NONE the payload is byte-for-byte the page buffer of ``PageLayout`` (same
offsets), so a load is one ``readinto`` plus checksums. With codec ZSTD each section is one
zstd frame, at the first SECTION_ALIGN multiple after the previous frame.

Canonical bytes (format 3). Every byte of a file is determined by the page's content: the
alignment gaps between sections (``PageLayout.gaps``; in a ZSTD payload the padding between
frames) are zero. Writers: every copy into a page buffer writes its gaps
(``kernels.GroupCopier.gather`` on both backends zeroes them in the same pass;
``decode_payload`` zeroes them in its output), and ``encode_page`` zeroes them in what it
writes whatever its input held. Readers reject a file whose gap bytes are not zero
(``check_stored_gaps`` and ``page_layout.check_gaps``, called by ``decode_payload``, hence by
``page_read.read_page`` and fsck). Format 2 did not zero the gaps of layouts that have any
(Mamba/GDN states whose size is not a multiple of SECTION_ALIGN); its trees are another
namespace and are refused (see ``header.FORMAT_VERSION``).
The files under tests/golden/ pin these bytes: a change that alters them must change
FORMAT_VERSION (``python -m tierstore.testing.golden --write`` regenerates them).

ZSTD frames are decoded by ``safe_zstd`` into the page buffer, with a hard output cap; callers
check ``header.check_payload_bound`` before they read a payload.
Threading: pure functions over immutable values; safe from any thread. A ZSTD compressor or
decompressor object must not be shared between threads (callers pass their own).
"""

from __future__ import annotations

from tierstore.errors import PageCorrupt, PageFormatError
from tierstore.format import safe_zstd
from tierstore.format.checksums import checksum, section_checksums
from tierstore.format.header import Codec, PageHeader, PageMeta, SectionEntry, encode_header
from tierstore.format.page_layout import (
    SECTION_ALIGN,
    ZERO_GAP,
    PageLayout,
    align_up,
    check_gaps,
    nonzero_gap,
    zero_gaps,
)


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
        start = align_up(pos, SECTION_ALIGN)
        if e.stored_offset != start:
            raise PageFormatError(f"section {e.spec.name!r}: zstd frame at payload offset {e.stored_offset}, "
                                  f"the canonical place is {start}", path=path, key=header.meta.key)
        if view[pos:start] != ZERO_GAP[: start - pos]:
            raise PageCorrupt(f"non-zero padding before the zstd frame of section {e.spec.name!r}: not a "
                              "canonical format-3 page; it is not served", path=path, key=header.meta.key)
        pos = start + e.stored_len
    if header.payload_len != pos:
        raise PageFormatError(f"payload runs {header.payload_len - pos} bytes past its last zstd frame",
                              path=path, key=header.meta.key)


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
            start = align_up(pos, SECTION_ALIGN)
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
