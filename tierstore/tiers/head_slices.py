"""Head slices of pages: the building blocks of reuse across a tensor-parallel change.

A group whose state vLLM shards across ranks along one dimension is stored as slices of its
full (TP=1) page. Every section's outermost dimension is a concatenation of *segments*, and a
group has a number of *units* (its shard granularity): unit ``u`` of ``n`` holds rows
``[u*S/n, (u+1)*S/n)`` of each segment of size ``S``, and a tensor-parallel rank holds a
contiguous range of units. Two layouts have one (docs/measurements/tp.md):

- attention / sliding window: sections ``[H, T, 2, D]``, one segment of ``H`` rows, units = KV
  heads (a rank's heads are one contiguous byte range of every section);
- Gated DeltaNet (Qwen3-Next): per layer a ``<layer>.conv`` section ``(conv_dim, K-1)`` (the
  canonical orientation: channels first) whose channels are the q, k and v projections
  concatenated (segments ``key_dim, key_dim, value_dim``: vLLM shards each projection
  separately, so rank r holds ``[q_r, k_r, v_r]``), and a ``<layer>.temporal`` section
  ``(num_v_heads, head_v_dim, head_k_dim)`` (one segment of value heads); units = the linear
  key heads (``key_dim / head_k_dim``), the TP sizes vLLM allows for GDN divide them.

The segment map is derived from the layout alone (``segments``), so it holds for a slice's
layout too (segment proportions do not depend on the slice) and needs no namespace field: TP=1
digests are unchanged. Functions:

- ``HeadRange``: the units one file holds; ``split_dir_name``/``parse_split_dir`` name the
  directory of a slice (``h<start>-<count>``).
- ``cover(need, have)``: which of the available slices a reader of ``need`` reads, or None
  when they do not cover it (the exact slice; else one wider slice; else the fewest slices,
  left to right).
- ``slice_units`` / ``segments``: a layout's unit count and per-section segment map (None /
  ValueError for a layout that is not sliceable: Mamba1/2, MLA, ...).
- ``slice_layout``: the layout of a slice of a full layout.
- ``copy_heads``: copy the units two slices share, segment by segment, from one page buffer
  into another (each segment's rows are one contiguous byte range).
- ``assemble``: read the covering files, each fully verified by the general reader
  (``pagefile.read_page`` with that writer's expectation: header checksum, namespace, key,
  group, rank, layout and every section checksum) into a scratch buffer, and copy their units
  into the reader's page. Every byte a rank scatters from it was checksum-verified. Returns the
  cost: bytes read and files opened (the read amplification of a TP change).

Failure policy: ``assemble`` raises the typed ``PageError`` of the first piece that fails
(missing, checksum, ...); the output buffer then holds garbage and must not be used.
Threading: pure functions; ``assemble`` does blocking file reads (call it from an I/O thread).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tierstore import pagefile
from tierstore.errors import BAD_CONTENT_KINDS, PageError
from tierstore.format import PageExpectation, PageLayout, SectionSpec
from tierstore.mapper import FileMapper

_SPLIT_RE = re.compile(r"^h(0|[1-9][0-9]*)-([1-9][0-9]*)$")


@dataclass(frozen=True, order=True)
class HeadRange:
    """Units ``[start, start + count)`` of a group: KV heads of attention, linear key heads of
    Gated DeltaNet (module docstring)."""

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
    """The KV heads (GDN: linear key heads) a rank holds as vLLM shards them: ``total // tp`` each; when TP exceeds the
    KV-head count each head is replicated on ``tp // total`` ranks, which then share one file."""
    return HeadRange(rank * total_kv_heads // tp_size, max(1, total_kv_heads // tp_size))


def tp_slices(total_kv_heads: int) -> list[HeadRange]:
    """Every head slice some tensor-parallel size writes: ``count`` heads for each ``count``
    dividing the KV-head count, at multiples of ``count`` (the full range included)."""
    return [HeadRange(start, count) for count in range(1, total_kv_heads + 1) if total_kv_heads % count == 0
            for start in range(0, total_kv_heads, count)]


def slice_mappers(root: str | os.PathLike[str], namespace: str, group_index: int, units: int) -> list[FileMapper]:
    """One mapper per slice directory some TP writes, in ``tp_slices`` order (``r0``: the full
    range, where a TP=1 writer's files are)."""
    return [FileMapper(root, namespace, group_index, h.start // h.count, "r0" if h.count == units else split_dir_name(h))
            for h in tp_slices(units)]


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


GDN_CONV, GDN_TEMPORAL = "conv", "temporal"  # namespace.mamba_states' names of a GDN layer's states


def _attention_segments(layout: PageLayout) -> tuple[int, tuple[tuple[int, ...], ...]] | None:
    heads = {s.shape[0] for s in layout.sections}
    if not layout.sections or any(len(s.shape) != 4 for s in layout.sections) or len(heads) != 1:
        return None
    (h,) = heads
    return h, tuple((h,) for _ in layout.sections)


def _gdn_segments(layout: PageLayout) -> tuple[int, tuple[tuple[int, ...], ...]] | None:
    """(units, segments) of a Gated DeltaNet layout: ``<layer>.conv`` (conv_dim, K-1) then
    ``<layer>.temporal`` (num_v_heads, head_v_dim, head_k_dim) per layer (vLLM 0.32's
    ``gated_delta_net_state_shape``, conv channels first); None for anything else."""
    secs = layout.sections
    if not secs or len(secs) % 2:
        return None
    units: set[int] = set()
    out: list[tuple[int, ...]] = []
    for conv, temporal in zip(secs[::2], secs[1::2], strict=True):
        if (not conv.name.endswith("." + GDN_CONV) or not temporal.name.endswith("." + GDN_TEMPORAL)
                or conv.name[: -len(GDN_CONV)] != temporal.name[: -len(GDN_TEMPORAL)]
                or len(conv.shape) != 2 or len(temporal.shape) != 3):
            return None
        v_heads, head_v, head_k = temporal.shape
        value_dim = v_heads * head_v
        key_dim2 = conv.shape[0] - value_dim
        if key_dim2 <= 0 or key_dim2 % 2 or (key_dim2 // 2) % head_k:
            return None
        key_dim = key_dim2 // 2
        units.add(key_dim // head_k)
        out += [(key_dim, key_dim, value_dim), (v_heads,)]
    if len(units) != 1:
        return None
    (n,) = units
    if any(seg % n for segs in out for seg in segs):
        return None
    return n, tuple(out)


def segments(layout: PageLayout) -> tuple[int, tuple[tuple[int, ...], ...]]:
    """(units, per-section segment sizes of the outermost dimension) of a sliceable layout (full
    or slice; see the module docstring); ValueError for a layout that is neither attention nor
    Gated DeltaNet."""
    found = _attention_segments(layout) or _gdn_segments(layout)
    if found is None:
        raise ValueError(f"layout {[(s.name, s.shape) for s in layout.sections][:4]} is neither attention "
                         "[H, T, 2, D] nor Gated DeltaNet (conv, temporal): it cannot be stored as slices")
    return found


def slice_units(layout: PageLayout) -> int | None:
    """How many units (KV heads; GDN linear key heads) a sliceable layout has; None if it is not."""
    found = _attention_segments(layout) or _gdn_segments(layout)
    return found[0] if found else None


def slice_layout(layout: PageLayout, heads: HeadRange) -> PageLayout:
    """The layout of units ``heads`` of a full layout (each section's segments cut to them)."""
    units, segs = segments(layout)
    if heads.end > units:
        raise ValueError(f"slice [{heads.start}, {heads.end}) of a layout of {units} units")
    out = []
    for s, seg in zip(layout.sections, segs, strict=True):
        out.append(SectionSpec(s.name, s.dtype, (sum(n * heads.count // units for n in seg), *s.shape[1:])))
    return PageLayout(tuple(out))


def copy_heads(src: memoryview, src_layout: PageLayout, src_heads: HeadRange,
               dst: memoryview, dst_layout: PageLayout, dst_heads: HeadRange) -> int:
    """Copy the units both slices hold from page buffer ``src`` into ``dst``; bytes copied.
    Both layouts must be slices of one group (same sections, same rows per unit)."""
    lo, hi = max(src_heads.start, dst_heads.start), min(src_heads.end, dst_heads.end)
    if lo >= hi:
        return 0
    _, src_segs = segments(src_layout)
    _, dst_segs = segments(dst_layout)
    copied = 0
    for s_sec, s_off, s_seg, d_sec, d_off, d_seg in zip(src_layout.sections, src_layout.offsets, src_segs,
                                                       dst_layout.sections, dst_layout.offsets, dst_segs,
                                                       strict=True):
        row = s_sec.nbytes // s_sec.shape[0]  # bytes of one row of the outermost dimension
        if (s_sec.name != d_sec.name or d_sec.nbytes // d_sec.shape[0] != row or len(s_seg) != len(d_seg)
                or any(a * dst_heads.count != b * src_heads.count for a, b in zip(s_seg, d_seg, strict=True))):
            raise ValueError(f"sections {s_sec.name} and {d_sec.name} are not slices of one layout")
        s_base, d_base = s_off, d_off
        for s_rows, d_rows in zip(s_seg, d_seg, strict=True):
            per_unit = s_rows // src_heads.count * row  # bytes of one unit in this segment
            n = (hi - lo) * per_unit
            a = s_base + (lo - src_heads.start) * per_unit
            b = d_base + (lo - dst_heads.start) * per_unit
            dst[b : b + n] = src[a : a + n]
            copied += n
            s_base += s_rows * row
            d_base += d_rows * row
    return copied


@dataclass
class AssembleCost:
    """What serving one page from other slices cost: bytes read from files (verified) and
    bytes copied into the reader's page, and files opened."""

    bytes_read: int = 0
    bytes_scattered: int = 0
    files: int = 0
    token_count: int = 0  # the covering pages' (one key: the same tokens in every slice)

    @property
    def amplification(self) -> float:
        """Bytes read per byte the reader uses (1.0: none wasted)."""
        return self.bytes_read / self.bytes_scattered if self.bytes_scattered else 0.0


def assemble(need: HeadRange, pieces: Sequence[HeadRange], full_layout: PageLayout, out: memoryview,
             locate: Callable[[HeadRange], tuple[Path, PageExpectation]],
             on_damage: Callable[[Path, pagefile.FileIdentity, PageError], None] | None = None,
             ) -> AssembleCost:
    """Fill ``out`` (the ``slice_layout(full_layout, need)`` page) from the files of ``pieces``
    (``cover``'s answer). ``locate(piece)`` gives a piece's path and its writer's expectation
    (layout ``slice_layout(full_layout, piece)``). Each file is read and verified in full into
    a scratch buffer before any of its bytes is copied; see the module's failure policy.
    ``on_damage(path, identity, error)``: called for a file whose content is bad
    (``BAD_CONTENT_KINDS``) before the error is raised, with the identity of the file read (the
    caller may remove exactly that file)."""
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
        fd, st = pagefile.open_page(str(path), expect.key)  # read_page's steps, keeping the file's identity
        try:
            header = pagefile.read_page_fd(fd, st, str(path), expect, scratch)  # every section checksum verified
        except PageError as exc:
            if on_damage is not None and exc.kind in BAD_CONTENT_KINDS:
                on_damage(path, pagefile.file_identity(st), exc)
            raise
        finally:
            os.close(fd)
        cost.token_count = header.meta.token_count
        cost.files += 1
        cost.bytes_read += layout.nbytes
        cost.bytes_scattered += copy_heads(scratch, layout, piece, out, dst_layout, need)
    return cost
