"""Triton copy kernels: canonical pages <-> engine KV views, all sections of a group per launch.

One stride-generic kernel serves every physical layout. At construction each section's copy
is reduced to "rows of contiguous words": the block dims are coalesced where both the source
view and the canonical section are dense, the innermost run that is dense in both becomes a
row of ``width`` words, and the remaining (at most 4) dims are row dims with their own source
and page strides. Copies are bit copies in the widest word (8, 4, 2 or 1 bytes) that divides
every byte offset and stride involved, so dtypes (fp8, bf16, fp16, fp32) do not matter.

Each launch covers all sections that share a tile shape (an attention group: one launch; a
Mamba group: usually two, the conv and the SSM states). A gather of a layout with alignment
gaps (``PageLayout.gaps``) adds one small launch (per word size) that writes zeros into them
(``ZERO``), so a page buffer's bytes never depend on what it held before (format.py). The grid is (page x kernel block,
tile); a tile is ``ROWS x COLS`` words of one section. Per-section descriptors (int64: source
offset, page offset, strides, sizes) live in a small device tensor built once; all address
arithmetic is 64-bit. Sources are addressed relative to one anchor storage and pages relative
to another (address differences in words), so per-layer tensors of different allocations are
served by one launch. Pages given as one [n, nbytes] tensor (rows at any stride, e.g. a
transfer's scratch rows) are addressed from scalars (``STRIDED``: first page and page stride),
with no per-call table; a list of page buffers gets a table of starts. Arguments that vary with
the scratch row a transfer starts at are not specialized by Triton (``do_not_specialize``), so
no kernel variant is compiled or loaded in the middle of a run.

CPU: set ``TRITON_INTERPRET=1`` before this module is imported (tests do); the interpreter is
slow (~50 MiB/s) and meant for tests. Threading: a TritonCopier is immutable after
construction except for a cache of launch plans and one of word views of page storages (both
filled under a lock; the second keeps at most ``_ANCHORS`` storages alive); launches go to the
current CUDA stream of the calling thread.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tierstore.format.page_layout import PageLayout
from tierstore.kernels.geometry import INT_DTYPE_BY_SIZE, PagesArg, PlannedCopier, SectionCopy
from tierstore.kernels.launch import Launcher

logger = logging.getLogger(__name__)

MAX_ROW_DIMS = 4
MAX_GRID_Y = 65535
_ANCHORS = 8  # word views of page storages kept (``TritonCopier._word_anchor``)
# Descriptor fields (int64 each), see _page_copy_kernel.
_F_SRC, _F_DST, _F_BLK, _F_JSTRIDE, _F_WIDTH, _F_NROWS, _F_NCOLT, _F_TILE0 = range(8)
_F_SIZE = 8  # 4 row-dim sizes
_F_SS = 12  # 4 source strides (words)
_F_DS = 16  # 4 page strides (words)
NF = 20


# Arguments that vary with the scratch row a transfer starts at (the ids' row, the first page's
# offset) are not specialized: each new alignment or divisibility would compile (or load) another
# variant in the middle of a run, and loading a module can synchronize the device. The 16-byte
# facts the copy needs are passed explicitly (VEC, ``tl.multiple_of``).
@triton.jit(do_not_specialize=["page_start0", "page_stride"],
            do_not_specialize_on_alignment=["ids_ptr", "page_delta_ptr"])
def _page_copy_kernel(
    src_base,  # word pointer: anchor of the source storages
    page_base,  # word pointer: anchor of the page buffers
    desc_ptr,  # int64 [n_sections, NF]
    tile_sec_ptr,  # int32 [n_tiles]: section of each tile
    ids_ptr,  # int64 [n_pages * bpp]: kernel block ids
    page_delta_ptr,  # int64 [n_pages]: page start, in words from page_base (not read when STRIDED)
    page_start0,  # STRIDED: page 0's start, in words from page_base
    page_stride,  # STRIDED: words from one page's start to the next
    bpp,
    tile_offset,
    NF: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    ROW_DIMS: tl.constexpr,
    SCATTER: tl.constexpr,
    VEC: tl.constexpr,  # words per 16 bytes when every row start and width is 16-byte aligned, else 1
    ZERO: tl.constexpr = False,  # gather only: the descriptors are alignment gaps; write zeros
    STRIDED: tl.constexpr = False,  # pages evenly spaced: starts from page_start0/page_stride, no table
):
    pb = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) + tile_offset
    sec = tl.load(tile_sec_ptr + t).to(tl.int64)
    d = desc_ptr + sec * NF
    src_sec = tl.load(d + 0)
    dst_sec = tl.load(d + 1)
    blk_stride = tl.load(d + 2)
    j_stride = tl.load(d + 3)
    width = tl.load(d + 4)
    n_rows = tl.load(d + 5).to(tl.int32)
    n_col_tiles = tl.load(d + 6)
    local = t.to(tl.int64) - tl.load(d + 7)
    row_tile = local // n_col_tiles
    col_tile = local - row_tile * n_col_tiles
    page = pb // bpp
    j = pb - page * bpp
    blk = tl.load(ids_ptr + pb)
    if STRIDED:  # noqa: SIM108 - a constexpr branch: the other side is not compiled
        page_start = page_start0 + page * page_stride
    else:
        page_start = tl.load(page_delta_ptr + page)

    r = row_tile.to(tl.int32) * ROWS + tl.arange(0, ROWS)
    rmask = r < n_rows
    q = r
    src_row = tl.zeros([ROWS], dtype=tl.int64)
    dst_row = tl.zeros([ROWS], dtype=tl.int64)
    for k in tl.static_range(ROW_DIMS - 1):  # peel the inner row dims: 3, 2, 1
        size = tl.load(d + 8 + 3 - k).to(tl.int32)
        i = q % size
        q = q // size
        src_row += i.to(tl.int64) * tl.load(d + 12 + 3 - k)
        dst_row += i.to(tl.int64) * tl.load(d + 16 + 3 - k)
    src_row += q.to(tl.int64) * tl.load(d + 12 + 4 - ROW_DIMS)
    dst_row += q.to(tl.int64) * tl.load(d + 16 + 4 - ROW_DIMS)

    src_start = src_sec + blk * blk_stride
    dst_start = page_start + dst_sec + j * j_stride
    if VEC > 1:  # alignment facts the host checked: lets the compiler issue 16-byte accesses
        width = tl.multiple_of(width, VEC)
        src_start = tl.multiple_of(src_start, VEC)
        dst_start = tl.multiple_of(dst_start, VEC)
        src_row = tl.multiple_of(src_row, VEC)
        dst_row = tl.multiple_of(dst_row, VEC)
    c = col_tile * COLS + tl.arange(0, COLS).to(tl.int64)
    if SCATTER:  # a negative block id: a page that failed verification; write nothing
        width = tl.where(blk >= 0, width, 0)
    if ZERO:  # a gap is one row per page: only the page's first kernel block writes it
        width = tl.where(j == 0, width, 0)
    mask = rmask[:, None] & (c < width)[None, :]
    src_off = src_start + src_row[:, None] + c[None, :]
    dst_off = dst_start + dst_row[:, None] + c[None, :]
    if ZERO:  # no source is read
        tl.store(page_base + dst_off, tl.zeros([ROWS, COLS], dtype=page_base.dtype.element_ty), mask=mask)
    elif SCATTER:
        vals = tl.load(page_base + dst_off, mask=mask)
        tl.store(src_base + src_off, vals, mask=mask)
    else:
        vals = tl.load(src_base + src_off, mask=mask)
        tl.store(page_base + dst_off, vals, mask=mask)


_COPY_LAUNCH = Launcher(_page_copy_kernel)  # through libcuda, GIL kept, where the kernel allows


@dataclass(frozen=True)
class _SectionRows:
    """One section as rows of contiguous elements (strides in bytes)."""

    sec: SectionCopy
    width_bytes: int
    sizes: tuple[int, ...]  # row dims, outer to inner (<= MAX_ROW_DIMS)
    src_strides: tuple[int, ...]
    dst_strides: tuple[int, ...]
    blk_stride: int
    j_stride: int
    src_delta: int  # bytes from the section source's storage base to its first element

    @property
    def n_rows(self) -> int:
        return math.prod(self.sizes)

    def alignment(self) -> int:
        """Largest power of two (<= 16) dividing every byte quantity of this section."""
        g = math.gcd(self.width_bytes, self.blk_stride, self.j_stride, self.sec.offset,
                     self.sec.source.data_ptr(), self.sec.source.untyped_storage().data_ptr(),
                     *self.src_strides, *self.dst_strides)
        g = math.gcd(g, 16)
        return g if g else 16

    def word(self) -> int:
        """Widest word (<= 8 bytes) dividing every byte quantity of this section."""
        return math.gcd(self.alignment(), 8)


def _section_rows(sec: SectionCopy) -> _SectionRows:
    src = sec.source
    item = sec.spec.itemsize
    shape = sec.spec.shape
    block = sec.block_shape
    dst_elem = [1] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        dst_elem[k] = dst_elem[k + 1] * shape[k + 1]
    dims = [(n, s, t) for n, s, t in zip(block, src.stride()[1:], dst_elem, strict=True) if n != 1]
    merged: list[tuple[int, int, int]] = []
    for n, s, t in dims:  # outer to inner; merge into the previous (outer) dim when dense in both
        if merged:
            pn, ps, pt = merged[-1]
            if ps == s * n and pt == t * n:
                merged[-1] = (pn * n, s, t)
                continue
        merged.append((n, s, t))
    width = 1
    if merged and merged[-1][1] == 1 and merged[-1][2] == 1:
        width = merged.pop()[0]
    if len(merged) > MAX_ROW_DIMS:
        raise ValueError(
            f"section {sec.spec.name!r}: source view strides {tuple(src.stride())} leave "
            f"{len(merged)} row dims after coalescing; the Triton path handles {MAX_ROW_DIMS}"
        )
    if not merged:
        merged = [(1, 0, 0)]
    j_stride = 0 if sec.concat_dim is None else block[sec.concat_dim] * dst_elem[sec.concat_dim] * item
    storage_base = src.untyped_storage().data_ptr()
    return _SectionRows(
        sec=sec,
        width_bytes=width * item,
        sizes=tuple(n for n, _, _ in merged),
        src_strides=tuple(s * item for _, s, _ in merged),
        dst_strides=tuple(t * item for _, _, t in merged),
        blk_stride=src.stride(0) * item,
        j_stride=j_stride,
        src_delta=src.data_ptr() - storage_base,
    )


@dataclass
class _Launch:
    word: int
    rows: int
    cols: int
    row_dims: int
    n_tiles: int
    vec: int  # VEC constexpr (1: no 16-byte alignment hints)
    desc: torch.Tensor
    tile_sec: torch.Tensor
    src_anchor: torch.Tensor  # word-typed tensor at the first section's storage base
    zero: bool = False  # a gather's gap-zeroing launch (ZERO): descriptors are gaps, not sections


def _word_view_of_storage(t: torch.Tensor, word: int) -> torch.Tensor:
    """A word-typed 1-D tensor starting at ``t``'s storage base (only its pointer is used)."""
    storage = t.untyped_storage()
    out = torch.empty(0, dtype=INT_DTYPE_BY_SIZE[word], device=t.device)
    return out.set_(storage, 0, (storage.nbytes() // word,), (1,))


def _is_compile_error(exc: Exception) -> bool:
    return type(exc).__name__ in ("CompilationError", "CompileTimeAssertionFailure") or "compil" in str(exc).lower()


def _pow2_at_most(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


class TritonCopier(PlannedCopier):
    """GroupCopier implemented with one Triton kernel family (see ``tierstore.kernels``)."""

    backend = "triton"

    def __init__(
        self,
        sources: Sequence[torch.Tensor],
        layout: PageLayout,
        blocks_per_page: int,
        concat_dims: Sequence[int | None],
        *,
        tile_words: int = 4096,
        max_cols: int = 1024,
        num_warps: int = 4,
        vector_hints: bool = True,
    ) -> None:
        super().__init__(sources, layout, blocks_per_page, concat_dims)
        self.rows = [_section_rows(s) for s in self.sections]
        self.tile_words = tile_words
        self.max_cols = max_cols
        self.num_warps = num_warps
        self.vector_hints = vector_hints
        self._plans: dict[tuple[int, bool], list[_Launch]] = {}
        self._anchors: dict[tuple[int, int, int, torch.device], torch.Tensor] = {}  # _word_anchor
        self._lock = threading.Lock()

    # -- planning -------------------------------------------------------------------------
    def _plan(self, page_align: int, gaps: bool = False) -> list[_Launch]:
        """Launches of a copy; ``gaps`` (gathers): plus those that zero the alignment gaps."""
        with self._lock:
            plan = self._plans.get((page_align, gaps))
            if plan is None:
                plan = self._build_plan(page_align)
                if gaps:
                    plan = plan + self._gap_launches(page_align)
                self._plans[(page_align, gaps)] = plan
            return plan

    def _gap_launches(self, page_align: int) -> list[_Launch]:
        """One ZERO launch per word size among the layout's gaps (usually one; none without gaps).

        Each gap is a one-row descriptor (no source); a gap is < 64 bytes, so one tile covers it.
        Kept apart from the section launches so that their word size and 16-byte hints are
        never narrowed by a gap's alignment."""
        by_word: dict[int, list[tuple[int, int]]] = {}
        for a, b in self.layout.gaps:
            word = math.gcd(a, b - a, page_align, 8)
            by_word.setdefault(word, []).append((a, b))
        launches = []
        anchor = self.sections[0].source
        for word, gaps in by_word.items():
            cols = triton.next_power_of_2(max((b - a) // word for a, b in gaps))
            desc = [[0, a // word, 0, 0, (b - a) // word, 1, 1, i, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0]
                    for i, (a, b) in enumerate(gaps)]
            launches.append(_Launch(
                word=word, rows=1, cols=cols, row_dims=1, n_tiles=len(gaps), vec=1,
                desc=torch.tensor(desc, dtype=torch.int64).to(self.device),
                tile_sec=torch.arange(len(gaps), dtype=torch.int32).to(self.device),
                src_anchor=_word_view_of_storage(anchor, word), zero=True,
            ))
        return launches

    def _build_plan(self, page_align: int) -> list[_Launch]:
        buckets: dict[tuple[int, int], list[_SectionRows]] = {}
        for sr in self.rows:
            word = math.gcd(sr.word(), page_align, 8)
            width = sr.width_bytes // word
            cols = min(triton.next_power_of_2(width), self.max_cols)
            buckets.setdefault((word, cols), []).append(sr)
        launches = []
        for (word, cols), members in buckets.items():
            max_rows = max(sr.n_rows for sr in members)
            rows = max(1, min(triton.next_power_of_2(max_rows), _pow2_at_most(self.tile_words // cols)))
            row_dims = max(len(sr.sizes) for sr in members)
            aligned16 = self.vector_hints and page_align % 16 == 0 and all(sr.alignment() == 16 for sr in members)
            vec = 16 // word if aligned16 and cols >= 16 // word else 1
            anchor_src = members[0].sec.source
            anchor_base = anchor_src.untyped_storage().data_ptr()
            desc_rows: list[list[int]] = []
            tile_sec: list[int] = []
            for i, sr in enumerate(members):
                src_abs = sr.sec.source.untyped_storage().data_ptr() + sr.src_delta
                delta = src_abs - anchor_base
                if delta % (word * vec):
                    raise ValueError(f"section {sr.sec.spec.name!r} is not {word * vec}-byte aligned to section 0's storage")
                pad = MAX_ROW_DIMS - len(sr.sizes)
                sizes = (1,) * pad + sr.sizes
                ss = (0,) * pad + tuple(s // word for s in sr.src_strides)
                ds = (0,) * pad + tuple(s // word for s in sr.dst_strides)
                width = sr.width_bytes // word
                n_row_tiles = -(-sr.n_rows // rows)
                n_col_tiles = -(-width // cols)
                desc_rows.append([
                    delta // word, sr.sec.offset // word, sr.blk_stride // word, sr.j_stride // word,
                    width, sr.n_rows, n_col_tiles, len(tile_sec), *sizes, *ss, *ds,
                ])
                tile_sec.extend([i] * (n_row_tiles * n_col_tiles))
            if len(tile_sec) >= 2**31:
                raise ValueError("too many tiles for one group copy")
            launches.append(_Launch(
                word=word, rows=rows, cols=cols, row_dims=row_dims, n_tiles=len(tile_sec), vec=vec,
                desc=torch.tensor(desc_rows, dtype=torch.int64).to(self.device),
                tile_sec=torch.tensor(tile_sec, dtype=torch.int32).to(self.device),
                src_anchor=_word_view_of_storage(anchor_src, word),
            ))
        return launches

    # -- copies ---------------------------------------------------------------------------
    def _word_anchor(self, t: torch.Tensor, word: int) -> tuple[torch.Tensor, int]:
        """(word view at ``t``'s storage base, that base's address), cached per storage.

        Cached because the transfer path calls this for every launch of every batch on the same
        few storages (its scratch, the staging slab), and each torch call there is a GIL
        hand-off on the thread that drives the pipeline (docs/measurements/scaling.md). The
        cache holds at most ``_ANCHORS`` views (each keeps its storage alive until evicted)."""
        storage = t.untyped_storage()
        base = storage.data_ptr()
        key = (base, storage.nbytes(), word, t.device)
        view = self._anchors.get(key)
        if view is None:
            with self._lock:
                if len(self._anchors) >= _ANCHORS:
                    self._anchors.pop(next(iter(self._anchors)))
                view = self._anchors[key] = _word_view_of_storage(t, word)
        return view, base

    def _page_table(self, pages: PagesArg, n: int) -> tuple[torch.Tensor, torch.Tensor | None, int, int, int]:
        """(anchor tensor, page start offsets in bytes from its storage base or None when the pages
        are evenly spaced, first page's offset, page stride in bytes, alignment)."""
        if isinstance(pages, torch.Tensor):  # [n, nbytes] rows: strided, no table to build
            base = pages.untyped_storage().data_ptr()
            start = pages.data_ptr() - base
            stride = pages.stride(0) if n > 1 else 0
            align = math.gcd(start, stride, base, 16) or 16
            return pages, None, start, stride, align
        anchor = pages[0]
        base = anchor.untyped_storage().data_ptr()
        offs = [p.data_ptr() - base for p in pages]
        align = math.gcd(*offs, base, 16) or 16
        return anchor, torch.tensor(offs, dtype=torch.int64).to(self.device), 0, 0, align

    def _run(self, block_ids: torch.Tensor, pages: PagesArg, scatter: bool) -> None:
        n = self.check_batch(block_ids, pages)
        if n == 0:
            return
        ids = block_ids
        if ids.device != self.device or ids.dtype != torch.int64 or not ids.is_contiguous():
            ids = ids.to(device=self.device, dtype=torch.int64).contiguous()
        page_anchor, table, start, stride, align = self._page_table(pages, n)
        for launch in self._plan(align, gaps=not scatter):
            w = launch.word
            page_words, _ = self._word_anchor(page_anchor, w)
            # STRIDED: starts in words from scalars; else a table (scaled on the device)
            starts = ids if table is None else table // w
            for tile0 in range(0, launch.n_tiles, MAX_GRID_Y):
                grid = (n * self.blocks_per_page, min(MAX_GRID_Y, launch.n_tiles - tile0))
                args = (launch.src_anchor, page_words, launch.desc, launch.tile_sec, ids, starts,
                        start // w, stride // w, self.blocks_per_page, tile0)
                meta = dict(NF=NF, ROWS=launch.rows, COLS=launch.cols, ROW_DIMS=launch.row_dims,
                            SCATTER=scatter, ZERO=launch.zero, STRIDED=table is None, num_warps=self.num_warps)
                try:
                    _COPY_LAUNCH.launch(grid, *args, VEC=launch.vec, **meta)
                except Exception as exc:  # a Triton build that rejects the hints: run without them
                    if launch.vec == 1 or not _is_compile_error(exc):
                        raise
                    logger.warning("Triton rejected 16-byte alignment hints (%s); copying without them", exc)
                    launch.vec = 1
                    _COPY_LAUNCH.launch(grid, *args, VEC=1, **meta)

    def gather(self, block_ids: torch.Tensor, pages: PagesArg) -> None:
        """Blocks -> pages: every byte of each page is written (sections, and zero gaps)."""
        self._run(block_ids, pages, scatter=False)

    def scatter(self, pages: PagesArg, block_ids: torch.Tensor) -> None:
        """Pages -> blocks; a negative block id skips that kernel block (nothing is written)."""
        self._run(block_ids, pages, scatter=True)

    def describe(self) -> list[dict[str, int]]:
        """Launch shapes of the section copies for the natural page alignment (for benchmarks and
        docs; a gather of a layout with gaps adds one small gap-zeroing launch per word size)."""
        return [
            {"word": la.word, "rows": la.rows, "cols": la.cols, "row_dims": la.row_dims, "tiles": la.n_tiles,
             "vec": la.vec}
            for la in self._plan(16)
        ]
