"""Head slices of attention pages: the building blocks of reuse across a tensor-parallel change.

An attention (or sliding-window) page holds, per layer, one section ``[H, T, 2, D]``: the KV
heads a rank holds are a contiguous byte range of every section. A page written by a rank that
held heads ``[s, s+c)`` can therefore serve any reader whose heads overlap it, by copying those
heads' bytes. This module is the pure part of that (docs/DESIGN.md, "Tensor parallel and TP
changes", describes the whole design and what is wired in so far):

- ``HeadRange``: the KV heads one file holds; ``split_dir_name``/``parse_split_dir`` name the
  directory of a head slice (``h<start>-<count>``).
- ``cover(need, have)``: which of the available head slices a reader of ``need`` reads, or
  None when they do not cover it (the exact slice; else one wider slice; else the fewest
  slices, left to right).
- ``slice_layout``: the layout of a head slice of a full-head attention layout.
- ``copy_heads``: copy the heads two slices share, section by section, from one page buffer
  into another.
- ``assemble``: read the covering files, each fully verified by the general reader
  (``pagefile.read_page`` with that writer's expectation: header checksum, namespace, key,
  group, rank, layout and every section checksum) into a scratch buffer, and copy their heads
  into the reader's page. Every byte a rank scatters from it was checksum-verified. Returns the
  cost: bytes read and files opened (the read amplification of a TP change).

Failure policy: ``assemble`` raises the typed ``PageError`` of the first piece that fails
(missing, checksum, ...); the output buffer then holds garbage and must not be used.
Threading: pure functions; ``assemble`` does blocking file reads (call it from an I/O thread).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tierstore import pagefile
from tierstore.format import PageExpectation, PageLayout, SectionSpec

_SPLIT_RE = re.compile(r"^h(0|[1-9][0-9]*)-([1-9][0-9]*)$")


@dataclass(frozen=True, order=True)
class HeadRange:
    """KV heads ``[start, start + count)`` of an attention group."""

    start: int
    count: int

    @property
    def end(self) -> int:
        return self.start + self.count

    def contains(self, other: HeadRange) -> bool:
        return self.start <= other.start and other.end <= self.end


def split_dir_name(heads: HeadRange) -> str:
    """``h<start>-<count>``: the directory of a head slice (plain decimal, like ``g<group>``)."""
    return f"h{heads.start}-{heads.count}"


def parse_split_dir(name: str) -> HeadRange | None:
    """``h0-2`` -> HeadRange(0, 2); None for anything else (``h00-2``, ``h1-0``, ``r0``)."""
    m = _SPLIT_RE.match(name)
    return HeadRange(int(m.group(1)), int(m.group(2))) if m else None


def rank_heads(total_kv_heads: int, tp_size: int, rank: int) -> HeadRange:
    """The KV heads a rank holds as vLLM shards them: ``total // tp`` each; when TP exceeds the
    KV-head count each head is replicated on ``tp // total`` ranks, which then share one file."""
    return HeadRange(rank * total_kv_heads // tp_size, max(1, total_kv_heads // tp_size))


def tp_slices(total_kv_heads: int) -> list[HeadRange]:
    """Every head slice some tensor-parallel size writes: ``count`` heads for each ``count``
    dividing the KV-head count, at multiples of ``count`` (the full range included)."""
    return [HeadRange(start, count) for count in range(1, total_kv_heads + 1) if total_kv_heads % count == 0
            for start in range(0, total_kv_heads, count)]


def cover(need: HeadRange, have: Sequence[HeadRange]) -> list[HeadRange] | None:
    """The slices a reader of ``need`` reads, in head order; None if ``have`` does not cover it.

    Prefers the exact slice (no extra bytes), then the narrowest single slice containing
    ``need`` (reads ``count/need.count`` times the bytes, one file), then, head by head from
    the left, the slice starting at or before the next missing head that reaches furthest
    (fewest files; a TP=1 reader of TP=2 files reads two half files, no extra bytes)."""
    if need in have:
        return [need]
    wider = [h for h in have if h.contains(need)]
    if wider:
        return [min(wider, key=lambda h: (h.count, h.start))]
    pieces: list[HeadRange] = []
    head = need.start
    while head < need.end:
        usable = [h for h in have if h.start <= head < h.end]
        if not usable:
            return None
        best = max(usable, key=lambda h: (h.end, -h.count))
        pieces.append(best)
        head = best.end
    return pieces


def slice_layout(layout: PageLayout, heads: HeadRange) -> PageLayout:
    """The layout of ``heads`` of a full-head attention layout (every section ``[H, T, 2, D]``)."""
    out = []
    for s in layout.sections:
        if len(s.shape) != 4 or heads.end > s.shape[0]:
            raise ValueError(f"section {s.name} {s.shape} is not an attention section holding heads "
                             f"[{heads.start}, {heads.end})")
        out.append(SectionSpec(s.name, s.dtype, (heads.count, *s.shape[1:])))
    return PageLayout(tuple(out))


def copy_heads(src: memoryview, src_layout: PageLayout, src_heads: HeadRange,
               dst: memoryview, dst_layout: PageLayout, dst_heads: HeadRange) -> int:
    """Copy the heads both slices hold from page buffer ``src`` into ``dst``; bytes copied.
    Both layouts must be head slices of one group (same sections, same ``[T, 2, D]``)."""
    lo, hi = max(src_heads.start, dst_heads.start), min(src_heads.end, dst_heads.end)
    if lo >= hi:
        return 0
    copied = 0
    for s_sec, s_off, d_sec, d_off in zip(src_layout.sections, src_layout.offsets, dst_layout.sections,
                                          dst_layout.offsets, strict=True):
        per_head = s_sec.nbytes // src_heads.count
        if s_sec.name != d_sec.name or d_sec.nbytes // dst_heads.count != per_head:
            raise ValueError(f"sections {s_sec.name} and {d_sec.name} are not slices of one layout")
        n = (hi - lo) * per_head
        a = s_off + (lo - src_heads.start) * per_head
        b = d_off + (lo - dst_heads.start) * per_head
        dst[b : b + n] = src[a : a + n]
        copied += n
    return copied


@dataclass
class AssembleCost:
    """What serving one page from other slices cost: bytes read from files (verified) and
    bytes copied into the reader's page, and files opened."""

    bytes_read: int = 0
    bytes_scattered: int = 0
    files: int = 0

    @property
    def amplification(self) -> float:
        """Bytes read per byte the reader uses (1.0: none wasted)."""
        return self.bytes_read / self.bytes_scattered if self.bytes_scattered else 0.0


def assemble(need: HeadRange, pieces: Sequence[HeadRange], full_layout: PageLayout, out: memoryview,
             locate: Callable[[HeadRange], tuple[Path, PageExpectation]]) -> AssembleCost:
    """Fill ``out`` (the ``slice_layout(full_layout, need)`` page) from the files of ``pieces``
    (``cover``'s answer). ``locate(piece)`` gives a piece's path and its writer's expectation
    (layout ``slice_layout(full_layout, piece)``). Each file is read and verified in full into
    a scratch buffer before any of its bytes is copied; see the module's failure policy."""
    dst_layout = slice_layout(full_layout, need)
    if len(out) < dst_layout.nbytes:
        raise ValueError(f"output buffer of {len(out)} bytes for a {dst_layout.nbytes}-byte page")
    cost = AssembleCost()
    for piece in pieces:
        path, expect = locate(piece)
        layout = slice_layout(full_layout, piece)
        if expect.layout != layout:
            raise ValueError(f"the expectation of slice {split_dir_name(piece)} has another layout")
        scratch = memoryview(bytearray(layout.nbytes))
        pagefile.read_page(path, expect, scratch)  # every section checksum verified
        cost.files += 1
        cost.bytes_read += layout.nbytes
        cost.bytes_scattered += copy_heads(scratch, layout, piece, out, dst_layout, need)
    return cost
