"""One GIL release per page: loads, stores and section hashing compiled with numba (issue 16).

Why: with many I/O threads the GIL, not the disk, capped the engine. Every GIL-releasing call
(one xxh3 call per section, one system call per step) is a hand-off whose wake-up is paid with
the GIL idle: 16 sections of a 2 MiB page cost ~23 hand-offs, and 2 MiB pages peaked at 4-8
threads (docs/measurements/scaling.md). Here the steps run in compiled calls that hold no GIL
(numba ``nogil=True``), calling the same functions as the Python path: ``XXH3_64bits`` of the
loaded xxhash extension (checked against ``xxhash.xxh3_64_intdigest`` before use) and libc's
``openat``/``fstat``/``pread``/``pwrite``/``renameat2`` (or ``linkat``, create-only):
- ``native_page.load_page`` / ``store_page`` / ``load_pages`` (compiled in ``native/page_kernels.py``,
  with the others, and cached on disk): a warm load or a store of one page file, header checks
  and header fill included, in one call each, or a batch of loads in one call;
- ``read_and_hash`` and ``section_sums``: the pieces, for callers that hold an open file;
- ``record_sums``: xxh3 of many equal-length records at once (the scheduler's key fingerprints);
- ``native_page.verify_pages``: fsck's batch, up to 32 pages of one directory verified per call
  (``fsck_batch``).

Contract: every function returns None whenever the native path is not ready (numba missing,
not compiled yet, ``TIERSTORE_NATIVE=0``, a probe mismatch; the open/stat ones also off
x86-64 Linux, whose ``struct stat`` they read by offset); callers then take the Python path,
which computes the same values and writes the same bytes. Nothing here raises for I/O: a
failed step returns a code, leaves no temp file behind, and the caller redoes the operation
on the Python path, which names the error. Buffers are passed by address: the caller keeps
them alive and C-contiguous for the call.

Threading: ``start()`` compiles on one daemon thread (numba's import and compile take ~6 s of
CPU on the 2-core machine, loading ``native/page_kernels.py`` and ``native/lane_kernels.py`` from numba's on-disk cache ~0.6 s; kept
off the engine's start-up path and out of processes that never load a page, such as the CLI);
until it finishes ``ready()`` is False. After that the compiled functions are safe from
any number of threads at once (they touch only the buffers they are given).
"""

from __future__ import annotations

import logging
import os
import platform
import sys
import threading
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from tierstore.native import abi
from tierstore.native.abi import (  # noqa: F401  (the kernels' result codes, used as native.X)
    LOAD_COLD,
    LOAD_NOT_PLAIN,
    LOAD_OPEN_FAILED,
    LOAD_READ_FAILED,
    STORE_EXISTS,
    STORE_FAILED,
    STORE_NO_DIR,
)

logger = logging.getLogger(__name__)

# Below this many bytes in one call the Python path is as fast (the call's own overhead is a
# few microseconds) and headers (4 KiB) stay on it.
MIN_NATIVE_BYTES = 64 << 10

# load_page reads ``struct stat`` by offset: x86-64 Linux only (elsewhere loads keep the
# Python open and fstat, and still read and hash in one call).
_STAT_LAYOUT_KNOWN = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")

# native/page_kernels.py and lane_kernels.py compile with numba's on-disk cache unless this is False (set when numba
# finds no writable cache directory).
cache_kernels = True
_lock = threading.Lock()
_started = False
_kernels: Any = None  # the compiled functions, set once by the compile thread
_ready = threading.Event()
_failure: str | None = None


# Longest a fork waits for a compile in progress (a fork from inside an import could
# otherwise wait forever on the compile thread's own imports).
FORK_WAITS_FOR_COMPILE_S = 60.0


def _finish_compile_before_fork() -> None:
    # A child forked while the compile thread is inside LLVM inherits LLVM's half-updated
    # state, and its own compile can then abort the child ("List invariant broken", seen in
    # tests/rootstore/test_crash_safety.py): let a compile in progress finish first (1-3 s, at most once).
    if _started and not _ready.is_set():
        _ready.wait(FORK_WAITS_FOR_COMPILE_S)


def _forget_in_child() -> None:
    # A fork while the compile thread ran: that thread is not in the child; compile again there.
    global _started, _ready
    if _kernels is None:
        _started, _ready = False, threading.Event()


os.register_at_fork(before=_finish_compile_before_fork, after_in_child=_forget_in_child)


def enabled_by_env() -> bool:
    """False when ``TIERSTORE_NATIVE=0``: the Python path only (benches compare the two)."""
    return os.environ.get("TIERSTORE_NATIVE", "1") != "0"


