"""Direct-I/O rules shared by the staging pool and the page-file operations (a leaf module).

- ``ALIGN``: the O_DIRECT alignment of buffers, file offsets and lengths (4096; the format's
  ``HEADER_ALIGN`` is a multiple of it, so a header never breaks the payload's alignment).
- ``FrameGeometry``: the one description of a staging slot's frame,
  ``[header room | page | pad to ALIGN]``. The page sits right after the header room, so a page
  file (header + page) is one contiguous, aligned buffer: ``file_view`` cuts it out for a
  header of a given length. The staging pool allocates frames by it; the page-file operations
  read and write through it; neither imports the other.
- ``cachestat_pages`` (cachestat(2), Linux 6.5) and ``advise_huge_pages`` (madvise): best-effort
  kernel calls through libc; without them only speed changes.

Threading: constants and pure functions; ``CachestatArgs`` is per calling thread.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from dataclasses import dataclass
from typing import Any

ALIGN = 4096
O_DIRECT: int = getattr(os, "O_DIRECT", 0)  # 0: not available on this platform


def round_up(n: int, to: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class FrameGeometry:
    """Byte layout of one staging frame: ``header_room`` (the longest header, a multiple of
    ALIGN), then the page (``nbytes``), then zero padding to ALIGN."""

    header_room: int
    nbytes: int

    def __post_init__(self) -> None:
        if self.header_room % ALIGN:
            raise ValueError(f"header room {self.header_room} is not a multiple of {ALIGN}")

    @property
    def padded_nbytes(self) -> int:
        return round_up(self.nbytes)

    @property
    def stride(self) -> int:
        """Bytes of one frame (a multiple of ALIGN)."""
        return self.header_room + self.padded_nbytes

    def file_view(self, frame: memoryview, header_len: int, padded: bool = False) -> memoryview:
        """The page file inside ``frame``: ``header_len`` bytes of header right before the page,
        then the page (``padded``: up to the next ALIGN boundary, for O_DIRECT)."""
        end = self.header_room + (self.padded_nbytes if padded else self.nbytes)
        return frame[self.header_room - header_len : end]


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


_SYS_CACHESTAT = 451  # same number on every Linux architecture (new syscalls are unified)
try:
    _libc: Any = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - not Linux
    _libc = None


class CachestatArgs:
    """cachestat(2) argument buffers, allocated once per thread: the first ALIGN bytes of a file
    (cachestat walks the cache, so its cost grows with the range asked about)."""

    def __init__(self) -> None:
        self.range = _CachestatRange(0, ALIGN)
        self.out = _Cachestat()


def cachestat_pages(fd: int, args: CachestatArgs) -> int:
    """Pages of ``fd``'s first block in the page cache; -1 if the kernel cannot tell."""
    if _libc is None:
        return -1
    rc = _libc.syscall(_SYS_CACHESTAT, fd, ctypes.byref(args.range), ctypes.byref(args.out), 0)
    return int(args.out.nr_cache) if rc == 0 else -1


def cachestat_available() -> bool:
    """Whether this kernel answers cachestat(2)."""
    if not sys.platform.startswith("linux") or _libc is None:
        return False
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        return cachestat_pages(fd, CachestatArgs()) >= 0
    finally:
        os.close(fd)


def advise_huge_pages(addr: int, nbytes: int) -> None:
    """Ask for transparent huge pages on ``[addr, addr + nbytes)`` (before its first touch).

    O_DIRECT pins the user pages of every request (get_user_pages): 4096 of them per 16 MiB
    with 4 KiB pages, 8 with 2 MiB ones. Measured on this VM kind: cold 16 MiB loads 1.7 GB/s
    with a huge-page slab in every engine vs 1.1-1.45 GB/s (varying from slab to slab) without,
    and ~20% less CPU per stored byte. ``transparent_hugepage=madvise`` (a common default) only
    gives them to memory that asks. Best effort: if the kernel says no, only speed changes.
    """
    madvise = getattr(_libc, "madvise", None) if _libc is not None else None
    if madvise is None or not hasattr(mmap, "MADV_HUGEPAGE"):
        return
    huge = 2 << 20
    start = round_up(addr, huge)
    end = (addr + nbytes) // huge * huge
    if end > start:
        madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_HUGEPAGE)
