"""The engine's own fast read: a page file it would have written itself, read and checked in
place (docs/DESIGN.md §6, the page store on one root).

``PageFiles`` reads a file of exactly its pages' size into a staging slot's frame (the header
lands right before the page) and checks it against the header it would have written
(``HeaderTemplate.parse``): a page whose first block is cached is copied piece by piece
(``read_plan``: whole sections, about ``WARM_PIECE_BYTES`` each) and each piece hashed while
it is still in the CPU cache (one GIL-free call for the whole page once the native kernels
have compiled); an uncached one is read with O_DIRECT in one request (``read_direct``). A
header that is not byte for byte the engine's goes to the general reader (page_read.py),
which names the error.

Failure policy: ``PageCorrupt`` naming the first bad section (``check_section_sums``) or a
non-zero gap, ``PageTruncated`` for a short file; other OSErrors propagate (the caller maps
them with ``page_io.read_error``). Functions do not log.

Threading: every function is reentrant and uses only the caller's file descriptor and
buffers (the calling thread's for the call's duration).
"""

from __future__ import annotations

import errno
from collections.abc import Sequence

from tierstore.errors import PageCorrupt, PageTruncated
from tierstore.format.checksums import section_sums
from tierstore.format.header_template import HeaderTemplate
from tierstore.format.page_layout import PageLayout, check_gaps
from tierstore.fs.directio import O_DIRECT
from tierstore.native import loader as native
from tierstore.rootstore.page_io import preadv_upto, readinto_exact

__all__ = ["WARM_PIECE_BYTES", "ReadPlan", "check_section_sums", "clear_direct", "read_direct", "read_own_page", "read_plan"]

# The CPU-cache-sized piece of a warm load (read_plan; docs/DESIGN.md §6, the page store on one root).
WARM_PIECE_BYTES = 1 << 20
# File pieces (start, end, first section, end section) of one page read (``read_plan``).
ReadPlan = list[tuple[int, int, int, int]]


def read_plan(layout: PageLayout, header_len: int, piece_bytes: int) -> ReadPlan:
    """File pieces (start, end, first section, end section) of a page with an ``header_len``-byte
    header: whole sections, about ``piece_bytes`` each (the CPU cache that still holds a piece
    when it is hashed); the first piece also holds the header, the last reaches the end.
    Pure; no failure."""
    plan: ReadPlan = []
    start, first = 0, 0
    spans = layout.spans
    for i, (_, e) in enumerate(spans):
        if header_len + e - start >= piece_bytes or i == len(spans) - 1:
            end = header_len + (e if i < len(spans) - 1 else layout.nbytes)
            plan.append((start, end, first, i + 1))
            start, first = end, i + 1
    if not plan:  # a layout without sections
        plan.append((0, header_len + layout.nbytes, 0, 0))
    return plan


def read_direct(fd: int, padded_file: memoryview, file_len: int, path: str) -> bool:
    """Read the whole file with O_DIRECT into ``padded_file`` (aligned, ALIGN-padded); False if
    this file system refuses O_DIRECT here (the fd is left buffered, nothing was read).

    Failure policy: ``PageTruncated`` if the file is shorter than ``file_len``; other OSErrors
    propagate (the caller maps them with ``read_error``).
    """
    import fcntl  # Linux/Unix only, like O_DIRECT itself

    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | O_DIRECT)
        end = preadv_upto(fd, [padded_file], 0)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        return False
    if end < file_len:
        raise PageTruncated("file ended while reading the page", path=path)
    return True


def clear_direct(fd: int) -> None:
    """Turn O_DIRECT off on ``fd`` again (after ``read_direct``) for unaligned reads."""
    import fcntl

    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~O_DIRECT)


def check_section_sums(layout: PageLayout, got: Sequence[int], want: Sequence[int], first: int, *, path: str,
                       key: bytes) -> None:
    """Raise ``PageCorrupt`` naming the first section whose computed sum (``got``, sections
    ``first`` onwards) differs from the header's (``want``, every section)."""
    for i, c in enumerate(got, first):
        if c != want[i]:
            raise PageCorrupt(f"section {layout.sections[i].name!r} checksum mismatch", path=path, key=key)


def read_own_page(fd: int, tmpl: HeaderTemplate, file_buf: memoryview, page: memoryview, layout: PageLayout,
                  plan: ReadPlan, *, key: bytes, path: str, verify: bool,
                  already_read: bool) -> list[int] | None:
    """Read a file of exactly ``tmpl.header_len + layout.nbytes`` bytes into ``file_buf`` (the
    header lands right before ``page``) and check it in place: the header's section checksums and zero alignment gaps.

    None: the header is not byte for byte ``tmpl``'s for ``key`` (the caller takes
    ``read_page``, which names the error). ``verify=False``: the sections are not hashed (the
    caller checks the bytes against the returned sums) and the file is read in one request.
    Otherwise the file is read piece by piece (``plan``) and each piece's sections are hashed as
    soon as it lands, while it is in the CPU cache. ``already_read``: ``file_buf`` already holds
    the file (``read_direct``).

    Failure policy: ``PageCorrupt`` naming the first bad section; ``PageTruncated`` if the file
    ends early; other OSErrors propagate (the caller maps them with ``read_error``).
    """
    hl = tmpl.header_len
    if not verify:
        if not already_read:
            readinto_exact(fd, file_buf[: hl + layout.nbytes], 0, path)
        parsed = tmpl.parse(file_buf[:hl], key)
        if parsed is not None:
            check_gaps(layout, page, path=path, key=key)  # the caller hashes only the sections
        return parsed
    sums: list[int] | None
    if not already_read:
        fused = native.read_and_hash(fd, file_buf, hl, plan, layout.spans)
        if fused is not None and fused[0] == plan[-1][1]:
            # One GIL release for the whole page (native/loader.py); a short or failed read falls
            # through to the piece-by-piece path below, which names the error.
            sums = tmpl.parse(file_buf[:hl], key)
            if sums is None:
                return None
            check_section_sums(layout, fused[1], sums, 0, path=path, key=key)
            check_gaps(layout, page, path=path, key=key)
            return sums
    sums = None
    for start, end, first_sec, last_sec in plan:
        if not already_read:
            readinto_exact(fd, file_buf[start:end], start, path)
        if sums is None:
            sums = tmpl.parse(file_buf[:hl], key)
            if sums is None:
                return None
        check_section_sums(layout, section_sums(layout.spans, page, first_sec, last_sec), sums, first_sec,
                           path=path, key=key)
    check_gaps(layout, page, path=path, key=key)  # canonical bytes: the gaps are not hashed
    return sums
