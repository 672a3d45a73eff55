"""HeaderTemplate: one writer's exact codec-NONE page header, its variable fields patched in
place (the key, the token count, the section checksums and the header's own checksum).

The fast path of writers and readers that know their layout (``rootstore``, ``native.page_calls``,
fsck's batches); any header it does not accept goes through ``header.decode_header``.
Threading: a template is immutable after construction; safe from any thread.
"""

from __future__ import annotations

from collections.abc import Sequence

from tierstore.format.checksums import section_sums
from tierstore.format.header import (
    CHECKSUM_FIELD,
    PREAMBLE_LEN,
    PREAMBLE_OFFSETS,
    TOKEN_COUNT_FIELD,
    Codec,
    PageMeta,
    SectionEntry,
    encode_header,
    encode_section_entry,
)
from tierstore.format.page_layout import PageLayout


class HeaderTemplate:
    """The exact codec-NONE header of one writer's pages for one key length.

    A writer's pages (same namespace, group, rank, head slice and layout) differ only in the
    key, the token count, the section checksums and the header checksum. ``fill`` patches those
    into a copy of the template; ``parse`` accepts a header only if everything else is byte for
    byte the template's (any other header goes through ``decode_header``, which names the
    error). Every offset comes from format/header.py's structs (``PREAMBLE_OFFSETS``,
    ``encode_section_entry``), so the template cannot drift from ``encode_header``.
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
        self._sum_off = hl - CHECKSUM_FIELD.size
        offs, pos = [], PREAMBLE_LEN + key_len
        for e in entries:
            pos += len(encode_section_entry(e))
            offs.append(pos - CHECKSUM_FIELD.size)  # the entry's checksum is its last field
        self.sum_offsets: list[int] = offs
        variable = sorted([(self._key_off, self._key_off + key_len),
                           (self._token_off, self._token_off + TOKEN_COUNT_FIELD.size),
                           *[(o, o + CHECKSUM_FIELD.size) for o in offs], (self._sum_off, hl)])
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
        TOKEN_COUNT_FIELD.pack_into(buf, self._token_off, token_count)
        for o, c in zip(self.sum_offsets, sums, strict=True):
            CHECKSUM_FIELD.pack_into(buf, o, c)
        CHECKSUM_FIELD.pack_into(buf, self._sum_off, section_sums(((0, self._sum_off),), memoryview(buf).cast("B"))[0])

    def parse(self, hview: memoryview, key: bytes) -> list[int] | None:
        """The section checksums if ``hview`` is exactly this template's header for ``key``;
        None otherwise (the caller then takes ``decode_header``'s slow path)."""
        h = bytes(hview)
        if section_sums(((0, self._sum_off),), memoryview(h))[0] != CHECKSUM_FIELD.unpack_from(h, self._sum_off)[0]:
            return None
        if h[self._key_off : self._key_off + self.key_len] != key:
            return None
        if b"".join([h[a:b] for a, b in self._const_ranges]) != self._const:
            return None
        return [CHECKSUM_FIELD.unpack_from(h, o)[0] for o in self.sum_offsets]