def start(wait: bool = False) -> bool:
    """Compile the native kernels once per process, on a background thread; with ``wait``,
    block until done. True when the native path is (or, with ``wait``, became) ready."""
    global _started
    with _lock:
        if not _started and enabled_by_env():
            _started = True
            threading.Thread(target=_compile, name="tierstore-native-compile", daemon=True).start()
    if wait and _started:
        _ready.wait()
    return _kernels is not None


def ready() -> bool:
    """True once the compiled kernels are usable (``start`` was called and compiling worked)."""
    return _kernels is not None


def failure() -> str | None:
    """Why the native path is unavailable after ``start``, or None."""
    return _failure


def _compile() -> None:
    global _kernels, _failure
    try:
        _kernels = _build()
        from tierstore.format import checksums  # here: importing the loader stays light

        checksums.install_span_hasher(section_sums)
    except Exception as exc:  # numba missing or broken: the Python path serves; say why once
        _failure = f"{type(exc).__name__}: {exc}"
        logger.info("tierstore: native page hashing unavailable (%s); using the Python path "
                    "(install numba for one GIL release per page)", _failure)
    finally:
        _ready.set()


def _shield_llvmlite_from_module_scans() -> None:
    """Give llvmlite's lazy library wrapper a real ``__dict__`` answer.

    ``llvmlite.binding.ffi.lib`` answers ANY attribute by wrapping a symbol of the LLVM
    library, ``__dict__`` included (it has ``__slots__``), so ``vars(lib)`` is not a dict.
    vLLM 0.32's kernel-override scan (``vllm/triton_utils/dispatcher._rebind_kernels``) walks
    every module's attributes and calls ``vars(value).get(...)`` on each that has a
    ``__dict__``: with numba imported first, an engine fails to start (AttributeError
    '_lib_fn_wrapper' object has no attribute 'get'). An empty dict under that name makes
    ``vars(lib)`` an empty dict; llvmlite never looks the name up itself. Any ``hasattr(lib,
    "__dict__")`` made before this (a scan, an inspector) has cached the wrapped symbol under
    that name: it is replaced, not kept."""
    try:
        from llvmlite.binding import ffi

        if not isinstance(ffi.lib._fntab.get("__dict__"), dict):
            ffi.lib._fntab["__dict__"] = {}
    except (ImportError, AttributeError):  # another llvmlite: nothing to shield
        pass


def _build() -> Any:
    """Compile the kernels (``native/page_kernels.py``, ``native/lane_kernels.py``; loaded from
    numba's on-disk cache after the first process) and check them against xxhash; raise if
    anything differs."""
    _shield_llvmlite_from_module_scans()  # before numba's import: no window for a scan
    import numpy as np
    import xxhash
    import xxhash._xxhash as ext
    from llvmlite import binding

    # The kernels call XXH3 by symbol (native.page_kernels._xxh3_symbol): make the loaded extension's symbols visible to
    # LLVM (at compile and at cache load) before the kernels' module is imported.
    binding.load_library_permanently(ext.__file__)
    global cache_kernels
    try:
        from tierstore.native import lane_kernels as lk
        from tierstore.native import page_kernels as k
    except RuntimeError as exc:
        # numba found no writable cache directory (a read-only install and no writable home):
        # compile for this process only, as before the cache (the import left no module).
        if "cannot cache" not in str(exc):
            raise
        logger.info("tierstore: no writable numba cache directory (%s); compiling the native kernels for this "
                    "process only (set NUMBA_CACHE_DIR to a writable directory to cache them)", exc)
        cache_kernels = abi.cache_kernels = False
        from tierstore.native import lane_kernels as lk
        from tierstore.native import page_kernels as k

    hash_spans, hash_strided, read_pieces = k.hash_spans, k.hash_strided, k.read_pieces
    load_page, store_page, verify_pages, load_pages = k.load_page, k.store_page, k.verify_pages, k.load_pages
    store_pages = k.store_pages
    lane = (lk.lane_serve, lk.lane_publish, lk.lane_await, lk.lane_stop, lk.lane_cancel)

    probe = np.frombuffer(bytes(range(251)) * 700, dtype=np.uint8).copy()
    spans = np.array([[0, 1000], [1000, 175700]], dtype=np.int64)
    spans.setflags(write=False)
    out = np.zeros(2, dtype=np.uint64)
    hash_spans(int(probe.ctypes.data), spans, 0, 2, out)
    want = [xxhash.xxh3_64_intdigest(probe[a:b].tobytes()) for a, b in spans]
    strided = np.zeros(3, dtype=np.uint64)
    hash_strided(int(probe.ctypes.data), 3, 36, 32, strided)
    want_strided = [xxhash.xxh3_64_intdigest(probe[i * 36:i * 36 + 32].tobytes()) for i in range(3)]
    if [int(v) for v in out] != want or [int(v) for v in strided] != want_strided:
        raise RuntimeError("compiled XXH3_64bits differs from xxhash.xxh3_64_intdigest")
    return (hash_spans, read_pieces, np, load_page, store_page, hash_strided, verify_pages, load_pages, store_pages,
            lane)


