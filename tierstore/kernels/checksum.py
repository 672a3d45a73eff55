"""xxh3-64 section checksums of canonical pages, computed on the pages' device (Triton).

Contract (docs/DESIGN.md §6, checksums and the GPU path): ``SectionHasher(layout, device).hash(pages)`` takes
``pages`` ``[n, layout.nbytes]`` uint8 (rows contiguous; a row stride larger than
``layout.nbytes`` is accepted) on ``device`` and returns ``[n, len(layout.sections)]`` int64
whose bit patterns are exactly ``xxhash.xxh3_64_intdigest(section_bytes)`` (seed 0, default
192-byte secret) -- the section checksums of the page format (``tierstore.format.checksums.checksum``;
unchanged since format 1). Gap bytes between sections are not hashed: readers check them
(``format.check_gaps``).
Convert a value with ``v & 0xFFFFFFFFFFFFFFFF``. ``hash(pages, out=)`` writes given rows instead
(on CUDA they may be pinned host memory: no copy back). ``verify(pages, expect)`` compares against
sums of the same form and returns ``[n]`` bool; ``check_and_mask`` is a load's whole check in
one launch (compare, skip flags, masked block ids, flags written to pinned memory). Both only queue work on the current stream
(no host synchronisation); every length is supported (``supported`` is False only when Triton
cannot run on the device: no Triton, or CPU tensors without ``TRITON_INTERPRET=1``).

Algorithm (XXH3_64bits of xxhash 0.8: ``xxhash.h`` of https://github.com/Cyan4973/xxHash, the
library the ``xxhash`` Python package wraps), two launches per call:

* long sections (> 240 bytes), one program per (section, page): the input is cut into 1024-byte
  blocks of 16 stripes x 8 lanes of 64-bit words. Within a block each accumulator lane only
  receives wrapping sums (``acc[l^1] += x``, ``acc[l] += lo32(x ^ key) * hi32(x ^ key)``), so a
  block reduces to one 8-lane contribution computed in parallel; a scramble between blocks
  makes the blocks a sequential chain per section. Each loop iteration loads ``NB`` blocks at
  once (latency overlap), reduces them, then chains the ``NB`` contributions. Then the last
  partial block, the last stripe (byte loads, any alignment), the merge and the avalanche.
  Programs are ordered longest section first so short sections fill the tail of the grid.
* short sections (<= 240 bytes: 0, 1-3, 4-8, 9-16, 17-128, 129-240), ``BLOCK`` (page,
  section) items per program: every length class is evaluated with masked byte loads and the
  right one selected per item. Slow per byte but these sections are tiny and rare.

64x64->128-bit products (``mul128_fold64``) are built from 32-bit halves in uint64 arithmetic
(works in the interpreter too); all hash arithmetic is tl.uint64 (wrapping, logical shifts).
Bulk words are loaded as 64-bit words when the page base and row stride are 8-byte aligned
(16-byte alignment hints when they are 16-byte aligned), else assembled from bytes.

CPU: set ``TRITON_INTERPRET=1`` before this module is imported (tests do); the interpreter is
slow and meant for tests. Threading: a SectionHasher is immutable after construction (small
constant tensors on its device); calls may come from any thread and launch on that thread's
current CUDA stream.
"""

from __future__ import annotations

import os

import torch

from tierstore.format.checksums import checksum_as_int64
from tierstore.format.page_layout import PageLayout
from tierstore.kernels.launch import Launcher

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is a dependency where kernels run
    HAVE_TRITON = False

