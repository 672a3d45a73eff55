"""fsck's fast path for the engine's own pages: a batch of one directory in one GIL-free call.

Why: verifying a cached 8 KiB page on the Python path is ~25 µs of GIL-held work (open,
fstat, two preads, the header parse, a hash call per section, close, each a GIL hand-off), so
fsck could not pass ~35k pages/s on any number of cores, and more threads made it slower
(docs/measurements/fsck.md). ``native_page.verify_pages`` does all of that for up to
``fan_dir_walk.GATE_BATCH`` pages per call without the GIL; Python keeps only the walk and the
bookkeeping per page.

Contract: ``NativeBatch.verify`` checks pages exactly as the engine's native load does (plain
file, one link, exact size, the header byte for byte the template's, every section checksum,
zero alignment gaps) and answers per page: good (with its ``struct stat`` and token count) or
"redo on the Python path". It never names damage: any page that is not good, for whatever
reason (a damaged page, another header variant, an open refused because the name is now a
symlink or a FIFO), goes back to ``PageVerifier``'s per-page path, which reads it again and
reports it. None for the whole batch when the native kernels are not ready (not compiled yet,
numba missing, ``TIERSTORE_NATIVE=0``, not x86-64 Linux).

Memory: one page buffer per call, from the verifier's ``BufferPool`` (its budget holds).

Threading: called from the walk's pool threads at once; the shape cache is filled under a lock
(a race builds the same value twice); each call has its own buffer and output arrays.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tierstore.format.header_template import HeaderTemplate
from tierstore.format.page_layout import PageLayout
from tierstore.native import loader as native
from tierstore.native import page_calls as native_page
from tierstore.rootstore.own_read import WARM_PIECE_BYTES, read_plan
from tierstore.rootstore.page_io import NATIVE_OPEN_FLAGS

if TYPE_CHECKING:
    from tierstore.admin.buffer_pool import BufferPool

# Pages larger than this take the Python path (its buffer pool splits the budget finer).
MAX_BATCH_PAGE_BYTES = 64 << 20


class NativeBatch:
    """``verify_pages`` with the shapes and buffers it needs; see the module docstring."""

    def __init__(self, pool: BufferPool) -> None:
        self.pool = pool
        self._shapes: dict[int, tuple[HeaderTemplate, native_page.PageShape]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def ready() -> bool:
        """Whether ``verify`` can answer now (the native kernels compiled and usable here)."""
        return native.page_kernels() is not None

    def verify(self, dir_fd: int, tmpl: HeaderTemplate, layout: PageLayout, file_names: Sequence[str],
               keys: Sequence[bytes]) -> tuple[Any, Any] | None:
        """``native_page.verify_pages`` of these pages (names and keys each of one length) in the
        checked directory ``dir_fd``; None when the native path cannot take them."""
        size = tmpl.header_len + layout.nbytes
        if size > MAX_BATCH_PAGE_BYTES or not self.ready():
            return None
        shape = self._shape(tmpl, layout)
        buf = self.pool.acquire(size)
        try:
            return native_page.verify_pages(shape, dir_fd, file_names, keys, NATIVE_OPEN_FLAGS,
                                            native_page.frame_array(memoryview(buf)))
        finally:
            self.pool.release(buf)

    def _shape(self, tmpl: HeaderTemplate, layout: PageLayout) -> native_page.PageShape:
        got = self._shapes.get(id(tmpl))
        if got is None or got[0] is not tmpl:
            plan = read_plan(layout, tmpl.header_len, WARM_PIECE_BYTES)
            got = (tmpl, native_page.PageShape(tmpl, layout, plan, hashed=True))
            with self._lock:
                self._shapes[id(tmpl)] = got
        return got[1]