@lru_cache(maxsize=256)
def rows_array(rows: tuple[tuple[int, ...], ...]) -> Any:
    """A read-only int64 array of ``rows`` (spans, gaps, ranges or a read plan; an empty one is
    n x 2; cached: layouts are few). The kernels take these."""
    np = _kernels[2]
    arr = np.array(rows, dtype=np.int64).reshape(len(rows), -1 if rows else 2)
    arr.setflags(write=False)
    return arr


def address(buf: memoryview) -> int:
    """The address of a C-contiguous buffer's first byte (read-only buffers too)."""
    np = _kernels[2]
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data) if buf.nbytes else 0


def section_sums(spans: Sequence[tuple[int, int]], data: memoryview, first: int, end: int) -> list[int] | None:
    """xxh3 of ``data[o:e]`` for ``spans[first:end]`` in one GIL-free call, or None when the
    native path is not ready or the spans are too small to gain (the caller hashes in Python)."""
    if _kernels is None or end <= first or spans[end - 1][1] - spans[first][0] < MIN_NATIVE_BYTES:
        return None
    hash_spans, _, np = _kernels[:3]
    out = np.empty(end - first, dtype=np.uint64)
    hash_spans(address(data), rows_array(tuple(spans)), first, end, out)
    return out.tolist()  # type: ignore[no-any-return]


def read_and_hash(fd: int, file_buf: memoryview, page_off: int, plan: Sequence[tuple[int, int, int, int]],
                  spans: Sequence[tuple[int, int]]) -> tuple[int, list[int]] | None:
    """Read the file pieces of ``plan`` into ``file_buf`` at their offsets and hash every
    section (page at ``page_off`` in the file) in one GIL-free call.

    Returns (bytes read up to the end of the plan, or the offset where the file ended, or -1 on
    a read error; the section sums), or None when the native path is not ready. ``file_buf``
    must hold the plan's last end."""
    if _kernels is None:
        return None
    _, read_pieces, np = _kernels[:3]
    if plan and file_buf.nbytes < plan[-1][1]:
        raise ValueError("file buffer shorter than the read plan")
    out = np.zeros(len(spans), dtype=np.uint64)
    got = read_pieces(fd, address(file_buf), page_off, rows_array(tuple(plan)), rows_array(tuple(spans)), out)
    return int(got), out.tolist()


def record_sums(records: bytes, stride: int, length: int) -> Any:
    """xxh3 of the first ``length`` bytes of each ``stride``-byte record of ``records`` (a
    uint64 numpy array), in one GIL-free call; None when the native path is not ready. The
    scheduler's key fingerprints: its keys joined, the 4-byte group suffix left out."""
    if _kernels is None:
        return None
    np, hash_strided = _kernels[2], _kernels[5]
    n = len(records) // stride
    out = np.empty(n, dtype=np.uint64)
    if n:
        hash_strided(int(np.frombuffer(records, dtype=np.uint8).ctypes.data), n, stride, length, out)
    return out


def numpy() -> Any:
    """numpy, once the kernels are compiled (native_page builds its arrays with it)."""
    return _kernels[2]


def page_kernels() -> tuple[Any, Any, Any, Any, Any] | None:
    """The compiled (load_page, store_page, verify_pages, load_pages, store_pages) of ``native_page``, or None when the
    native path is not ready or off x86-64 Linux (they read ``struct stat`` by offset)."""
    if _kernels is None or not _STAT_LAYOUT_KNOWN:
        return None
    return _kernels[3], _kernels[4], _kernels[6], _kernels[7], _kernels[8]


def lane_kernels() -> tuple[Any, Any, Any, Any, Any] | None:
    """The compiled (serve, publish, await, stop, cancel) of ``rootstore/lane.py``'s I/O loop, or None where
    ``page_kernels`` is None."""
    if page_kernels() is None:
        return None
    return _kernels[9]  # type: ignore[no-any-return]