# XXH3_kSecret, the default 192-byte secret.
SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
P32_1, P32_2, P32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
P64_1, P64_2, P64_3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
P64_4, P64_5 = 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5
PRIME_MX1, PRIME_MX2 = 0x165667919E3779F9, 0x9FB21C651E98DF25
INIT_ACC = (P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1)
MIDSIZE_MAX = 240
N_KEYS = len(SECRET) - 7  # _KEY_TAB[o] = readLE64(SECRET + o), o = 0 .. 184
_KEY_TAB = [int.from_bytes(SECRET[o : o + 8], "little") for o in range(N_KEYS)]
# Tuning of the long kernel: 1024-byte blocks per loop iteration and warps per program. Measured
# on an H200 (256 pages of 32 x 64 KiB / 32 x 256 KiB, 64 GDN pages of 6 x 1 MiB + 6 x 36 KiB):
# NB=4, 1 warp: 2.6 / 2.8 / 1.2 TB/s; NB=8, 4 warps: 0.55 / 0.56 / 0.38 TB/s; more warps or
# blocks per program only add cross-thread reductions. Double-buffering the tiles gained nothing.
LONG_NB = 4
LONG_WARPS = 1
SHORT_BLOCK = 64




if HAVE_TRITON:

    @triton.jit
    def _fold64(a, b):
        """XXH3_mul128_fold64: low ^ high 64 bits of the 128-bit product (uint64 in, out)."""
        m32 = 0xFFFFFFFF
        a_lo = a & m32
        a_hi = a >> 32
        b_lo = b & m32
        b_hi = b >> 32
        lo_lo = a_lo * b_lo
        hi_lo = a_hi * b_lo
        lo_hi = a_lo * b_hi
        hi_hi = a_hi * b_hi
        cross = (lo_lo >> 32) + (hi_lo & m32) + lo_hi
        upper = (hi_lo >> 32) + (cross >> 32) + hi_hi
        lower = (cross << 32) | (lo_lo & m32)
        return lower ^ upper

    @triton.jit
    def _avalanche(h):
        """XXH3_avalanche."""
        h = h ^ (h >> 37)
        h = h * 0x165667919E3779F9
        return h ^ (h >> 32)

    @triton.jit
    def _avalanche64(h):
        """XXH64_avalanche."""
        h = h ^ (h >> 33)
        h = h * 0xC2B2AE3D27D4EB4F
        h = h ^ (h >> 29)
        h = h * 0x165667B19E3779F9
        return h ^ (h >> 32)

    @triton.jit
    def _key(tab_ptr, o):
        """readLE64(secret + o) from the host-built table (o: byte offset, scalar or tensor)."""
        return tl.load(tab_ptr + o).to(tl.uint64, bitcast=True)

    @triton.jit
    def _read64(base_u8, off, mask):
        """Little-endian 64-bit words from bytes at any alignment (masked bytes read as 0)."""
        v = tl.load(base_u8 + off, mask=mask, other=0).to(tl.uint64)
        for k in tl.static_range(1, 8):
            v |= tl.load(base_u8 + off + k, mask=mask, other=0).to(tl.uint64) << (8 * k)
        return v

    @triton.jit
    def _load_words(base_u8, start, word_idx, mask, ALIGNED: tl.constexpr):
        """64-bit words ``word_idx`` of the input starting at byte ``start`` (int64)."""
        if ALIGNED:
            base64 = base_u8.to(tl.pointer_type(tl.uint64))
            return tl.load(base64 + (start // 8 + word_idx), mask=mask, other=0)
        else:
            return _read64(base_u8, start + word_idx * 8, mask)

    @triton.jit
    def _mul_lo_hi(v):
        """lo32(v) * hi32(v) as a 32x32->64 multiply."""
        return v.to(tl.uint32).to(tl.uint64) * (v >> 32).to(tl.uint32).to(tl.uint64)

    @triton.jit
    def _lane_swap(v, AX: tl.constexpr):
        """[..., 4, 2] lanes l (last axis AX) -> values of lane l ^ 1 (pair sum minus self)."""
        pair = tl.sum(v, axis=AX)
        return tl.expand_dims(pair, AX) - v

    # ``out_ptr``: a transfer's result rows start at its scratch row: alignment not specialized
    # (a variant per row offset would compile, or load, mid-run)
    @triton.jit(do_not_specialize_on_alignment=["out_ptr"])
    def _hash_long_kernel(
        pages_u8,  # uint8 pointer: the pages
        tab_ptr,  # int64 [N_KEYS + 8]: readLE64(secret + o), then the 8 initial accumulators
        desc_ptr,  # int64 [n_long, 3]: section byte offset, length, output column
        out_ptr,  # int64 [n_pages, n_cols]
        n_pages,
        row_stride,  # bytes between pages
        n_cols,
        N_KEYS: tl.constexpr,
        NB: tl.constexpr,  # 1024-byte blocks loaded per loop iteration
        ALIGNED: tl.constexpr,  # page base and row stride are multiples of 8 bytes
        VEC2: tl.constexpr,  # ... of 16 bytes (alignment hints)
    ):
        pid = tl.program_id(0).to(tl.int64)
        si = pid // n_pages
        page = pid - si * n_pages
        sec_off = tl.load(desc_ptr + si * 3)
        length = tl.load(desc_ptr + si * 3 + 1)
        col = tl.load(desc_ptr + si * 3 + 2)
        start = page * row_stride + sec_off  # byte offset of the section, 64-aligned in the page
        if VEC2:
            start = tl.multiple_of(start, 16)

        s_idx = tl.arange(0, 16)[:, None, None]  # stripe within a block
        q = tl.arange(0, 4)[None, :, None]
        r = tl.arange(0, 2)[None, None, :]
        lane = q * 2 + r  # [1, 4, 2]
        lane2 = tl.arange(0, 4)[:, None] * 2 + tl.arange(0, 2)[None, :]  # [4, 2]
        key_acc = _key(tab_ptr, (s_idx + lane) * 8)  # [16, 4, 2]: secret + 8 * stripe + 8 * lane
        key_scr = _key(tab_ptr, 128 + lane2 * 8)  # [4, 2]: secret + 192 - 64
        acc = _key(tab_ptr, N_KEYS + lane2)  # [4, 2]: XXH3_INIT_ACC

        n_full = (length - 1) // 1024
        b_idx = tl.arange(0, NB)
        blk_word = b_idx[:, None, None, None] * 128 + (s_idx * 8 + lane)[None, :, :, :]  # [NB,16,4,2]
        for it in range(0, n_full, NB):
            bmask = (it + b_idx) < n_full
            x = _load_words(pages_u8, start, it * 128 + blk_word, bmask[:, None, None, None], ALIGNED)
            # one reduction over the stripes: lane l gets lo*hi of its own word + lane l^1's word
            contrib = tl.sum(_mul_lo_hi(x ^ key_acc[None, :, :, :]) + _lane_swap(x, 3), axis=1)
            for j in tl.static_range(NB):
                cj = tl.sum(tl.where(b_idx[:, None, None] == j, contrib, 0), axis=0)
                a2 = acc + cj
                a2 = (a2 ^ (a2 >> 47)) ^ key_scr
                a2 = a2 * 0x9E3779B1
                acc = tl.where(it + j < n_full, a2, acc)

        # last partial block: the stripes before the last byte, no scramble
        n_stripes = ((length - 1) - n_full * 1024) // 64
        smask = s_idx < n_stripes
        x = _load_words(pages_u8, start, n_full * 128 + s_idx * 8 + lane, smask, ALIGNED)
        acc += tl.sum(tl.where(smask, _mul_lo_hi(x ^ key_acc), 0) + _lane_swap(x, 2), axis=0)

        # last stripe: bytes [length - 64, length), secret + 192 - 64 - 7
        x = _read64(pages_u8, start + length - 64 + lane2 * 8, lane2 >= 0)
        acc += _mul_lo_hi(x ^ _key(tab_ptr, 121 + lane2 * 8)) + _lane_swap(x, 1)

        # merge: pairs (2i, 2i+1) with secret + 11 + 16 i
        km = acc ^ _key(tab_ptr, 11 + lane2 * 8)
        a0 = tl.sum(tl.where(lane2 % 2 == 0, km, 0), axis=1)
        a1 = tl.sum(tl.where(lane2 % 2 == 1, km, 0), axis=1)
        res = length.to(tl.uint64) * 0x9E3779B185EBCA87 + tl.sum(_fold64(a0, a1), axis=0)
        res = _avalanche(res)
        tl.store(out_ptr + page * n_cols + col, res.to(tl.int64, bitcast=True))

    @triton.jit
    def _mix16(pages_u8, start, pos, length, ok, tab_ptr, key_off):
        """XXH3_mix16B(input + pos, secret + key_off, seed 0), masked to the section."""
        m = ok & (pos >= 0) & (pos + 16 <= length)
        lo = _read64(pages_u8, start + pos, m) ^ _key(tab_ptr, key_off)
        hi = _read64(pages_u8, start + pos + 8, m) ^ _key(tab_ptr, key_off + 8)
        return _fold64(lo, hi)

    # XXH3_64bits of a short section, one helper per length band as in xxhash.h
    # (XXH3_len_1to3_64b ... XXH3_len_129to240_64b); each is masked to its band by ``m``.
    @triton.jit
    def _len_1to3(pages_u8, start, length, ulen, m, tab_ptr):
        c1 = tl.load(pages_u8 + start, mask=m, other=0).to(tl.uint64)
        c2 = tl.load(pages_u8 + start + (length >> 1), mask=m, other=0).to(tl.uint64)
        c3 = tl.load(pages_u8 + start + length - 1, mask=m, other=0).to(tl.uint64)
        combined = (c1 << 16) | (c2 << 24) | c3 | (ulen << 8)
        bitflip = (_key(tab_ptr, 0) & 0xFFFFFFFF) ^ (_key(tab_ptr, 4) & 0xFFFFFFFF)
        return _avalanche64(combined ^ bitflip)

    @triton.jit
    def _len_4to8(pages_u8, start, length, ulen, m, tab_ptr):
        in1 = _read64(pages_u8, start, m) & 0xFFFFFFFF
        in2 = _read64(pages_u8, start + length - 4, m) & 0xFFFFFFFF
        h = (in2 + (in1 << 32)) ^ (_key(tab_ptr, 8) ^ _key(tab_ptr, 16))
        h = h ^ (((h << 49) | (h >> 15)) ^ ((h << 24) | (h >> 40)))
        h = h * 0x9FB21C651E98DF25
        h = h ^ ((h >> 35) + ulen)
        h = h * 0x9FB21C651E98DF25
        return h ^ (h >> 28)

    @triton.jit
    def _len_9to16(pages_u8, start, length, ulen, m, tab_ptr):
        lo = _read64(pages_u8, start, m) ^ (_key(tab_ptr, 24) ^ _key(tab_ptr, 32))
        hi = _read64(pages_u8, start + length - 8, m) ^ (_key(tab_ptr, 40) ^ _key(tab_ptr, 48))
        sw = (
            ((lo << 56) & 0xFF00000000000000)
            | ((lo << 40) & 0x00FF000000000000)
            | ((lo << 24) & 0x0000FF0000000000)
            | ((lo << 8) & 0x000000FF00000000)
            | ((lo >> 8) & 0x00000000FF000000)
            | ((lo >> 24) & 0x0000000000FF0000)
            | ((lo >> 40) & 0x000000000000FF00)
            | ((lo >> 56) & 0x00000000000000FF)
        )
        return _avalanche(ulen + sw + hi + _fold64(lo, hi))

    @triton.jit
    def _len_17to128(pages_u8, start, length, ulen, m, tab_ptr):
        acc = ulen * 0x9E3779B185EBCA87
        for i in tl.static_range(4):
            mi = m & (length > 32 * i)
            part = _mix16(pages_u8, start, 16 * i, length, mi, tab_ptr, 32 * i)
            part += _mix16(pages_u8, start, length - 16 * (i + 1), length, mi, tab_ptr, 32 * i + 16)
            acc += tl.where(mi, part, 0)
        return _avalanche(acc)

    @triton.jit
    def _len_129to240(pages_u8, start, length, ulen, m, tab_ptr):
        acc = ulen * 0x9E3779B185EBCA87
        for i in tl.static_range(8):
            acc += _mix16(pages_u8, start, 16 * i, length, m, tab_ptr, 16 * i)
        acc_end = _mix16(pages_u8, start, length - 16, length, m, tab_ptr, 136 - 17)
        acc = _avalanche(acc)
        for i in tl.static_range(8, 15):
            mi = m & (i < length // 16)
            acc_end += tl.where(mi, _mix16(pages_u8, start, 16 * i, length, mi, tab_ptr, 16 * (i - 8) + 3), 0)
        return _avalanche(acc + acc_end)

    @triton.jit(do_not_specialize_on_alignment=["out_ptr"])
    def _hash_short_kernel(
        pages_u8,
        tab_ptr,
        desc_ptr,  # int64 [n_short, 3]
        out_ptr,
        n_items,  # n_short * n_pages
        n_pages,
        row_stride,
        n_cols,
        BLOCK: tl.constexpr,
    ):
        item = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = item < n_items
        si = tl.where(ok, item // n_pages, 0)
        page = item - si * n_pages
        sec_off = tl.load(desc_ptr + si * 3, mask=ok, other=0)
        length = tl.load(desc_ptr + si * 3 + 1, mask=ok, other=0)
        col = tl.load(desc_ptr + si * 3 + 2, mask=ok, other=0)
        start = page * row_stride + sec_off
        ulen = length.to(tl.uint64)

        h0 = _avalanche64(_key(tab_ptr, 56) ^ _key(tab_ptr, 64)) + (ulen * 0)  # 0 bytes
        h13 = _len_1to3(pages_u8, start, length, ulen, ok & (length >= 1) & (length <= 3), tab_ptr)
        h48 = _len_4to8(pages_u8, start, length, ulen, ok & (length >= 4) & (length <= 8), tab_ptr)
        h916 = _len_9to16(pages_u8, start, length, ulen, ok & (length >= 9) & (length <= 16), tab_ptr)
        h17 = _len_17to128(pages_u8, start, length, ulen, ok & (length >= 17) & (length <= 128), tab_ptr)
        h129 = _len_129to240(pages_u8, start, length, ulen, ok & (length >= 129) & (length <= 240), tab_ptr)

        res = tl.where(length == 0, h0, h13)
        res = tl.where(length >= 4, h48, res)
        res = tl.where(length >= 9, h916, res)
        res = tl.where(length >= 17, h17, res)
        res = tl.where(length >= 129, h129, res)
        tl.store(out_ptr + page * n_cols + col, res.to(tl.int64, bitcast=True), mask=ok)

    @triton.jit(do_not_specialize_on_alignment=["sums_ptr", "meta_ptr", "ids_ptr", "ids_out_ptr", "ok_ptr"])
    def _check_mask_kernel(
        sums_ptr,  # int64 [n, n_sec], rows contiguous: the computed sums
        meta_ptr,  # int64 [n, meta_stride]: from column want_col the expected sums (n_sec), then the skip flag
        ids_ptr,  # int64 [n, ids_stride]: the block ids (bpp per row)
        ids_out_ptr,  # int64 [n, bpp] contiguous: the block ids, or -1 where the page failed
        ok_ptr,  # uint8 [n]: 1 when the page matched (or was not to be checked)
        n_sec,
        bpp,
        meta_stride,
        want_col,
        ids_stride,
        SEC: tl.constexpr,
        BPP: tl.constexpr,
    ):
        page = tl.program_id(0).to(tl.int64)
        s = tl.arange(0, SEC)
        sm = s < n_sec
        row = meta_ptr + page * meta_stride + want_col
        got = tl.load(sums_ptr + page * n_sec + s, mask=sm, other=0)
        want = tl.load(row + s, mask=sm, other=0)
        skip = tl.load(row + n_sec)
        bad = tl.sum((got != want).to(tl.int32), axis=0)
        ok = (bad == 0) | (skip != 0)
        b = tl.arange(0, BPP)
        bm = b < bpp
        ids = tl.load(ids_ptr + page * ids_stride + b, mask=bm, other=-1)
        tl.store(ids_out_ptr + page * bpp + b, tl.where(ok, ids, -1), mask=bm)
        tl.store(ok_ptr + page, ok.to(tl.uint8))

    # Launched through kernels.launch (libcuda, GIL kept) where the compiled kernel allows.
    _LAUNCH = {"hash_long": Launcher(_hash_long_kernel), "hash_short": Launcher(_hash_short_kernel),
               "check_mask": Launcher(_check_mask_kernel)}


def check_and_mask(sums: torch.Tensor, meta: torch.Tensor, want_col: int, ids: torch.Tensor,
                   ids_out: torch.Tensor, ok_out: torch.Tensor) -> None:
    """One launch for a load's check: page i is ok when ``sums[i]`` equals its expected sums or
    its skip flag is set; ``ids_out[i]`` = ``ids[i]`` if ok, else -1 (the scatter writes
    nothing there); ``ok_out[i]`` = 1 or 0.

    ``meta`` [n, >= want_col + n_sec + 1] int64 rows (row stride free, inner dim contiguous):
    from column ``want_col`` the expected sums (int64 bit patterns), then the skip flag
    (non-zero: not checked). ``ids`` [n, bpp] int64 (row stride free; may be columns of
    ``meta``). ``ok_out`` (uint8 [n]) may be pinned host memory on CUDA (written over PCIe).
    Queued on the current stream; one launch instead of the five tensor operations (compare,
    all, or, where, copy back) it replaces, because each is a GIL hand-off on the thread that
    drives the transfers (docs/measurements/scaling.md)."""
    n, n_sec = sums.shape
    bpp = ids.shape[1]
    if n == 0:
        return
    if (meta.shape[0] != n or meta.shape[1] < want_col + n_sec + 1 or meta.stride(1) != 1
            or not sums.is_contiguous() or ids.shape[0] != n or ids.stride(1) != 1):
        raise ValueError(f"meta {tuple(meta.shape)}, sums {tuple(sums.shape)}, ids {tuple(ids.shape)} do not match")
    if tuple(ids_out.shape) != (n, bpp) or not ids_out.is_contiguous() or ok_out.numel() < n:
        raise ValueError(f"ids_out must be contiguous [{n}, {bpp}] and ok_out hold {n} flags")
    _LAUNCH["check_mask"].launch((n,), sums, meta, ids, ids_out, ok_out, n_sec, bpp, meta.stride(0), want_col,
                                 ids.stride(0), SEC=triton.next_power_of_2(n_sec), BPP=triton.next_power_of_2(bpp),
                                 num_warps=1)


class SectionHasher:
    """xxh3-64 (seed 0) of every section of canonical pages, on the pages' device."""

    def __init__(self, layout: PageLayout, device: torch.device | str) -> None:
        self.layout = layout
        self.device = torch.device(device)
        self.reason: str | None = None
        if not HAVE_TRITON:
            self.reason = "triton is not installed"
        elif self.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            self.reason = "Triton on CPU tensors needs TRITON_INTERPRET=1 set before import"
        elif self.device.type not in ("cpu", "cuda"):
            self.reason = f"no Triton backend for device type {self.device.type!r}"
        self.supported = self.reason is None
        secs = [(layout.offsets[i], s.nbytes, i) for i, s in enumerate(layout.sections)]
        longs = sorted((t for t in secs if t[1] > MIDSIZE_MAX), key=lambda t: (-t[1], t[2]))
        shorts = [t for t in secs if t[1] <= MIDSIZE_MAX]
        self.n_long, self.n_short = len(longs), len(shorts)
        tab = [checksum_as_int64(v) for v in _KEY_TAB + list(INIT_ACC)]
        self._tab = torch.tensor(tab, dtype=torch.int64, device=self.device)
        self._long_desc = torch.tensor(longs or [(0, 0, 0)], dtype=torch.int64, device=self.device)
        self._short_desc = torch.tensor(shorts or [(0, 0, 0)], dtype=torch.int64, device=self.device)

    def _check(self, pages: torch.Tensor) -> None:
        if not self.supported:
            raise RuntimeError(f"SectionHasher not supported here: {self.reason}")
        if pages.dtype != torch.uint8 or pages.dim() != 2:
            raise ValueError(f"pages must be [n, nbytes] uint8, got {tuple(pages.shape)} {pages.dtype}")
        if pages.shape[1] < self.layout.nbytes or (pages.shape[1] > 1 and pages.stride(1) != 1):
            raise ValueError(f"pages rows must hold {self.layout.nbytes} contiguous bytes")
        if pages.device != self.device and not (
            pages.device.type == self.device.type == "cuda" and self.device.index is None
        ):
            raise ValueError(f"pages on {pages.device}, hasher built for {self.device}")

    def hash(self, pages: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[n, n_sections] int64 (uint64 bit patterns), queued on the current stream.

        ``out``: a contiguous [n, n_sections] int64 tensor to write instead of a new one; on CUDA
        it may be pinned host memory (the kernels write it over PCIe: no separate copy back)."""
        self._check(pages)
        n, n_cols = pages.shape[0], len(self.layout.sections)
        if out is None:
            out = torch.empty((n, n_cols), dtype=torch.int64, device=pages.device)
        elif out.dtype != torch.int64 or tuple(out.shape) != (n, n_cols) or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous int64 [{n}, {n_cols}] tensor, got {out.dtype} "
                             f"{tuple(out.shape)}")
        if n == 0 or n_cols == 0:
            return out
        stride = pages.stride(0) if n > 1 else self.layout.nbytes
        tab, long_desc, short_desc = self._tab, self._long_desc, self._short_desc
        if pages.device != tab.device:  # "cuda" vs "cuda:k": follow the pages
            tab, long_desc, short_desc = (t.to(pages.device) for t in (tab, long_desc, short_desc))
        if self.n_long:
            align = (pages.data_ptr() | stride) & 15
            _LAUNCH["hash_long"].launch(
                (n * self.n_long,), pages, tab, long_desc, out, n, stride, n_cols,
                N_KEYS=N_KEYS, NB=LONG_NB, ALIGNED=align % 8 == 0, VEC2=align == 0,
                num_warps=LONG_WARPS,
            )
        if self.n_short:
            items = n * self.n_short
            _LAUNCH["hash_short"].launch(
                (triton.cdiv(items, SHORT_BLOCK),), pages, tab, short_desc, out, items, n, stride, n_cols,
                BLOCK=SHORT_BLOCK, num_warps=2,
            )
        return out

    def verify(self, pages: torch.Tensor, expect: torch.Tensor) -> torch.Tensor:
        """[n] bool: page i's section sums all equal ``expect[i]`` (int64 bit patterns)."""
        sums = self.hash(pages)
        if expect.shape != sums.shape:
            raise ValueError(f"expect has shape {tuple(expect.shape)}, want {tuple(sums.shape)}")
        return (sums == expect.to(device=sums.device, dtype=torch.int64)).all(dim=1)
