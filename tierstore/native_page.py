"""Whole-page loads and stores in one GIL-free call each, header included (issue 16).

``native.py`` compiles these kernels with the others (``build``) and says when they are ready;
this module holds what is specific to one page file:
- ``PageShape``: the arrays every page of one writer shares (the header template's blank
  bytes, constant ranges and field offsets, the section spans and alignment gaps, the warm
  read plan), built once per (header template, read plan) and passed by reference;
- ``load_page``: open the fan-out directory and the file with the caller's flags, check plain
  file / one link / exact size, read piece by piece with each piece's sections hashed while
  in cache (a file whose first block is not cached: O_DIRECT in one request, then hashed),
  close; then, still without the GIL, check the header
  byte for byte against the template (``HeaderTemplate.parse``'s rules: header checksum, key,
  every constant byte), extract the header's section sums, compare them with the computed
  ones and check the alignment gaps are zero;
- ``verify_pages``: ``load_page`` for each of a batch of files of one directory into one
  buffer, with each good page's ``struct stat`` and token count kept (fsck's fast path,
  ``fsck_batch``);
- ``store_page``: if the final name exists, nothing else (names are content addresses);
  otherwise zero the gaps, hash the sections (or take the caller's sums), write the header
  (``HeaderTemplate.fill``'s bytes) right before the page, create the temp (O_EXCL), write, cut
  the O_DIRECT padding, fsync if asked, close and rename over the final name.

Why: per page, the Python around the I/O (numba dispatch of a dozen arguments, header parse
and fill, the array wrappers) cost about as much GIL time as the rest of the engine; with 16
I/O threads that GIL time, not the file system, capped throughput
(docs/measurements/scaling.md). Here a warm load or a store is one call and a few Python
steps.

Failure policy: nothing raises for I/O. ``load_page`` returns a code: LOAD_BAD_SUM and
LOAD_BAD_GAP (the file was read and identified; the caller names the damage with
``pagefile.check_section_sums`` / ``format.check_gaps``), anything else not a success hands
the load to the Python path, which redoes it and names the error (a header other than the
template's goes to the general reader there). ``store_page`` returns 0, STORE_EXISTS, or a
negative code after which no temp file is left and the Python path redoes the store. The
bytes written are exactly the Python path's (``tests/test_native.py`` compares them).

Threading: the kernels touch only the buffers they are given; a ``PageShape`` is immutable
after construction. Safe from any number of threads at once.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from tierstore import native
from tierstore.format import HeaderTemplate, PageLayout

# load_page's outcomes besides native.LOAD_* and "read this many bytes".
LOAD_BAD_HEADER, LOAD_BAD_SUM, LOAD_BAD_GAP = -6, -7, -8
_BAD_SECTION = 25  # scratch slot holding the first section whose checksum differs
VERIFY_TOKENS = 27  # verify_pages: scratch slot holding a good page's token count
# Scratch slots of ``struct stat`` (x86-64 Linux) that verify_pages' callers read.
ST_DEV, ST_INO, ST_NLINK, ST_MODE, ST_SIZE, ST_MTIME, ST_MTIME_NS, ST_CTIME, ST_CTIME_NS = 0, 1, 2, 3, 6, 11, 12, 13, 14


class PageShape:
    """The arrays every page of one writer (header template) and read plan shares."""

    __slots__ = ("header_len", "size", "plan_end", "plan", "spans", "load_spans", "gaps", "blank", "const_ranges",
                 "sum_offsets", "key_off", "token_off", "sum_off", "sections")

    def __init__(self, tmpl: HeaderTemplate, layout: PageLayout, plan: Sequence[tuple[int, int, int, int]],
                 hashed: bool) -> None:
        """``hashed``: the loads of this shape hash every section (verify); otherwise ``plan``
        is one request and nothing is hashed (the header's sums go to the caller)."""
        np = native.numpy()
        self.header_len = tmpl.header_len
        self.size = tmpl.header_len + layout.nbytes
        self.plan_end = plan[-1][1] if plan else 0
        self.plan = native.rows_array(tuple(plan))
        self.spans = native.rows_array(tuple(layout.spans))  # a store hashes every section
        self.load_spans = self.spans if hashed else native.rows_array(())
        self.sections = len(layout.sections)
        self.gaps = native.rows_array(tuple(layout.gaps))
        self.blank = np.frombuffer(tmpl.blank, dtype=np.uint8)
        self.const_ranges = native.rows_array(tuple(tmpl.const_ranges))
        self.sum_offsets = np.array(tmpl.sum_offsets, dtype=np.int64)
        self.sum_offsets.setflags(write=False)
        self.key_off, self.token_off, self.sum_off = tmpl.key_off, tmpl.token_off, tmpl.sum_off


def frame_array(frame: memoryview) -> Any:
    """A uint8 array over a staging frame (no copy; build once per slot, the kernels take it)."""
    np = native.numpy()
    return np.frombuffer(frame, dtype=np.uint8)


def load_page(shape: PageShape, rank_fd: int, fanout_name: str, file_name: str, key: bytes,
              flags: tuple[int, int], check_cache: bool, frame: Any, file_off: int, direct_len: int = 0,
              ) -> tuple[int, tuple[int, int, int] | None, list[int], list[int], bool] | None:
    """Load the page file ``fanout_name/file_name`` into ``frame`` at ``file_off`` (the header
    first, the page right after it) and check it (module docstring): one GIL release.
    ``check_cache``: a file whose first block is not in the page cache is read with O_DIRECT
    in one request of ``direct_len`` bytes (the ALIGN-padded file; ``frame`` at ``file_off``
    aligned), or handed back (LOAD_COLD) when ``direct_len`` is 0 or O_DIRECT is refused.

    Returns (code, file identity (st_dev, st_ino, st_ctime_ns) or None, computed section sums,
    the header's section sums, read with O_DIRECT), or None when the native path is not ready.
    code: 0 the page is good; LOAD_BAD_SUM / LOAD_BAD_GAP damage (identity set); anything else
    negative: the Python path redoes the load."""
    kernels = native.page_kernels()
    if kernels is None:
        return None
    np = native.numpy()
    names = np.frombuffer(f"{fanout_name}\0{file_name}\0".encode() + key, dtype=np.uint8)
    key_at = len(fanout_name) + len(file_name) + 2
    out = np.empty(shape.load_spans.shape[0], dtype=np.uint64)
    header_sums = np.empty(shape.sections, dtype=np.uint64)
    scratch = np.zeros(32, dtype=np.int64)
    got = kernels[0](rank_fd, names, len(fanout_name) + 1, key_at, flags[0], flags[1], shape.size,
                     int(check_cache), direct_len, frame, file_off, shape.plan, shape.load_spans, shape.gaps, shape.blank,
                     shape.const_ranges, shape.sum_offsets, shape.key_off, shape.sum_off, out, header_sums, scratch)
    if got == shape.plan_end:
        code = 0
    elif got in (LOAD_BAD_SUM, LOAD_BAD_GAP):
        code = int(got)
    else:
        return int(got) if got < 0 else native.LOAD_READ_FAILED, None, [], [], False
    ident = (int(scratch[0]), int(scratch[1]), int(scratch[13]) * 1_000_000_000 + int(scratch[14]))
    return code, ident, out.tolist(), header_sums.tolist(), bool(scratch[26])


def store_page(shape: PageShape, rank_fd: int, fanout_name: str, tmp_name: str, final_name: str, key: bytes,
               flags: tuple[int, int], mode: int, frame: Any, file_off: int, length: int, fsync: bool,
               token_count: int, sums: Sequence[int] | None) -> int | None:
    """Store the page in ``frame`` (right after ``file_off + header_len``) under ``final_name``
    (module docstring): one GIL release. ``length``: the bytes written (padded for O_DIRECT;
    cut back to the exact size). 0 stored, native.STORE_EXISTS the name existed (nothing
    written), native.STORE_NO_DIR the fan-out directory is missing, another negative code: the
    Python path redoes the store. None when the native path is not ready."""
    kernels = native.page_kernels()
    if kernels is None:
        return None
    np = native.numpy()
    names = np.frombuffer(f"{fanout_name}\0{tmp_name}\0{final_name}\0".encode() + key, dtype=np.uint8)
    tmp_at = len(fanout_name) + 1
    final_at = tmp_at + len(tmp_name) + 1
    given = np.array(sums if sums is not None else (), dtype=np.uint64)
    return int(kernels[1](rank_fd, names, tmp_at, final_at, final_at + len(final_name) + 1, flags[0], flags[1],
                          mode, frame, file_off, length, shape.size, int(fsync), shape.spans, shape.gaps,
                          shape.blank, shape.sum_offsets, shape.key_off, shape.token_off, shape.sum_off,
                          token_count, given, np.empty(shape.sections, dtype=np.uint64),
                          np.empty(32, dtype=np.int64)))


def verify_pages(shape: PageShape, dir_fd: int, file_names: Sequence[str], keys: Sequence[bytes],
                 flags: tuple[int, int], frame: Any) -> tuple[Any, Any] | None:
    """Open, read and check each page ``file_names[i]`` (key ``keys[i]``, all of one length) in
    the directory ``dir_fd`` against ``shape`` (``load_page``'s checks, ``hashed`` shape), one
    after another through ``frame`` (at least ``shape.size`` bytes): one GIL release for all.

    Returns (codes, stats) or None when the native path is not ready: ``codes[i]`` 0 when the
    page is good (then ``stats[i]`` holds its ``struct stat`` at the ST_* slots and its token
    count at VERIFY_TOKENS), else a negative load_page code (the caller redoes that page on
    its Python path, which names what is wrong)."""
    kernels = native.page_kernels()
    if kernels is None or not file_names:
        return None
    np = native.numpy()
    n = len(file_names)
    rows = b"".join(name.encode() + b"\0" + key for name, key in zip(file_names, keys, strict=True))
    names = np.frombuffer(rows, dtype=np.uint8).reshape(n, len(rows) // n)
    file_at = 0  # each row: the file name, NUL, the key; opened relative to dir_fd itself
    key_at = len(file_names[0]) + 1
    codes = np.empty(n, dtype=np.int64)
    stats = np.zeros((n, 32), dtype=np.int64)
    kernels[2](dir_fd, names, file_at, key_at, flags[0], flags[1], shape.size, frame, shape.plan, shape.load_spans,
               shape.gaps, shape.blank, shape.const_ranges, shape.sum_offsets, shape.key_off, shape.sum_off,
               shape.token_off, np.empty(shape.load_spans.shape[0], dtype=np.uint64),
               np.empty(shape.sections, dtype=np.uint64), stats, codes)
    return codes, stats


def build(numba: Any, xxh3: Any, libc: Any, hash_spans: Any, read_pieces: Any, write_file: Any,
          ) -> tuple[Any, Any, Any]:
    """Compile ``load_page``, ``store_page`` and ``verify_pages`` (called by ``native._build``). ``libc``: the
    ctypes bindings (openat, close, fstat, fstatat, syscall, fcntl, pread); ``hash_spans`` /
    ``read_pieces`` / ``write_file``: ``native``'s compiled hashing, read and publish steps."""
    t = numba.types
    i64, u8 = t.int64, t.uint8
    rows = t.Array(i64, 2, "C", readonly=True)
    vec = t.Array(i64, 1, "C", readonly=True)
    bytes_ro = t.Array(u8, 1, "C", readonly=True)
    frame_t = t.Array(u8, 1, "C")
    sums_t = t.Array(t.uint64, 1, "C")
    sums_ro = t.Array(t.uint64, 1, "C", readonly=True)
    scratch_t = t.Array(i64, 1, "C")
    openat, close, fstat, fstatat, syscall = libc["openat"], libc["close"], libc["fstat"], libc["fstatat"], libc["syscall"]
    fcntl, pread = libc["fcntl"], libc["pread"]
    f_getfl, f_setfl, o_direct = 3, 4, getattr(os, "O_DIRECT", 0)
    load_open_failed, load_not_plain, load_cold, load_read_failed = (
        native.LOAD_OPEN_FAILED, native.LOAD_NOT_PLAIN, native.LOAD_COLD, native.LOAD_READ_FAILED)
    store_exists, store_no_dir = native.STORE_EXISTS, native.STORE_NO_DIR
    bad_header, bad_sum, bad_gap, bad_section = LOAD_BAD_HEADER, LOAD_BAD_SUM, LOAD_BAD_GAP, _BAD_SECTION
    verify_tokens = VERIFY_TOKENS

    @numba.njit(inline="always")
    def get_u64(a: Any, at: int) -> Any:  # little-endian, as format.py's structs
        v = numba.uint64(0)
        for b in range(8):
            v |= numba.uint64(a[at + b]) << numba.uint64(8 * b)
        return v

    @numba.njit(inline="always")
    def put_u64(a: Any, at: int, v: Any) -> None:
        for b in range(8):
            a[at + b] = numba.uint8((v >> numba.uint64(8 * b)) & numba.uint64(0xFF))

    @numba.njit(i64(i64, bytes_ro, i64, i64, i64, i64, i64, i64, i64, frame_t, i64, rows, rows, rows, bytes_ro,
                    rows, vec, i64, i64, sums_t, sums_t, scratch_t), nogil=True, cache=False)
    def load_page(rank_fd: int, names: Any, file_at: int, key_at: int, dir_flags: int, file_flags: int, size: int,
                  check_cache: int, direct_len: int, frame: Any, file_off: int, pieces: Any, spans: Any, gaps: Any,
                  blank: Any, const_ranges: Any, sum_offsets: Any, key_off: int, sum_off: int, out: Any,
                  header_sums: Any, scratch: Any) -> int:
        # scratch: [0:18] struct stat (x86_64), [18:20] cachestat range, [20:25] cachestat out,
        # [26] 1 when the file was read with O_DIRECT.
        # file_at 0: ``rank_fd`` is the page's directory itself (fsck's checked fd), no open.
        d = openat(rank_fd, names.ctypes.data, dir_flags) if file_at > 0 else rank_fd
        if d < 0:
            return load_open_failed
        f = openat(d, names.ctypes.data + file_at, file_flags)
        if file_at > 0:
            close(d)
        if f < 0:
            return load_open_failed
        stat_at = scratch.ctypes.data
        if fstat(f, stat_at) != 0 or (scratch[3] & 0o170000) != 0o100000 or scratch[2] > 1 or scratch[6] != size:
            close(f)
            return load_not_plain
        cold = False
        if check_cache != 0:
            scratch[18] = 0
            scratch[19] = 4096
            if syscall(451, f, stat_at + 18 * 8, stat_at + 20 * 8, 0) != 0 or scratch[20] == 0:
                # Not cached: read it with O_DIRECT in one request (pread_pieces' pieces would
                # each wait for the disk), or hand it back when that is not possible here.
                flags = fcntl(f, f_getfl, 0)
                if direct_len <= 0 or flags < 0 or fcntl(f, f_setfl, flags | o_direct) != 0:
                    close(f)
                    return load_cold
                cold = True
        hl = blank.shape[0]
        base = frame.ctypes.data + file_off
        if cold:
            got = 0
            while got < direct_len:
                n = pread(f, base + got, direct_len - got, got)
                if n <= 0:
                    break
                got += n
            close(f)
            if got < size:  # EINVAL (refused here), an error or a short file: the Python path
                return load_cold if got == 0 else load_read_failed
            hash_spans(base + hl, spans, 0, spans.shape[0], out)
            scratch[26] = 1
            got = pieces[pieces.shape[0] - 1, 1]
        else:
            got = read_pieces(f, base, hl, pieces, spans, out)
            close(f)
        if got < 0:
            return load_read_failed
        if pieces.shape[0] and got != pieces[pieces.shape[0] - 1, 1]:
            return got  # the file ended early: the Python path names it
        # The header, byte for byte the template's (HeaderTemplate.parse).
        if xxh3(base, sum_off) != get_u64(frame, file_off + sum_off):
            return bad_header
        for i in range(names.shape[0] - key_at):
            if frame[file_off + key_off + i] != names[key_at + i]:
                return bad_header
        for r in range(const_ranges.shape[0]):
            for j in range(const_ranges[r, 0], const_ranges[r, 1]):
                if frame[file_off + j] != blank[j]:
                    return bad_header
        for i in range(sum_offsets.shape[0]):
            header_sums[i] = get_u64(frame, file_off + sum_offsets[i])
        for i in range(spans.shape[0]):
            if out[i] != header_sums[i]:
                scratch[bad_section] = i
                return bad_sum
        page = file_off + hl
        for g in range(gaps.shape[0]):
            for j in range(gaps[g, 0], gaps[g, 1]):
                if frame[page + j] != 0:
                    return bad_gap
        return got

    @numba.njit(i64(i64, bytes_ro, i64, i64, i64, i64, i64, i64, frame_t, i64, i64, i64, i64, rows, rows,
                    bytes_ro, vec, i64, i64, i64, i64, sums_ro, sums_t, scratch_t), nogil=True, cache=False)
    def store_page(rank_fd: int, names: Any, tmp_at: int, final_at: int, key_at: int, dir_flags: int,
                   file_flags: int, mode: int, frame: Any, file_off: int, length: int, exact_len: int, do_fsync: int,
                   spans: Any, gaps: Any, blank: Any, sum_offsets: Any, key_off: int, token_off: int, sum_off: int,
                   token_count: int, given: Any, sums: Any, scratch: Any) -> int:
        # names: fan-out dir, temp name, final name (NUL-terminated), then the key bytes.
        d = openat(rank_fd, names.ctypes.data, dir_flags)
        if d < 0:
            return store_no_dir
        found = fstatat(d, names.ctypes.data + final_at, scratch.ctypes.data, 0x100)  # AT_SYMLINK_NOFOLLOW
        if found == 0:
            close(d)
            return store_exists
        hl = blank.shape[0]
        page = file_off + hl
        for g in range(gaps.shape[0]):  # canonical bytes whoever filled the slot
            for j in range(gaps[g, 0], gaps[g, 1]):
                frame[page + j] = 0
        base = frame.ctypes.data + file_off
        if given.shape[0]:
            sums[:] = given
        else:
            hash_spans(base + hl, spans, 0, spans.shape[0], sums)
        for j in range(hl):
            frame[file_off + j] = blank[j]
        for i in range(names.shape[0] - key_at):
            frame[file_off + key_off + i] = names[key_at + i]
        for b in range(4):
            frame[file_off + token_off + b] = numba.uint8((token_count >> (8 * b)) & 0xFF)
        for i in range(sum_offsets.shape[0]):
            put_u64(frame, file_off + sum_offsets[i], sums[i])
        put_u64(frame, file_off + sum_off, xxh3(base, sum_off))
        code = write_file(d, names.ctypes.data + tmp_at, names.ctypes.data + final_at, file_flags, mode, base,
                          length, exact_len, do_fsync)
        close(d)
        return code

    pages_t = t.Array(u8, 2, "C", readonly=True)
    stats_t = t.Array(i64, 2, "C")
    codes_t = t.Array(i64, 1, "C")

    @numba.njit(i64(i64, pages_t, i64, i64, i64, i64, i64, frame_t, rows, rows, rows, bytes_ro, rows, vec, i64, i64,
                    i64, sums_t, sums_t, stats_t, codes_t), nogil=True, cache=False)
    def verify_pages(dir_fd: int, names: Any, file_at: int, key_at: int, dir_flags: int, file_flags: int, size: int,
                     frame: Any, pieces: Any, spans: Any, gaps: Any, blank: Any, const_ranges: Any, sum_offsets: Any,
                     key_off: int, sum_off: int, token_off: int, out: Any, header_sums: Any, stats: Any,
                     codes: Any) -> int:
        # One load_page per row of ``names`` into the same frame; a good page's token count
        # goes to stats[i, VERIFY_TOKENS] (the frame is overwritten by the next page).
        good = 0
        end = pieces[pieces.shape[0] - 1, 1] if pieces.shape[0] else 0
        for i in range(names.shape[0]):
            got = load_page(dir_fd, names[i], file_at, key_at, dir_flags, file_flags, size, 0, 0, frame, 0, pieces,
                            spans, gaps, blank, const_ranges, sum_offsets, key_off, sum_off, out, header_sums,
                            stats[i])
            if got == end:
                v = 0
                for b in range(4):
                    v |= numba.int64(frame[token_off + b]) << (8 * b)
                stats[i, verify_tokens] = v
                codes[i] = 0
                good += 1
            else:
                codes[i] = got if got < 0 else load_read_failed
        return good

    return load_page, store_page, verify_pages
