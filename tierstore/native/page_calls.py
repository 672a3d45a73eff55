"""Whole-page loads and stores in one GIL-free call each, header included (issue 16).

``native/loader.py`` compiles these kernels with the others (``build``) and says when they are ready;
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
- ``load_pages``: ``load_page`` for each of a batch of files of one writer into the frames of
  one staging slab (an I/O thread's batch of loads, ``PageFiles.load_many``), one GIL release
  for all, an outcome per file;
- ``verify_pages``: ``load_page`` for each of a batch of files of one directory into one
  buffer, with each good page's ``struct stat`` and token count kept (fsck's fast path,
  ``fsck_batch``);
- ``store_pages``: ``store_page`` for each of a batch of pages of one writer from the frames of
  one staging slab (an I/O thread's batch of stores, ``PageFiles.store_many``), one GIL
  release for all, a code per page;
- ``store_page``: if the final name exists, nothing else (names are content addresses);
  otherwise zero the gaps, create the temp (O_EXCL), hash the sections (or take the caller's
  sums) and write the page, then the header (``HeaderTemplate.fill``'s bytes, right before the
  page in the frame), cut the O_DIRECT padding, fsync if asked, close and give it the final
  name create-only (renameat2 ``RENAME_NOREPLACE``, or link + unlink where the caller's
  ``PublishMemo`` says the file system refuses that flag, and learns it when it does; EEXIST:
  STORE_EXISTS, the temp removed). A page the kernel hashes is written in ``STORE_PIECE_BYTES`` pieces, each
  piece's sections hashed right before its write (still in the CPU cache), the header last;
  with the caller's sums or O_DIRECT, header and page go in one write.

Why: per page, the Python around the I/O (numba dispatch of a dozen arguments, header parse
and fill, the array wrappers) cost about as much GIL time as the rest of the engine; with 16
I/O threads that GIL time, not the file system, capped throughput
(docs/measurements/scaling.md). Here a warm load or a store is one call and a few Python
steps.

Failure policy: nothing raises for I/O. ``load_page`` returns a code: LOAD_BAD_SUM and
LOAD_BAD_GAP (the file was read and identified; the caller names the damage with
``own_read.check_section_sums`` / ``format.check_gaps``), anything else not a success hands
the load to the Python path, which redoes it and names the error (a header other than the
template's goes to the general reader there). ``store_page`` returns 0, STORE_EXISTS, or a
negative code after which no temp file is left and the Python path redoes the store. The
bytes written are exactly the Python path's (``tests/native/test_native.py`` compares them).

Threading: the kernels touch only the buffers they are given; a ``PageShape`` is immutable
after construction. Safe from any number of threads at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from tierstore.format.header_template import HeaderTemplate
from tierstore.format.page_layout import PageLayout
from tierstore.fs.directio import ALIGN
from tierstore.native import loader as native
from tierstore.native.abi import (  # noqa: F401  (load_page's damage codes, used as native_page.X)
    BAD_SECTION,
    LOAD_BAD_GAP,
    LOAD_BAD_HEADER,
    LOAD_BAD_SUM,
    PUBLISH_LINK,
    READ_ODIRECT,
    SCRATCH_LEN,
    VERIFY_TOKENS,
)

# Scratch slots of ``struct stat`` (x86-64 Linux) that verify_pages' callers read.
ST_DEV, ST_INO, ST_NLINK, ST_MODE, ST_SIZE, ST_MTIME, ST_MTIME_NS, ST_CTIME, ST_CTIME_NS = 0, 1, 2, 3, 6, 11, 12, 13, 14

# The piece of a buffered store that hashes its page: each piece's sections hashed right before
# the piece is written, so the write's copy reads them from the CPU cache (docs/DESIGN.md §6).
# 0, O_DIRECT, or the caller's sums: the page in one write.
STORE_PIECE_BYTES = 1 << 20


class PublishMemo(Protocol):
    """A root's create-only publish choice (``rootstore.publish.CreateOnly``): the stores read
    ``use_link`` and call ``fall_back`` when the kernel met renameat2's refusal."""

    use_link: bool

    def fall_back(self, why: str) -> None: ...


