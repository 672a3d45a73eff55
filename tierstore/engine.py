"""IOEngine: non-blocking page loads and stores for one (root, namespace, group, rank).

Contract (docs/design/engine.md, /tmp/contracts.md):

- ``submit_load`` / ``submit_store`` never block and never raise for a per-page failure: they
  return a job id at once. Every job completes exactly once, with an ``IOResult`` returned by
  ``poll`` (non-blocking) or ``wait``. A failure is a typed ``PageError`` in the result (kind
  ``missing``, ``checksum``, ``timeout``, ``queue_full``, ``enospc``, ``readonly`` ...), never
  an exception in the caller's thread and never a success.
- Two bounded queues (``queue_depth`` each); a worker always takes a queued load before a
  queued store. A full queue completes the job at once with ``PageQueueFull``.
- Staging: ``staging_slots`` page buffers are allocated once (one torch uint8 tensor, each slot
  4096-byte aligned, pinned when asked and CUDA is available, else on transparent huge pages).
  Free slots are reused most-recently-released first (still in the CPU cache). A load takes a
  slot itself and hands it to the caller with the verified page (the caller releases it); a
  store consumes the caller's slot and releases it when the write is over.
- Deadlines: each job has ``deadline_s``. A job not finished by then completes with
  ``PageTimeout`` when the caller next polls/waits, even if a worker is stuck in a syscall. The
  stuck worker's slot is not reused until the worker returns (so a late write can never read a
  recycled buffer); its late result is dropped. A late store either publishes a complete page
  (harmless: same bytes) or leaves a temp file for fsck.
- Stores publish atomically: unique temp beside the final name, optional fsync, rename. An
  existing final file counts as stored (``stored=False``). With codec none and a working
  O_DIRECT (probed at start, ``odirect`` setting), header and payload go to disk in one
  ``pwritev`` from aligned buffers, the payload tail padded to 4096 and the file truncated back.
- Loads read header and payload straight into the slot. A page whose first block is in the
  page cache (cachestat(2)) is copied from the cache in pieces of whole sections (about
  ``WARM_PIECE_BYTES``), each piece hashed as soon as it lands, while it is in the CPU cache;
  an uncached page is read with O_DIRECT (when the probe passed) in one large request, so a
  cold load costs one disk read and no readahead. The header is compared byte for byte with
  the header this engine would write (only key, token count and checksums vary), and every
  section checksum is checked in place. Anything else (another codec or header length, a damaged header, a wrong
  size) goes through ``pagefile.read_page``, which verifies it or names the typed error.
- ``manifest.json`` of the namespace is written at start (a read-only root is logged, and
  loads still work).

Threading: public methods may be called from any thread; one lock guards all engine state
(conditions on it wake one idle worker per submit, one slot waiter per release, a ``wait``
call when its last job is done, ``flush`` when no store is left). Worker threads do I/O
without the lock. zstd (de)compressors and cachestat arguments are per worker thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import itertools
import logging
import mmap
import os
import stat
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import zstandard

from tierstore.config import TierStoreConfig
from tierstore.errors import (
    ConfigError,
    PageCancelled,
    PageCorrupt,
    PageError,
    PageFormatError,
    PageIOError,
    PageMissing,
    PageQueueFull,
    PageTimeout,
    PageTruncated,
)
from tierstore.format import (
    HEADER_ALIGN,
    PREAMBLE_LEN,
    Codec,
    PageExpectation,
    PageLayout,
    PageMeta,
    SectionEntry,
    checksum,
    encode_header,
    encode_page,
    section_checksums,
)
from tierstore.identity import Namespace, namespace_dir, write_manifest
from tierstore.mapper import (
    MAX_KEY_BYTES,
    PAGE_SUFFIX,
    TEMP_SUFFIX,
    FileMapper,
    fanout,
    host_tag,
    parse_temp_name,
)
from tierstore.pagefile import O_DIRECT as _O_DIRECT
from tierstore.pagefile import preadv_upto, read_page, readinto_exact, write_and_rename

logger = logging.getLogger("tierstore.engine")

WARM_PIECE_BYTES = 1 << 20  # see IOEngine._read_plan (measured: docs/design/engine.md)
ALIGN = 4096  # O_DIRECT alignment of buffers, offsets and lengths (and HEADER_ALIGN)
_MISSING_ERRNOS = (errno.ENOENT, errno.ESTALE, errno.ENOTDIR)
# Load failures that prove the file under the final name is bad (not a transient I/O error).
_DISCARD_KINDS = frozenset({"checksum", "truncated", "format", "key_mismatch", "foreign"})
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
assert HEADER_ALIGN % ALIGN == 0


def _round_up(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


@dataclass(eq=False)
class StagingSlot:
    """A reusable page buffer owned by the engine's pool."""

    index: int
    tensor: torch.Tensor  # 1-D uint8, layout.nbytes, 4096-aligned data pointer
    view: memoryview  # the same memory, writable bytes
    # [header room | page | pad to 4096]: a page file is one contiguous, aligned I/O buffer
    # (the header goes right before the page). Engine-internal; callers use ``view``/``tensor``.
    _frame: memoryview = field(repr=False)


