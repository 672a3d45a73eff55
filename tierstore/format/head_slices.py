"""Head slices of pages: the building blocks of reuse across a tensor-parallel change.

A group whose state vLLM shards across ranks is stored as slices of its full (TP=1) page.
Every section's outermost dimension is a concatenation of *segments* (``Segment``), each made
of blocks vLLM never splits, and a group has a number of *units* (its shard granularity): a
tensor-parallel rank holds a contiguous range of units, and a slice of units ``[a, a+c)`` of
``n`` holds blocks ``[a*q/n, ceil((a+c)*q/n))`` of each segment of ``q`` blocks. The layouts
(docs/measurements/tp.md):

- attention / sliding window: sections ``[H, T, 2, D]``, one segment of ``H`` heads, units =
  KV heads (a rank's heads are one contiguous byte range of every section);
- Gated DeltaNet (Qwen3-Next): per layer a ``<layer>.conv`` section ``(conv_dim, K-1)`` (the
  canonical orientation: channels first) whose channels are the q, k and v projections
  concatenated (segments ``key_dim, key_dim, value_dim``: vLLM shards each projection
  separately, so rank r holds ``[q_r, k_r, v_r]``), and a ``<layer>.temporal`` section
  ``(num_v_heads, head_v_dim, head_k_dim)`` (one segment of value heads); units = the linear
  key heads (``key_dim / head_k_dim``), the TP sizes vLLM allows for GDN divide them;
- Mamba2: ``<layer>.conv`` channels x (heads x head_dim), B, C (n_groups x state each) and
  ``<layer>.ssm`` ``(heads, head_dim, state)``; units = the groups (vLLM shards heads with their
  groups), or with one group ``gcd(heads, MAX_SLICED_TP)`` and B and C one block that every
  slice holds (vLLM replicates them on every rank);
- Mamba1 (``conv``, 2-D ``ssm``) and short conv (``conv``): channels split contiguously;
  units = ``gcd(channels, MAX_SLICED_TP)``.

The segment map is derived from the full layout alone (``segments``), so it needs no namespace
field: TP=1 digests are unchanged. Functions:

- ``HeadRange``: the units one file holds; ``split_dir_name``/``parse_split_dir`` name the
  directory of a slice (``h<start>-<count>``).
- ``cover(need, have)``: which of the available slices a reader of ``need`` reads, or None
  when they do not cover it (the exact slice; else one wider slice; else the fewest slices,
  left to right).
- ``slice_units`` / ``segments``: a layout's unit count and per-section segment map (None /
  ValueError for a layout that is not sliceable: MLA, unknown states, ...).
- ``slice_layout``: the layout of a slice of a full layout.
- ``copy_heads``: copy what one slice needs from another, segment by segment, from one page
  buffer into another (each segment's blocks are one contiguous byte range; a block several
  slices hold is copied once).

Reading the covering files and copying their units is ``tiers/assembly.py``.
Threading: pure functions.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

from tierstore.format.page_layout import PageLayout, SectionSpec
from tierstore.fs.mapper import SLICE_DIR_RE, FileMapper


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
    m = SLICE_DIR_RE.match(name)
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


GDN_CONV, GDN_TEMPORAL, SSM = "conv", "temporal", "ssm"  # namespace.mamba_states' state names
# Unit count of a state split by channels or heads with no coarser constraint (Mamba1, short
# conv, Mamba2 with one group): the largest divisor of its rows up to this. A TP that does not
# divide a group's units keeps a per-TP namespace (namespace.build_namespace).
MAX_SLICED_TP = 16


@dataclass(frozen=True)
class Segment:
    """One part of a section's outermost dimension in the full (TP=1) state: ``rows`` rows in
    ``blocks`` equal blocks that vLLM never splits (a KV head, a Mamba2 head or B/C group, a
    conv channel range). A slice of units ``[a, a+c)`` of ``n`` holds blocks ``[a*q//n,
    ceil((a+c)*q/n))``: exactly its share when ``q`` is a multiple of ``n``, and the blocks its
    units need when blocks are coarser (Mamba2 with one group: every rank holds all of B and C)."""

    rows: int
    blocks: int

    def block_range(self, units: int, heads: HeadRange) -> tuple[int, int]:
        return heads.start * self.blocks // units, -(-heads.end * self.blocks // units)


SegmentMap = tuple[tuple[Segment, ...], ...]  # per section, its segments in row order


def _attention_segments(layout: PageLayout) -> tuple[int, SegmentMap] | None:
    heads = {s.shape[0] for s in layout.sections}
    if not layout.sections or any(len(s.shape) != 4 for s in layout.sections) or len(heads) != 1:
        return None
    (h,) = heads
    return h, tuple((Segment(h, h),) for _ in layout.sections)


def _state_pairs(layout: PageLayout, second: str, ndim: int) -> list[tuple[SectionSpec, SectionSpec]] | None:
    """Per layer (``<layer>.conv`` (C, K-1), ``<layer>.<second>`` of ``ndim`` dimensions); None
    if the layout is not made of such pairs."""
    secs = layout.sections
    if not secs or len(secs) % 2:
        return None
    pairs = list(zip(secs[::2], secs[1::2], strict=True))
    for conv, state in pairs:
        if (not conv.name.endswith("." + GDN_CONV) or not state.name.endswith("." + second)
                or conv.name[: -len(GDN_CONV)] != state.name[: -len(second)]
                or len(conv.shape) != 2 or len(state.shape) != ndim):
            return None
    return pairs


def _one_unit_count(found: list[tuple[int, tuple[Segment, ...], tuple[Segment, ...]]]) -> tuple[int, SegmentMap] | None:
    units = {n for n, _, _ in found}
    if len(units) != 1:
        return None
    return units.pop(), tuple(seg for _, conv, state in found for seg in (conv, state))


def _gdn_segments(layout: PageLayout) -> tuple[int, SegmentMap] | None:
    """Gated DeltaNet: ``<layer>.conv`` (conv_dim, K-1) then ``<layer>.temporal`` (num_v_heads,
    head_v_dim, head_k_dim) per layer (vLLM 0.32's ``gated_delta_net_state_shape``, conv
    channels first); conv channels are q, k, v (``key_dim, key_dim, value_dim``), each split by
    linear key heads (the units)."""
    pairs = _state_pairs(layout, GDN_TEMPORAL, 3)
    if pairs is None:
        return None
    found = []
    for conv, temporal in pairs:
        v_heads, head_v, head_k = temporal.shape
        value_dim = v_heads * head_v
        key_dim2 = conv.shape[0] - value_dim
        if key_dim2 <= 0 or key_dim2 % 2 or (key_dim2 // 2) % head_k:
            return None
        key_dim = key_dim2 // 2
        n = key_dim // head_k
        if value_dim % n or v_heads % n:
            return None
        found.append((n, (Segment(key_dim, n), Segment(key_dim, n), Segment(value_dim, n)), (Segment(v_heads, n),)))
    return _one_unit_count(found)


def _mamba2_segments(layout: PageLayout) -> tuple[int, SegmentMap] | None:
    """Mamba2 (``mamba2_state_shape``): ``<layer>.conv`` (conv_dim, K-1) with channels x (heads x
    head_dim), B and C (n_groups x state each), ``<layer>.ssm`` (heads, head_dim, state). vLLM
    shards heads and groups together (TP divides n_groups) or, with one group, replicates B and
    C on every rank (``mamba_v2_sharded_weight_loader``). Units: the groups, or with one group
    ``gcd(heads, MAX_SLICED_TP)``."""
    pairs = _state_pairs(layout, SSM, 3)
    if pairs is None:
        return None
    found = []
    for conv, ssm in pairs:
        heads, head_dim, state = ssm.shape
        x = heads * head_dim
        bc = conv.shape[0] - x
        if bc <= 0 or bc % (2 * state):
            return None
        groups = bc // (2 * state)
        if heads % groups:
            return None
        n = groups if groups > 1 else math.gcd(heads, MAX_SLICED_TP)
        bc_seg = Segment(groups * state, groups)
        found.append((n, (Segment(x, heads), bc_seg, bc_seg), (Segment(heads, heads),)))
    return _one_unit_count(found)


def _channel_segments(layout: PageLayout) -> tuple[int, SegmentMap] | None:
    """Mamba1 (``<layer>.conv`` (intermediate, K-1), ``<layer>.ssm`` (intermediate, state)) and
    short conv (``<layer>.conv`` only): channels split contiguously across ranks. Units:
    ``gcd(channels, MAX_SLICED_TP)``."""
    secs = layout.sections
    if secs and all(s.name.endswith("." + GDN_CONV) and len(s.shape) == 2 for s in secs):  # short conv
        rows = {s.shape[0] for s in secs}
        if len(rows) != 1:
            return None
        (c,) = rows
        n = math.gcd(c, MAX_SLICED_TP)
        return n, tuple((Segment(c, n),) for _ in secs)
    pairs = _state_pairs(layout, SSM, 2)
    if pairs is None or any(conv.shape[0] != ssm.shape[0] for conv, ssm in pairs):
        return None
    found = []
    for conv, _ in pairs:
        n = math.gcd(conv.shape[0], MAX_SLICED_TP)
        found.append((n, (Segment(conv.shape[0], n),), (Segment(conv.shape[0], n),)))
    return _one_unit_count(found)


@functools.lru_cache(maxsize=256)
def _find_segments(layout: PageLayout) -> tuple[int, SegmentMap] | None:
    found = (_attention_segments(layout) or _gdn_segments(layout) or _mamba2_segments(layout)
             or _channel_segments(layout))
    if found is None:
        return None
    n, segs = found
    for section, section_segs in zip(layout.sections, segs, strict=True):
        if sum(g.rows for g in section_segs) != section.shape[0] or any(
                g.rows % g.blocks or (g.blocks % n and n % g.blocks) for g in section_segs):
            return None
    return found


def segments(layout: PageLayout) -> tuple[int, SegmentMap]:
    """(units, per-section segments) of a sliceable FULL (TP=1) layout (module docstring);
    ValueError for a layout that is not sliceable."""
    found = _find_segments(layout)
    if found is None:
        raise ValueError(f"layout {[(s.name, s.shape) for s in layout.sections][:4]} is not attention [H, T, 2, D], "
                         "Gated DeltaNet, Mamba1/2 or short-conv states: it cannot be stored as slices")
    return found


def slice_units(layout: PageLayout) -> int | None:
    """How many units a sliceable layout has (KV heads; GDN linear key heads; Mamba2 groups; see
    ``segments``); None if it is not sliceable."""
    found = _find_segments(layout)
    return found[0] if found else None


@functools.lru_cache(maxsize=1024)
def slice_layout(layout: PageLayout, heads: HeadRange) -> PageLayout:
    """The layout of units ``heads`` of a full layout (each segment cut to the blocks they hold)."""
    units, segs = segments(layout)
    if heads.end > units:
        raise ValueError(f"slice [{heads.start}, {heads.end}) of a layout of {units} units")
    out = []
    for s, seg in zip(layout.sections, segs, strict=True):
        rows = 0
        for g in seg:
            b0, b1 = g.block_range(units, heads)
            rows += (b1 - b0) * (g.rows // g.blocks)
        out.append(SectionSpec(s.name, s.dtype, (rows, *s.shape[1:])))
    return PageLayout(tuple(out))


def _blocks_to_copy(seg: Segment, units: int, src: HeadRange, dst: HeadRange) -> tuple[int, int]:
    """The blocks of ``seg`` to copy from slice ``src`` into slice ``dst``: those ``dst`` holds
    whose first unit ``dst`` needs lies in ``src`` (a block coarser than a unit, held by several
    slices, is copied once, from the piece that covers its first needed unit)."""
    lo, hi = max(src.start, dst.start), min(src.end, dst.end)
    d0, d1 = seg.block_range(units, dst)
    if seg.blocks % units == 0:  # a whole number of blocks per unit
        per = seg.blocks // units
        return lo * per, hi * per
    per_block = units // seg.blocks
    picked = [b for b in range(d0, d1) if lo <= max(b * per_block, dst.start) < hi]
    return (picked[0], picked[-1] + 1) if picked else (0, 0)


def copy_heads(full_layout: PageLayout, src: memoryview, src_heads: HeadRange,
               dst: memoryview, dst_heads: HeadRange) -> int:
    """Copy what slice ``dst_heads`` needs from slice ``src_heads`` (both slices of
    ``full_layout``, their pages in ``src`` and ``dst``); bytes copied. Each segment's blocks
    are one contiguous byte range in both pages."""
    if max(src_heads.start, dst_heads.start) >= min(src_heads.end, dst_heads.end):
        return 0
    units, segs = segments(full_layout)
    src_layout, dst_layout = slice_layout(full_layout, src_heads), slice_layout(full_layout, dst_heads)
    copied = 0
    for s_sec, s_off, d_off, sec_segs in zip(src_layout.sections, src_layout.offsets, dst_layout.offsets, segs,
                                             strict=True):
        row = s_sec.nbytes // s_sec.shape[0]  # bytes of one row of the outermost dimension
        s_base, d_base = s_off, d_off
        for g in sec_segs:
            block = g.rows // g.blocks * row  # bytes of one block
            s0, s1 = g.block_range(units, src_heads)
            d0, d1 = g.block_range(units, dst_heads)
            b0, b1 = _blocks_to_copy(g, units, src_heads, dst_heads)
            if b1 > b0:
                n = (b1 - b0) * block
                a, b = s_base + (b0 - s0) * block, d_base + (b0 - d0) * block
                dst[b : b + n] = src[a : a + n]
                copied += n
            s_base += (s1 - s0) * block
            d_base += (d1 - d0) * block
    return copied