class PageShape:
    """The arrays every page of one writer (header template) and read plan shares."""

    __slots__ = ("header_len", "size", "plan_end", "plan", "store_piece", "spans", "load_spans", "gaps", "blank",
                 "const_ranges", "sum_offsets", "key_off", "token_off", "sum_off", "sections")

    def __init__(self, tmpl: HeaderTemplate, layout: PageLayout, plan: Sequence[tuple[int, int, int, int]],
                 hashed: bool) -> None:
        """``hashed``: the loads of this shape hash every section (verify); otherwise ``plan``
        is one request and nothing is hashed (the header's sums go to the caller)."""
        np = native.numpy()
        self.header_len = tmpl.header_len
        self.size = tmpl.header_len + layout.nbytes
        self.plan_end = plan[-1][1] if plan else 0
        self.plan = native.rows_array(tuple(plan))
        # a store the kernel hashes goes in pieces of this many bytes, each hashed right before
        # its write (O_DIRECT: a multiple of ALIGN); 0: hashed whole, then one write
        self.store_piece = STORE_PIECE_BYTES // ALIGN * ALIGN
        self.spans = native.rows_array(tuple(layout.spans))  # a store hashes every section
        self.load_spans = self.spans if hashed else native.rows_array(())
        self.sections = len(layout.sections)
        self.gaps = native.rows_array(tuple(layout.gaps))
        self.blank = np.frombuffer(tmpl.blank, dtype=np.uint8)
        self.const_ranges = native.rows_array(tuple(tmpl.const_ranges))
        self.sum_offsets = np.array(tmpl.sum_offsets, dtype=np.int64)
        self.sum_offsets.setflags(write=False)
        self.key_off, self.token_off, self.sum_off = tmpl.key_off, tmpl.token_off, tmpl.sum_off


# (code, file identity or None, computed section sums, the header's sums, read with O_DIRECT)
LoadOutcome = tuple[int, "tuple[int, int, int] | None", list[int], list[int], bool]


def frame_array(frame: memoryview) -> Any:
    """A uint8 array over a staging frame (no copy; build once per slot, the kernels take it)."""
    np = native.numpy()
    return np.frombuffer(frame, dtype=np.uint8)


def load_page(shape: PageShape, rank_fd: int, fanout_name: str, file_name: str, key: bytes,
              flags: tuple[int, int], check_cache: bool, frame: Any, file_off: int, direct_len: int = 0,
              ) -> LoadOutcome | None:
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
    scratch = np.zeros(SCRATCH_LEN, dtype=np.int64)
    got = kernels[0](rank_fd, names, len(fanout_name) + 1, key_at, flags[0], flags[1], shape.size,
                     int(check_cache), direct_len, frame, file_off, shape.plan, shape.load_spans, shape.gaps, shape.blank,
                     shape.const_ranges, shape.sum_offsets, shape.key_off, shape.sum_off, out, header_sums, scratch)
    return load_outcome(shape, int(got), scratch, out, header_sums)


def load_outcome(shape: PageShape, got: int, scratch: Any, sums: Any, header_sums: Any) -> LoadOutcome:
    """``load_page``'s outcome from the kernel's return value and the arrays it filled (the
    native lane reads its entries' results with it too)."""
    if got == shape.plan_end:
        code = 0
    elif got in (LOAD_BAD_SUM, LOAD_BAD_GAP):
        code = got
    else:
        return got if got < 0 else native.LOAD_READ_FAILED, None, [], [], False
    ident = (int(scratch[0]), int(scratch[1]), int(scratch[13]) * 1_000_000_000 + int(scratch[14]))
    return code, ident, sums.tolist(), header_sums.tolist(), bool(scratch[READ_ODIRECT])


def load_pages(shape: PageShape, rank_fd: int, files: Sequence[tuple[str, str, bytes]], flags: tuple[int, int],
               check_cache: bool, slab: Any, file_offs: Sequence[int], direct_len: int = 0,
               ) -> list[LoadOutcome] | None:
    """``load_page`` of each (fan-out name, file name, key) of ``files`` into ``slab`` at
    ``file_offs[i]``, one after another in ONE GIL release; ``load_page``'s outcome per file.
    None when the native path is not ready or the names differ in length (the caller then
    loads one by one)."""
    kernels = native.page_kernels()
    if kernels is None or not files:
        return None
    np = native.numpy()
    rows = [f"{fan}\0{name}\0".encode() + key for fan, name, key in files]
    if any(len(r) != len(rows[0]) for r in rows):
        return None
    n = len(rows)
    names = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(n, len(rows[0]))
    fan, name, _ = files[0]
    key_at = len(fan) + len(name) + 2
    offs = np.array(file_offs, dtype=np.int64)
    offs.setflags(write=False)
    outs = np.empty((n, shape.load_spans.shape[0]), dtype=np.uint64)
    header_sums = np.empty((n, shape.sections), dtype=np.uint64)
    scratch = np.zeros((n, SCRATCH_LEN), dtype=np.int64)
    codes = np.empty(n, dtype=np.int64)
    kernels[3](rank_fd, names, len(fan) + 1, key_at, flags[0], flags[1], shape.size, int(check_cache), direct_len,
               slab, offs, shape.plan, shape.load_spans, shape.gaps, shape.blank, shape.const_ranges,
               shape.sum_offsets, shape.key_off, shape.sum_off, outs, header_sums, scratch, codes)
    return [load_outcome(shape, got, scratch[i], outs[i], header_sums[i]) for i, got in enumerate(codes.tolist())]