@dataclass
class IOResult:
    job_id: int
    op: str  # "load" | "store"
    key: bytes
    ok: bool
    error: PageError | None
    slot: StagingSlot | None  # load OK: the verified page; the caller releases it
    stored: bool  # store OK: False if an identical page already existed
    nbytes: int
    seconds: float  # submit to completion
    # Load OK: True when the engine checked the section checksums. False only for a load
    # submitted with ``verify=False``; then ``sums`` holds the header's section checksums and
    # the caller must check the bytes against them before using them.
    verified: bool = True
    sums: tuple[int, ...] | None = None


class _Job:
    __slots__ = ("id", "op", "key", "slot", "token_count", "submitted", "deadline", "queued", "started", "done",
                 "sums", "verify")

    def __init__(self, job_id: int, op: str, key: bytes, slot: StagingSlot | None, token_count: int,
                 submitted: float, deadline: float, sums: tuple[int, ...] | None = None,
                 verify: bool = True) -> None:
        self.id = job_id
        self.op = op
        self.key = key
        self.slot = slot
        self.token_count = token_count
        self.submitted = submitted
        self.deadline = deadline
        self.queued = False  # counted in IOEngine._waiting
        self.started = False  # a worker owns the slot from here until it returns
        self.done = False
        self.sums = sums  # store: the caller's section checksums; load (verify=False): the header's
        self.verify = verify  # load: check the section checksums here


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


def _cachestat_pages(fd: int, st: Any) -> int:
    """Pages of ``fd`` in the page cache (cachestat(2)); -1 if the kernel cannot tell."""
    if _libc is None:
        return -1
    rc = _libc.syscall(_SYS_CACHESTAT, fd, ctypes.byref(st.cs_range), ctypes.byref(st.cs_out), 0)
    return int(st.cs_out.nr_cache) if rc == 0 else -1


def _cachestat_available() -> bool:
    if not sys.platform.startswith("linux") or _libc is None:
        return False
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        st = _WorkerState()
        return _cachestat_pages(fd, st) >= 0
    finally:
        os.close(fd)


class _Waiter:
    """One ``wait`` call: how many of its jobs are still pending, and how to wake it."""

    __slots__ = ("cond", "remaining")

    def __init__(self, lock: threading.Lock) -> None:
        self.cond = threading.Condition(lock)
        self.remaining = 0


class _WorkerState(threading.local):
    """Per worker thread: zstd objects and cachestat(2) arguments (allocated once)."""

    def __init__(self) -> None:
        self.compressor: zstandard.ZstdCompressor | None = None
        self.decompressor = zstandard.ZstdDecompressor()
        self.cs_range = _CachestatRange(0, ALIGN)  # the first page of a file
        self.cs_out = _Cachestat()


def probe_odirect(directory: Path) -> tuple[bool, str]:
    """Whether an aligned O_DIRECT write and read work in ``directory``; (ok, reason)."""
    if not _O_DIRECT:
        return False, "O_DIRECT is not available on this platform"
    path = directory / f".odirect-probe.{os.getpid()}.{threading.get_ident()}.tmp"
    buf = mmap.mmap(-1, ALIGN)
    try:
        buf.write(b"tierstore-odirect-probe".ljust(ALIGN, b"\0"))
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | _O_DIRECT, 0o644)
        try:
            if os.pwrite(fd, buf, 0) != ALIGN:
                return False, "short O_DIRECT write"
            back = mmap.mmap(-1, ALIGN)
            try:
                if os.preadv(fd, [back], 0) != ALIGN or back[:] != buf[:]:
                    return False, "O_DIRECT read-back differs"
            finally:
                back.close()
        finally:
            os.close(fd)
        return True, "probe write+read ok"
    except OSError as exc:
        return False, f"{exc.strerror} (errno {exc.errno})"
    finally:
        buf.close()
        with contextlib.suppress(OSError):
            os.unlink(path)


class IOEngine:
    """Loads and stores pages of one KV-cache group (and rank) under one root."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        namespace: Namespace,
        group_index: int,
        *,
        rank: int = 0,
        head_start: int = 0,
        head_count: int = 0,
        config: TierStoreConfig | None = None,
        staging_slots: int | None = None,
        pin: bool = False,
        deadline_s: float | None = None,
    ) -> None:
        self.root = Path(root)
        self.config = config if config is not None else TierStoreConfig(root=str(root))
        if not 0 <= group_index < len(namespace.groups):
            raise ConfigError(f"group index {group_index} is outside the namespace's {len(namespace.groups)} groups")
        self.namespace = namespace
        self.group_index = group_index
        self.group = namespace.groups[group_index]
        self.layout: PageLayout = self.group.layout
        self.rank = rank
        self.head_start = head_start
        self.head_count = head_count
        self.mapper = FileMapper(self.root, namespace.digest, group_index, rank)
        self._base = str(self.mapper.base)
        probe_key = b"\x01tierstore"
        if (self._final_path(probe_key) != str(self.mapper.path_for(probe_key))
                or parse_temp_name(os.path.basename(self._temp_path(self._final_path(probe_key), probe_key))) is None):
            raise AssertionError("IOEngine's fast path names disagree with FileMapper")
        self.codec = Codec.ZSTD if self.config.codec == "zstd" else Codec.NONE
        self.deadline_s = deadline_s if deadline_s is not None else self.config.deadline_ms / 1000.0
        self._ns_bytes = namespace.digest_bytes
        self._nbytes = self.layout.nbytes
        self._padded_nbytes = _round_up(self._nbytes)
        self._templates: dict[int, _HeaderTemplate] = {}  # key length -> header of our pages
        # Warm loads read this much, then hash it while it is still in the CPU cache (L2/L3).
        self.warm_piece_bytes = WARM_PIECE_BYTES
        self._plans: dict[int, list[tuple[int, int, int, int]]] = {}  # header length -> read plan

        self._write_manifest()
        self._make_fanout_dirs()
        self.odirect, self.odirect_reason = self._decide_odirect()
        # Cold loads read with O_DIRECT when it works and the kernel can tell us what is cached
        # (cachestat, Linux 6.5); cached pages are still copied from the page cache.
        self.direct_loads = self.odirect and _cachestat_available()

        n_slots = staging_slots if staging_slots is not None else 2 * self.config.io_threads + 2
        if n_slots <= 0:
            raise ConfigError(f"staging_slots must be positive, got {n_slots}")
        self.pinned = bool(pin and torch.cuda.is_available())
        self._slots = self._allocate_slots(n_slots, self.pinned)
        self._free: deque[StagingSlot] = deque(self._slots)
        self._free_set = {s.index for s in self._slots}
        self._busy: set[int] = set()  # slots owned by queued or running jobs

        # One lock; conditions on it wake exactly who can proceed: a submit wakes one idle
        # worker, a release wakes one slot waiter, a completion wakes a ``wait`` caller only when
        # its last job is done and ``flush`` callers only when no store is left. (Waking every
        # waiter on every completion cost a context switch per page on 2 busy cores.)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # queued jobs, stop
        self._slot_cond = threading.Condition(self._lock)  # a slot was released
        self._flush_cond = threading.Condition(self._lock)  # no store pending
        self._watch: dict[int, list[_Waiter]] = {}  # job id -> wait() calls waiting for it
        self._load_q: deque[_Job] = deque()
        self._store_q: deque[_Job] = deque()
        self._waiting = {"load": 0, "store": 0}  # queued, not started, not done
        self._pending: dict[int, _Job] = {}  # not done, in submission order
        self._pending_stores = 0
        self._results: dict[int, IOResult] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self._stop = False
        self._stats: dict[str, Any] = {
            "loads_ok": 0, "loads_failed": {}, "load_bytes": 0, "load_seconds": 0.0,
            "stores_ok": 0, "stores_existing": 0, "stores_failed": {}, "store_bytes": 0,
            "store_seconds": 0.0, "late_results_dropped": 0, "loads_general_reader": 0,
            "loads_odirect": 0,  # cold loads read with O_DIRECT (the rest came from the page cache)
            "bad_pages_discarded": 0,  # damaged files removed so the key can be stored again
        }
        self._local = _WorkerState()
        self._threads = [
            threading.Thread(target=self._worker, name=f"tierstore-io-g{group_index}-{i}", daemon=True)
            for i in range(self.config.io_threads)
        ]
        for t in self._threads:
            t.start()

    # ----------------------------------------------------------------- setup
    def _write_manifest(self) -> None:
        try:
            write_manifest(self.root, self.namespace)
        except OSError as exc:  # a read-only root can still serve loads
            logger.warning("cannot write manifest.json under %s (%s); loads still work, stores may fail",
                           namespace_dir(self.root, self.namespace), exc.strerror)

    def _make_fanout_dirs(self) -> None:
        # Stores then never create a directory (see mapper.py); one that is missing later
        # (removed by hand) is still created on ENOENT by pagefile.write_and_rename.
        try:
            self.mapper.make_fanout_dirs()
        except OSError as exc:
            logger.warning("cannot create the fan-out directories under %s (%s); loads still work, stores may fail",
                           self.mapper.base, exc.strerror)

    def _decide_odirect(self) -> tuple[bool, str]:
        mode = self.config.odirect
        if mode == "off":
            return False, 'odirect setting is "off"'
        if self.codec != Codec.NONE:
            if mode == "on":
                raise ConfigError('setting "odirect" is "on" but codec "zstd" writes unaligned frames; '
                                  'set "odirect" to "auto" or "off", or "codec" to "none"')
            return False, "codec zstd: compressed frames are written buffered"
        probe_dir = self.mapper.base
        try:
            probe_dir.mkdir(parents=True, exist_ok=True)
        except OSError:
            probe_dir = namespace_dir(self.root, self.namespace)
            if not probe_dir.is_dir():
                probe_dir = self.root
        ok, reason = probe_odirect(probe_dir)
        if ok:
            logger.info("O_DIRECT stores enabled under %s", probe_dir)
            return True, reason
        if mode == "on":
            raise ConfigError(f'setting "odirect" is "on" but O_DIRECT does not work under {probe_dir}: '
                              f'{reason}; set "odirect" to "auto" (falls back to buffered I/O) or "off"')
        logger.warning("O_DIRECT does not work under %s (%s): stores use buffered I/O "
                       "(stats['io_mode'] == 'buffered')", probe_dir, reason)
        return False, reason

    def _allocate_slots(self, n: int, pinned: bool) -> list[StagingSlot]:
        # Header room: the longest header of this layout (keys up to MAX_KEY_BYTES).
        self._reserve = self._template(MAX_KEY_BYTES).header_len
        stride = self._reserve + self._padded_nbytes
        base = torch.empty(n * stride + ALIGN, dtype=torch.uint8, pin_memory=pinned)
        if not pinned:  # pinned memory is the CUDA allocator's; leave it alone
            _advise_huge_pages(base.data_ptr(), base.numel())
        skew = (-base.data_ptr()) % ALIGN
        self._slab = base  # keeps every slot's memory alive
        slab_view = memoryview(base.numpy()).cast("B")
        slots = []
        for i in range(n):
            start = skew + i * stride
            off = start + self._reserve
            tensor = base[off : off + self._nbytes]
            assert tensor.data_ptr() % ALIGN == 0
            slots.append(StagingSlot(i, tensor, slab_view[off : off + self._nbytes],
                                     slab_view[start : start + stride]))
        return slots

    def _file_buf(self, slot: StagingSlot, hl: int, padded: bool) -> memoryview:
        """The slot's frame from its ``hl``-byte header to the page end (padded: to 4096)."""
        end = self._reserve + (self._padded_nbytes if padded else self._nbytes)
        return slot._frame[self._reserve - hl : end]

    # ----------------------------------------------------------------- slots
    def acquire_slot(self, timeout: float | None = 0) -> StagingSlot | None:
        """A free staging slot, or None if none frees up within ``timeout`` (None = forever)."""
        with self._lock:
            if not self._free and timeout != 0:
                end = None if timeout is None else time.monotonic() + timeout
                while not self._free:
                    left = None if end is None else end - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    self._slot_cond.wait(left)
            return self._take_slot_locked()

    def _take_slot_locked(self) -> StagingSlot | None:
        if not self._free:
            return None
        slot = self._free.pop()  # LIFO: the most recently used buffer is the one still in cache
        self._free_set.discard(slot.index)
        return slot

    def release_slot(self, slot: StagingSlot) -> None:
        with self._lock:
            self._release_locked(slot)

    def _release_locked(self, slot: StagingSlot) -> None:
        if slot.index >= len(self._slots) or self._slots[slot.index] is not slot:
            raise ValueError("release_slot: this slot does not belong to this engine")
        if slot.index in self._free_set:
            raise ValueError(f"release_slot: slot {slot.index} is already free (released twice)")
        self._free.append(slot)
        self._free_set.add(slot.index)
        self._busy.discard(slot.index)
        self._slot_cond.notify()

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    # ----------------------------------------------------------------- submit
    def submit_store(self, key: bytes, slot: StagingSlot, token_count: int,
                     sums: Sequence[int] | None = None) -> int:
        """Queue a store of ``slot`` under ``key``; the engine releases the slot when done.

        ``sums``: the xxh3-64 of each layout section of the slot's bytes, computed by the caller
        (the GPU, right after the gather); the engine writes them into the header instead of
        hashing the page. A wrong value is caught by every later read (the page is then
        reported corrupt and removed), never served.
        """
        if slot.index >= len(self._slots) or self._slots[slot.index] is not slot:
            raise ValueError("submit_store: the slot does not belong to this engine")
        if sums is not None and len(sums) != len(self.layout.sections):
            raise ValueError(f"submit_store: {len(sums)} checksums for {len(self.layout.sections)} sections")
        with self._lock:
            if slot.index in self._free_set or slot.index in self._busy:
                raise ValueError(f"submit_store: slot {slot.index} is not held by the caller "
                                 "(free, or already submitted)")
        return self._submit("store", bytes(key), slot, token_count,
                            sums=tuple(int(c) for c in sums) if sums is not None else None)

    def submit_load(self, key: bytes, verify: bool = True) -> int:
        """Queue a load of ``key``; on success the result carries a slot with the page.

        ``verify=False``: the caller checks the section checksums (the GPU, after the copy);
        the engine still checks the header, key and size. See ``IOResult.verified``.
        """
        return self._submit("load", bytes(key), None, 0, verify=verify)

    def _submit(self, op: str, key: bytes, slot: StagingSlot | None, token_count: int, *,
                sums: tuple[int, ...] | None = None, verify: bool = True) -> int:
        if not 0 < len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"a page key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
        now = time.monotonic()
        with self._lock:
            job = _Job(next(self._ids), op, key, slot, token_count, now, now + self.deadline_s, sums, verify)
            if slot is not None:
                self._busy.add(slot.index)
            self._pending[job.id] = job
            if op == "store":
                self._pending_stores += 1
            if self._closed:
                self._complete_locked(job, PageCancelled("the engine is closed", key=key))
                return job.id
            if self._waiting[op] >= self.config.queue_depth:
                self._complete_locked(job, PageQueueFull(
                    f"{op} queue is full ({self.config.queue_depth} queued); poll results faster "
                    'or raise the "queue_depth" setting', key=key))
                return job.id
            if op == "load":
                job.slot = self._take_slot_locked()
                if job.slot is not None:
                    self._busy.add(job.slot.index)
                if job.slot is None:
                    self._complete_locked(job, PageQueueFull(
                        f"no free staging slot (all {len(self._slots)} in use); release the slots "
                        "of finished loads or give the engine more staging_slots", key=key))
                    return job.id
            job.queued = True
            self._waiting[op] += 1
            (self._load_q if op == "load" else self._store_q).append(job)
            self._work.notify()
            return job.id

    # ----------------------------------------------------------------- results
    def poll(self) -> list[IOResult]:
        """Every result finished since the last poll/wait (never blocks)."""
        with self._lock:
            self._expire_locked(time.monotonic())
            out = list(self._results.values())
            self._results.clear()
            return out

    def wait(self, job_ids: Any, timeout: float | None) -> list[IOResult]:
        """Wait until the given jobs finish (or ``timeout``); returns those that finished.

        Results returned here are not returned again by ``poll``.
        """
        ids = list(job_ids)
        end = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._expire_locked(time.monotonic())
            waiter = _Waiter(self._lock)
            for i in ids:
                if i in self._pending:
                    self._watch.setdefault(i, []).append(waiter)
                    waiter.remaining += 1
            try:
                while waiter.remaining > 0:
                    now = time.monotonic()
                    left = self._next_wake(now, end)
                    if left is not None and left <= 0:
                        break
                    waiter.cond.wait(left)
                    self._expire_locked(time.monotonic())
            finally:
                for i in ids:
                    ws = self._watch.get(i)
                    if ws and waiter in ws:
                        ws.remove(waiter)
                        if not ws:
                            del self._watch[i]
            return [self._results.pop(i) for i in ids if i in self._results]

    def _next_wake(self, now: float, end: float | None) -> float | None:
        """Seconds until the caller's end or the earliest pending deadline, whichever is first."""
        first = next(iter(self._pending.values()), None)
        wake = end
        if first is not None:
            wake = first.deadline if wake is None else min(wake, first.deadline)
        return None if wake is None else max(wake - now, 0.0) + (0.001 if wake != end else 0.0)

    def _expire_locked(self, now: float) -> None:
        # All jobs share one deadline length, so _pending (insertion order) is deadline order.
        expired = []
        for job in self._pending.values():
            if job.deadline > now:
                break
            expired.append(job)
        for job in expired:
            self._complete_locked(job, PageTimeout(
                f"{job.op} did not finish within {self.deadline_s:.3f} s "
                '(deadline_ms setting); the file system may be stalled',
                path=self.mapper.path_for(job.key), key=job.key))

    def contains(self, key: bytes) -> bool:
        """Cheap existence check (one stat); a hit still has to be verified by a load."""
        try:
            return self.mapper.path_for(key).exists()
        except (OSError, ValueError):
            return False

    def flush(self, timeout: float | None) -> bool:
        """Wait until every submitted store has finished (ok, failed or timed out)."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                now = time.monotonic()
                self._expire_locked(now)
                if self._pending_stores == 0:
                    return True
                left = self._next_wake(now, end)
                if left is not None and left <= 0:
                    return False
                self._flush_cond.wait(left)

    def close(self, timeout: float | None = None) -> None:
        """Finish queued stores (up to ``timeout``, default flush_timeout_s), cancel the rest."""
        if timeout is None:
            timeout = self.config.flush_timeout_s
        end = time.monotonic() + timeout
        with self._lock:
            if self._closed:
                return
            self._closed = True  # new submits are cancelled; queued stores still run
        if not self.flush(timeout):
            logger.warning("closing with stores still queued after %.1f s; they are cancelled", timeout)
        with self._lock:
            for q in (self._load_q, self._store_q):
                while q:
                    job = q.popleft()
                    if not job.done:
                        self._complete_locked(job, PageCancelled("the engine was closed before this job ran", key=job.key))
            self._stop = True
            self._work.notify_all()
        for t in self._threads:
            t.join(max(end - time.monotonic(), 0.05))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            logger.warning("I/O threads still blocked in a system call at close: %s", stuck)

    def __enter__(self) -> IOEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def stats(self) -> dict[str, Any]:
        with self._lock:
            s = dict(self._stats)
            s["loads_failed"] = dict(s["loads_failed"])
            s["stores_failed"] = dict(s["stores_failed"])
            s["io_mode"] = "odirect" if self.odirect else "buffered"
            s["odirect_reason"] = self.odirect_reason
            s["codec"] = self.codec.name.lower()
            s["queued_loads"] = self._waiting["load"]
            s["queued_stores"] = self._waiting["store"]
            s["pending"] = len(self._pending)
            s["free_slots"] = len(self._free)
            s["staging_slots"] = len(self._slots)
            s["pinned"] = self.pinned
            return s

    # ----------------------------------------------------------------- completion
    def _complete_locked(self, job: _Job, error: PageError | None, stored: bool = False,
                         nbytes: int = 0) -> bool:
        """Complete ``job`` once; False if it was already completed (a late result)."""
        if job.done:
            self._stats["late_results_dropped"] += 1
            return False
        job.done = True
        del self._pending[job.id]
        if job.queued:
            job.queued = False
            self._waiting[job.op] -= 1
        if job.op == "store":
            self._pending_stores -= 1
            if self._pending_stores == 0:
                self._flush_cond.notify_all()
        for w in self._watch.pop(job.id, ()):
            w.remaining -= 1
            if w.remaining == 0:
                w.cond.notify()
        seconds = time.monotonic() - job.submitted
        ok = error is None
        result_slot = None
        if job.slot is not None and not job.started:
            # Never ran: the slot is free again (a store's slot is the engine's once submitted).
            self._release_locked(job.slot)
        elif ok and job.op == "load":
            result_slot = job.slot
            self._busy.discard(job.slot.index)  # type: ignore[union-attr]  # now the caller's
        s = self._stats
        if job.op == "load":
            if ok:
                s["loads_ok"] += 1
                s["load_bytes"] += nbytes
                s["load_seconds"] += seconds
            else:
                s["loads_failed"][error.kind] = s["loads_failed"].get(error.kind, 0) + 1  # type: ignore[union-attr]
        else:
            if ok:
                s["stores_ok" if stored else "stores_existing"] += 1
                s["store_bytes"] += nbytes
                s["store_seconds"] += seconds
            else:
                s["stores_failed"][error.kind] = s["stores_failed"].get(error.kind, 0) + 1  # type: ignore[union-attr]
        unverified = ok and job.op == "load" and job.sums is not None
        self._results[job.id] = IOResult(job.id, job.op, job.key, ok, error, result_slot, stored, nbytes, seconds,
                                         verified=not unverified, sums=job.sums if unverified else None)
        return True

    # ----------------------------------------------------------------- workers
    def _worker(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self._load_q and not self._store_q:
                    self._work.wait()
                if self._stop:
                    return
                job = self._load_q.popleft() if self._load_q else self._store_q.popleft()
                if job.done:  # expired or cancelled while queued; its slot is already free
                    continue
                job.queued = False
                self._waiting[job.op] -= 1
                if time.monotonic() >= job.deadline:
                    self._complete_locked(job, PageTimeout(
                        f"{job.op} waited in the queue past its {self.deadline_s:.3f} s deadline "
                        "(deadline_ms setting)", key=job.key))
                    continue
                job.started = True
            error: PageError | None = None
            stored = False
            nbytes = 0
            try:
                if job.op == "load":
                    nbytes, job.sums = self._do_load(job.key, job.slot, job.verify)  # type: ignore[arg-type]
                else:
                    stored, nbytes = self._do_store(job.key, job.slot, job.token_count, job.sums)  # type: ignore[arg-type]
            except PageError as exc:
                error = exc
                if error.key is None:  # readers deep in format.py do not know the key
                    error.key = job.key
                if job.op == "load" and error.kind in _DISCARD_KINDS:
                    self._discard_bad_page(job.key, error)
            except Exception as exc:  # a bug must still come back as a per-key failure
                logger.exception("unexpected error in %s of key %s", job.op, job.key.hex()[:16])
                error = PageError(f"internal error: {exc!r}", key=job.key)
            with self._lock:
                accepted = self._complete_locked(job, error, stored, nbytes)
                # The worker owned the slot: hand it back unless the caller got it with a page.
                if job.slot is not None and not (accepted and error is None and job.op == "load"):
                    self._release_locked(job.slot)

    def expectation(self, key: bytes) -> PageExpectation:
        """What a page of ``key`` written for this engine must be (``pagefile.read_page``)."""
        return PageExpectation(self._ns_bytes, key, self.group_index, self.rank, self.layout)

    def discard_page(self, key: bytes, reason: str) -> None:
        """The caller found the page of ``key`` damaged (a load with ``verify=False`` whose bytes
        did not match the header's checksums): remove it, like a damaged page found here."""
        self._discard_bad_page(bytes(key), PageCorrupt(reason, key=bytes(key)))

    def _discard_bad_page(self, key: bytes, error: PageError) -> None:
        """Remove a page that failed verification, so the next store of its key can replace it.

        Names are content addresses: a damaged file under a final name would otherwise count as
        "already stored" forever. Racing a writer that republished the name in between only
        costs that page (a later miss), never correctness: readers verify.
        """
        path = self._final_path(key)
        try:
            os.unlink(path)
        except OSError:
            return
        logger.warning("removed damaged page %s (%s)", path, error)
        with self._lock:
            self._stats["bad_pages_discarded"] += 1

    def _template(self, key_len: int) -> _HeaderTemplate:
        tmpl = self._templates.get(key_len)
        if tmpl is None:
            tmpl = _HeaderTemplate(self._ns_bytes, key_len, self.group_index, self.group.kind,
                                   self.rank, self.head_start, self.head_count, self.layout)
            self._templates[key_len] = tmpl
        return tmpl

    def _header_len(self, key_len: int) -> int:
        """Header bytes of this engine's pages for a key of ``key_len`` bytes."""
        return self._template(key_len).header_len

    def _final_path(self, key: bytes) -> str:
        """``mapper.path_for(key)`` as a string, without pathlib on the hot path."""
        return f"{self._base}/{fanout(key)}/{key.hex()}{PAGE_SUFFIX}"

    def _temp_path(self, final: str, key: bytes) -> str:
        """A unique temp name beside ``final`` in the mapper's format (fsck parses it)."""
        return (f"{os.path.dirname(final)}/.{key.hex()}{PAGE_SUFFIX}.{host_tag()}.{os.getpid()}."
                f"{os.urandom(6).hex()}{TEMP_SUFFIX}")

    # ----------------------------------------------------------------- store
    def _do_store(self, key: bytes, slot: StagingSlot, token_count: int,
                  sums: tuple[int, ...] | None) -> tuple[bool, int]:
        final = self._final_path(key)
        if os.path.exists(final):
            return False, self._nbytes
        data = slot.view
        if self.codec == Codec.NONE:
            tmpl = self._template(len(key))
            hl = tmpl.header_len
            # The header is written into the slot's frame right before the page, so the whole
            # file goes out as one buffer (O_DIRECT: aligned, tail padded, truncated after).
            if sums is None:
                sums = section_checksums(self.layout, data)
            tmpl.fill(slot._frame[self._reserve - hl : self._reserve], key, token_count, sums)
            buf = self._file_buf(slot, hl, padded=self.odirect)
            truncate_to = hl + self._nbytes if self.odirect and self._padded_nbytes != self._nbytes else 0
            self._publish(final, key, [buf], truncate_to=truncate_to, direct=self.odirect,
                          exact_len=hl + self._nbytes)
        else:
            st = self._local
            if st.compressor is None:
                st.compressor = zstandard.ZstdCompressor(level=self.config.zstd_level)
            meta = PageMeta(self._ns_bytes, key, self.group_index, self.group.kind, token_count,
                            self.rank, self.head_start, self.head_count)
            header, payload = encode_page(meta, self.layout, data, Codec.ZSTD, st.compressor)
            self._publish(final, key, [header, *payload], truncate_to=0, direct=False, exact_len=0)
        return True, self._nbytes

    def _publish(self, final: str, key: bytes, pieces: list[Any], *, truncate_to: int,
                 direct: bool, exact_len: int) -> None:
        write_and_rename(final, self._temp_path(final, key), pieces, key=key, fsync=self.config.fsync,
                         direct=direct, exact_len=exact_len, truncate_to=truncate_to)

    # ----------------------------------------------------------------- load
    def _do_load(self, key: bytes, slot: StagingSlot, verify: bool) -> tuple[int, tuple[int, ...] | None]:
        """Read ``key`` into ``slot``: (bytes, None) when verified here, else (bytes, header sums)."""
        spath = path = self._final_path(key)
        tmpl = self._template(len(key))
        hl = tmpl.header_len
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            if exc.errno in _MISSING_ERRNOS:
                raise PageMissing("no such page", path=path, key=key) from exc
            raise PageIOError(f"cannot open page: {exc.strerror}", errno=exc.errno, path=path, key=key) from exc
        try:
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise PageFormatError("not a regular file", path=spath, key=key)
                if st.st_size == hl + self._nbytes:
                    sums = self._read_verified(fd, tmpl, slot, key, spath, verify)
                    if sums is not None:
                        return self._nbytes, (None if verify else tuple(sums))
            except OSError as exc:
                if exc.errno in _MISSING_ERRNOS:
                    raise PageMissing("page vanished while reading", path=path, key=key) from exc
                raise PageIOError(f"read failed: {exc.strerror}", errno=exc.errno, path=path, key=key) from exc
        finally:
            os.close(fd)
        # Not byte-for-byte the header this engine writes (other codec or header length, a wrong
        # size, a damaged header): the general reader verifies it or names the error.
        with self._lock:
            self._stats["loads_general_reader"] += 1
        read_page(Path(path), self.expectation(key), slot.view, self._local.decompressor)
        return self._nbytes, None  # the general reader verified it

    def _read_verified(self, fd: int, tmpl: _HeaderTemplate, slot: StagingSlot, key: bytes,
                       spath: str, verify: bool = True) -> list[int] | None:
        """Read a file of our exact size into the slot's frame and verify it in place.

        Returns the header's section checksums; None: the header is not byte-for-byte ours
        (the caller takes the general reader). ``verify=False``: the sections are not hashed
        (the caller checks them against the returned sums), and the file is read in one request.
        Cached pages are read piece by piece (``_read_plan``) and each piece's sections are
        hashed at once, while the bytes are still in the CPU cache; an uncached page is read
        with O_DIRECT in one large request (no readahead windows, no page-cache copy; a
        RWF_NOWAIT probe read would start readahead and read the disk twice).
        """
        hl = tmpl.header_len
        pieces = self._read_plan(hl)
        frame = slot._frame
        base = self._reserve - hl  # frame index of file offset 0
        # Only the first page is asked about (cachestat walks the cache: cost grows with the
        # range). Pages leave the cache oldest first, so a cached first page means a warm file;
        # if the guess is wrong, the buffered read just waits for the missing pages.
        read_all = (self.direct_loads and _cachestat_pages(fd, self._local) <= 0
                    and self._read_direct(fd, slot, hl, spath))
        if not verify:
            if not read_all:
                readinto_exact(fd, frame[base : base + hl + self._nbytes], 0, spath)
            return tmpl.parse(frame[base : base + hl], key)
        sums: list[int] | None = None
        view = slot.view
        for start, end, first_sec, last_sec in pieces:
            if not read_all:
                readinto_exact(fd, frame[base + start : base + end], start, spath)
            if sums is None:
                sums = tmpl.parse(frame[base : base + hl], key)
                if sums is None:
                    return None
            for i in range(first_sec, last_sec):
                o, e = self.layout.spans[i]
                if checksum(view[o:e]) != sums[i]:
                    raise PageCorrupt(f"section {self.layout.sections[i].name!r} checksum mismatch",
                                      path=spath, key=key)
        return sums

    def _read_plan(self, hl: int) -> list[tuple[int, int, int, int]]:
        """File pieces (start, end, first section, end section) for a header of ``hl`` bytes.

        Whole sections, about ``warm_piece_bytes`` each (the CPU cache that still holds a piece
        when it is hashed); the first piece also holds the header, the last reaches the end.
        """
        plan = self._plans.get(hl)
        if plan is None:
            plan = []
            start, first = 0, 0
            spans = self.layout.spans
            for i, (_, e) in enumerate(spans):
                if hl + e - start >= self.warm_piece_bytes or i == len(spans) - 1:
                    end = hl + (e if i < len(spans) - 1 else self._nbytes)
                    plan.append((start, end, first, i + 1))
                    start, first = end, i + 1
            if not plan:  # a layout without sections
                plan.append((0, hl + self._nbytes, 0, 0))
            self._plans[hl] = plan
        return plan

    def _read_direct(self, fd: int, slot: StagingSlot, hl: int, spath: str) -> bool:
        """The whole file with O_DIRECT into the slot's frame; False if O_DIRECT is refused."""
        with self._lock:
            self._stats["loads_odirect"] += 1
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT)
            end = preadv_upto(fd, [self._file_buf(slot, hl, padded=True)], 0)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            # This file system refuses O_DIRECT here: read buffered.
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)
            return False
        if end < hl + self._nbytes:
            raise PageTruncated("file ended while reading the page", path=spath)
        return True

    def settle(self, result: Any, ok: bool, reason: str = "") -> None:  # shim until merge
        """PageStore.settle: a damaged unverified page is removed (``discard_page``)."""
        if not ok:
            self.discard_page(result.key, reason or "the caller's checksum check failed")