def store_page(shape: PageShape, rank_fd: int, fanout_name: str, tmp_name: str, final_name: str, key: bytes,
               flags: tuple[int, int], mode: int, frame: Any, file_off: int, length: int, fsync: bool,
               token_count: int, sums: Sequence[int] | None, memo: PublishMemo) -> int | None:
    """Store the page in ``frame`` (right after ``file_off + header_len``) under ``final_name``
    (module docstring): one GIL release. ``length``: the bytes written (padded for O_DIRECT;
    cut back to the exact size). ``memo``: renameat2 or link (read, and told of a refusal).
    0 stored, native.STORE_EXISTS the name existed (found first, or a racing writer's page met
    by the create-only publish; no temp left), native.STORE_NO_DIR the fan-out directory is
    missing, another negative code: the Python path redoes the store. None when the native
    path is not ready."""
    kernels = native.page_kernels()
    if kernels is None:
        return None
    np = native.numpy()
    names = np.frombuffer(f"{fanout_name}\0{tmp_name}\0{final_name}\0".encode() + key, dtype=np.uint8)
    tmp_at = len(fanout_name) + 1
    final_at = tmp_at + len(tmp_name) + 1
    given = np.array(sums if sums is not None else (), dtype=np.uint64)
    scratch = np.zeros(SCRATCH_LEN, dtype=np.int64)
    scratch[PUBLISH_LINK] = int(memo.use_link)
    code = int(kernels[1](rank_fd, names, tmp_at, final_at, final_at + len(final_name) + 1, flags[0], flags[1],
                          mode, frame, file_off, length, shape.size, int(fsync), shape.store_piece, shape.spans,
                          shape.gaps, shape.blank, shape.sum_offsets, shape.key_off, shape.token_off, shape.sum_off,
                          token_count, given, np.empty(shape.sections, dtype=np.uint64), scratch))
    if scratch[PUBLISH_LINK] and not memo.use_link:
        memo.fall_back("seen by the native store")
    return code


def store_pages(shape: PageShape, rank_fd: int, files: Sequence[tuple[str, str, str, bytes]], flags: tuple[int, int],
                mode: int, slab: Any, file_offs: Sequence[int], length: int, fsync: bool, token_counts: Sequence[int],
                sums: Sequence[Sequence[int] | None], memo: PublishMemo) -> list[int] | None:
    """``store_page`` of each (fan-out name, temp name, final name, key) of ``files`` from
    ``slab`` at ``file_offs[i]`` (the frame's file start), one after another in ONE GIL
    release; ``store_page``'s code per file. ``sums``: the caller's section sums of every page,
    or None for every page (the kernel hashes); ``memo`` as ``store_page``'s. None when the
    native path is not ready, or the
    names differ in length, or some pages have sums and others not (the caller stores one by
    one)."""
    kernels = native.page_kernels()
    if kernels is None or not files:
        return None
    np = native.numpy()
    rows = [f"{fan}\0{tmp}\0{final}\0".encode() + key for fan, tmp, final, key in files]
    hashed = sums[0] is None
    if any(len(r) != len(rows[0]) for r in rows) or any((s is None) != hashed for s in sums):
        return None
    n = len(rows)
    names = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(n, len(rows[0]))
    fan, tmp, final, _ = files[0]
    tmp_at = len(fan) + 1
    final_at = tmp_at + len(tmp) + 1
    given = np.empty((n, 0), dtype=np.uint64) if hashed else np.array(sums, dtype=np.uint64).reshape(n, shape.sections)
    given.setflags(write=False)
    offs = np.array(file_offs, dtype=np.int64)
    offs.setflags(write=False)
    tokens = np.array(token_counts, dtype=np.int64)
    tokens.setflags(write=False)
    codes = np.empty(n, dtype=np.int64)
    scratch = np.zeros((n, SCRATCH_LEN), dtype=np.int64)
    scratch[0, PUBLISH_LINK] = int(memo.use_link)  # the kernel carries it down the batch
    kernels[4](rank_fd, names, tmp_at, final_at, final_at + len(final) + 1, flags[0], flags[1], mode, slab, offs,
               length, shape.size, int(fsync), shape.store_piece, shape.spans, shape.gaps, shape.blank,
               shape.sum_offsets, shape.key_off, shape.token_off, shape.sum_off, tokens, given, np.empty((n, shape.sections), dtype=np.uint64),
               scratch, codes)
    if scratch[n - 1, PUBLISH_LINK] and not memo.use_link:
        memo.fall_back("seen by the native store")
    return [int(c) for c in codes.tolist()]


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
    stats = np.zeros((n, SCRATCH_LEN), dtype=np.int64)
    kernels[2](dir_fd, names, file_at, key_at, flags[0], flags[1], shape.size, frame, shape.plan, shape.load_spans,
               shape.gaps, shape.blank, shape.const_ranges, shape.sum_offsets, shape.key_off, shape.sum_off,
               shape.token_off, np.empty(shape.load_spans.shape[0], dtype=np.uint64),
               np.empty(shape.sections, dtype=np.uint64), stats, codes)
    return codes, stats