class _HeaderTemplate:
    """The exact header this engine writes for a key length, with the variable fields known.

    A page of ours differs from the template only in the key, the token count, the section
    checksums and the header checksum, so a store patches those into a copy and a load
    compares everything else byte for byte (``parse``); any other header takes the slow path
    (``decode_header``), which gives the typed error.
    """

    _TOKEN_OFF = 48  # see format.py: token count (u32) in the preamble
    _KEY_OFF = PREAMBLE_LEN

    def __init__(self, ns: bytes, key_len: int, group_index: int, kind: Any, rank: int,
                 head_start: int, head_count: int, layout: PageLayout) -> None:
        meta = PageMeta(ns, b"\0" * key_len, group_index, kind, 0, rank, head_start, head_count)
        sentinels = [0x5EC7_0000_0000_0000 + i for i in range(len(layout.sections))]
        entries = [SectionEntry(sp, o, sp.nbytes, c)
                   for sp, o, c in zip(layout.sections, layout.offsets, sentinels, strict=True)]
        raw = encode_header(meta, Codec.NONE, entries, layout.nbytes)
        self.header_len = len(raw)
        self.key_len = key_len
        # Where each section checksum sits (format v1 section table), checked against sentinels.
        offs, pos = [], self._KEY_OFF + key_len
        for sp in layout.sections:
            pos += 2 + len(sp.name.encode()) + 2 + 4 * len(sp.shape) + 24
            offs.append(pos)
            pos += 8
        if [_U64.unpack_from(raw, o)[0] for o in offs] != sentinels:
            raise AssertionError("header template: section table offsets disagree with format.py")
        self.sum_offsets = offs
        blank = bytearray(raw)
        for o in offs:
            blank[o : o + 8] = bytes(8)
        blank[-8:] = bytes(8)
        self.blank = bytes(blank)  # key, token count, checksums all zero
        # Byte ranges that are the same in every page of ours (all but the variable fields).
        variable = sorted([(self._KEY_OFF, self._KEY_OFF + key_len), (self._TOKEN_OFF, self._TOKEN_OFF + 4),
                           *[(o, o + 8) for o in offs], (self.header_len - 8, self.header_len)])
        ranges, pos = [], 0
        for a, b in variable:
            if a > pos:
                ranges.append((pos, a))
            pos = max(pos, b)
        self._const_ranges = ranges
        self._const = b"".join(self.blank[a:b] for a, b in ranges)

    def fill(self, buf: Any, key: bytes, token_count: int, sums: list[int]) -> None:
        """Write the header of (key, token_count, section checksums) into ``buf``."""
        hl = self.header_len
        buf[:hl] = self.blank
        buf[self._KEY_OFF : self._KEY_OFF + self.key_len] = key
        _U32.pack_into(buf, self._TOKEN_OFF, token_count)
        for o, c in zip(self.sum_offsets, sums, strict=True):
            _U64.pack_into(buf, o, c)
        _U64.pack_into(buf, hl - 8, checksum(memoryview(buf)[: hl - 8]))

    def parse(self, hview: memoryview, key: bytes) -> list[int] | None:
        """Section checksums if ``hview`` is exactly our header for ``key``; else None."""
        hl = self.header_len
        h = bytes(hview)
        if checksum(memoryview(h)[: hl - 8]) != _U64.unpack_from(h, hl - 8)[0]:
            return None
        if h[self._KEY_OFF : self._KEY_OFF + self.key_len] != key:
            return None
        if b"".join([h[a:b] for a, b in self._const_ranges]) != self._const:
            return None
        return [_U64.unpack_from(h, o)[0] for o in self.sum_offsets]


def _advise_huge_pages(addr: int, nbytes: int) -> None:
    """Ask for transparent huge pages on the staging slab (before its first touch).

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
    start = _round_up(addr, huge)
    end = (addr + nbytes) // huge * huge
    if end > start:
        madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_HUGEPAGE)
