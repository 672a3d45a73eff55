"""IOEngine: the ``PageStore`` (store.py) of one root, for one (namespace, group, rank).

The engine is policy; the mechanisms are its parts, each with its own contract:
``ioqueue.JobQueue`` (queues, I/O threads, deadlines, results; loads before stores, a store
never starved), ``staging.StagingPool`` (the page buffers), ``page_files.PageFiles`` (the
store, load and removal of this rank directory's page files, on I/O threads; built on the
flat functions of one page file, each with its failure policy: page_io.py, publish.py,
own_read.py, page_read.py, rank_dir.py), ``mapper.FileMapper`` (every file
name) and ``format.HeaderTemplate`` (the exact header of our pages). What the engine decides:

- Setup: ``manifest.json`` of the namespace and the 256 fan-out directories are written at
  start (a read-only root is logged; loads still work). O_DIRECT is used when the ``odirect``
  setting allows and ``publish.probe_odirect`` passes under the group's directory (never with
  codec zstd, whose frames are unaligned); cold loads read with O_DIRECT when, in addition, the
  kernel answers cachestat(2).
- Store (``PageFiles.store``): an existing final file counts as stored (``stored=False``)
  before anything is hashed; the caller's section sums, or ours, go into the header. The
  engine takes the slot at submit and gives it back to the pool when the job is done.
- Batches (``io_batch_pages``, at most 16 MiB of pages: ``io_batch_for``): an I/O thread may
  take several queued jobs of one class at once (``JobQueue``); a batch of loads goes to
  ``PageFiles.load_many``, a batch of stores to ``PageFiles.store_many`` (one GIL-free call
  each for the common case); every job keeps its own result and failure.
- Load (``PageFiles.load``): a file of exactly our size is read into the slot's frame, a warm
  one piece by piece (about ``warm_piece_bytes``, each piece hashed while in the CPU cache), a
  cold one with O_DIRECT in one request; any other file goes through the general reader, which
  names the error. A load takes a free slot at submit (none: ``queue_full``) and hands it to the
  caller with the page.
- A root others can write to (issue 17): at start the root must pass ``trust.check_root_trust``
  (setting ``trust_shared_root``) and the group/rank/fan-out directories must not be symlinks
  (``FileMapper.make_fanout_dirs``, a ConfigError otherwise); files are created 0600 and
  directories 0700 (0660/2770 with ``shared_group_access``). Every load, store and discard
  reaches its file through ``PageFiles`` (``rank_dir.RankDir``: directory fds, no symlink followed) and
  opens it ``O_NOFOLLOW|O_NONBLOCK``: a symlink, FIFO or hard-linked file under a page's name
  is a ``PageUnsafe`` failure, never served, never followed or removed by a load; a store of the
  key moves that entry aside and stores the page (``publish.move_planted_aside``). With ``mac_key_file`` every page
  carries a MAC trailer (format.FLAG_MAC) and a load verifies it before serving (kind "mac":
  not verifiable with this key, a miss; the file is left in place, never removed: it may be
  another key's good page during a rotation, ``errors.UNVERIFIABLE_KINDS``); such an engine
  writes and reads buffered (the 40-byte trailer does not fit O_DIRECT's alignment). With
  ``encryption_key_file`` pages are sealed instead (format/sealing.py: AES-256-GCM bodies, the
  GCM tag authenticates them; no MAC), on the Python I/O threads and buffered as well.
- Verification and damaged pages (the rule is store.py's): a load whose
  bytes prove bad (``errors.BAD_CONTENT_KINDS``) removes the file it read, once, so the key can
  be stored again; a load with ``verify=False`` is settled by the caller (``settle``), which
  counts the hit or removes the file the engine served, once. A file republished under the
  name in between is never removed (``PageFiles.remove_damaged`` compares file identity).

Threading: public methods may be called from any thread. Lock order: the job queue's lock,
then the staging pool's, then the engine's stats lock (the last two are leaves). I/O threads
run ``PageFiles`` operations (or those of the wrapper passed as ``file_ops``) holding no lock;
zstd compressors and cachestat arguments are per thread there. ``PageFiles`` counts into the
engine's stats through ``_count`` (the stats lock).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from tierstore.config import TierStoreConfig, io_threads_advice
from tierstore.errors import (
    BAD_CONTENT_KINDS,
    ConfigError,
    PageCorrupt,
    PageError,
    PageQueueFull,
)
from tierstore.format.header import Codec, PageExpectation
from tierstore.format.identity import Namespace, namespace_dir, write_manifest
from tierstore.format.mac import PageMac
from tierstore.format.page_layout import PageLayout
from tierstore.format.sealing import KeyRing
from tierstore.fs import safefs
from tierstore.fs.directio import ALIGN, FrameGeometry, cachestat_available
from tierstore.fs.mapper import FileMapper, check_key
from tierstore.fs.trust import check_root_trust
from tierstore.native import loader as native
from tierstore.rootstore.counters import EngineCounters, Served
from tierstore.rootstore.ioqueue import Job, JobQueue, QueuePolicy, new_job
from tierstore.rootstore.lane import NativeLane
from tierstore.rootstore.own_read import WARM_PIECE_BYTES
from tierstore.rootstore.page_files import PageFiles
from tierstore.rootstore.publish import probe_odirect
from tierstore.rootstore.rank_dir import FileIdentity
from tierstore.rootstore.staging import StagingPool, StagingSlot
from tierstore.store import IOResult, JobTicket

__all__ = ["ALIGN", "WARM_PIECE_BYTES", "IOEngine", "IOResult", "StagingSlot", "probe_odirect"]

logger = logging.getLogger("tierstore.engine")

# A batch of an I/O thread (io_batch_pages) holds at most this many page bytes.
IO_BATCH_BYTES = 16 << 20


def io_batch_for(io_batch_pages: int, page_bytes: int) -> int:
    """Pages one I/O thread takes at once: ``io_batch_pages``, but at most ``IO_BATCH_BYTES``
    of pages, and at least one. A batch saves per-page hand-offs (wake-ups, the GIL), which
    matter for small pages; a thread holding several large ones while others sit idle costs
    more: 16 MiB loads at 16 threads were 0.79-0.82x raw with batches of up to 8 and 0.89-0.93x
    one by one, the I/O threads busy 0.83-0.90 against 0.96-0.97 of the time (stores
    unchanged; docs/measurements/scaling.md). 2 MiB pages keep batches of 8."""
    return max(1, min(io_batch_pages, IO_BATCH_BYTES // max(1, page_bytes)))


class PageFileOps(Protocol):
    """The file operations the engine's Python I/O threads call (``PageFiles``'s, or a wrapper's
    passed as ``IOEngine(file_ops=...)``): each raises or returns as ``PageFiles`` documents."""

    def store(self, key: bytes, slot: StagingSlot, token_count: int,
              sums: tuple[int, ...] | None) -> tuple[bool, int]: ...

    def store_many(self, items: list[tuple[bytes, StagingSlot, int, tuple[int, ...] | None]],
                   ) -> list[tuple[bool, int] | PageError]: ...

    def load(self, key: bytes, slot: StagingSlot, verify: bool) -> tuple[int, tuple[int, ...] | None]: ...

    def load_many(self, items: list[tuple[bytes, StagingSlot, bool]],
                  ) -> list[tuple[int, tuple[int, ...] | None] | PageError]: ...


class EngineFiles(PageFileOps, Protocol):
    """What the engine asks of its files beyond the I/O threads' operations: ``PageFiles``, or
    another medium's stand-in for it (``files_over``)."""

    geometry: FrameGeometry
    direct_loads: bool
    warm_piece_bytes: int

    def contains(self, key: bytes) -> bool: ...

    def remove_damaged(self, key: bytes, source: Any, error: PageError) -> None: ...

    def expectation(self, key: bytes) -> PageExpectation: ...

    def header_len(self, key_len: int) -> int: ...

    def close(self) -> None: ...


def frame_geometry(namespace: Namespace, group_index: int, config: TierStoreConfig, *, rank: int = 0,
                   head_start: int = 0, head_count: int = 0, rank_dir: str | None = None,
                   layout: PageLayout | None = None) -> FrameGeometry:
    """The staging frame of an ``IOEngine`` of these arguments, found without touching its root
    (a ``PageFiles`` opens nothing until its first operation): a shared tier makes its staging
    pool (``staging_pool``) before its root has answered, and hands it to the engine."""
    mapper = FileMapper(config.root, namespace.digest, group_index, rank, rank_dir)
    files = PageFiles(mapper, namespace, group_index, rank, head_start=head_start, head_count=head_count,
                      config=config, codec=Codec.ZSTD if config.codec == "zstd" else Codec.NONE,
                      perms=safefs.PRIVATE, mac=None, odirect=False, direct_loads=False,
                      count=lambda _name: None, layout=layout)
    return files.geometry


def staging_pool(geometry: FrameGeometry, config: TierStoreConfig, staging_slots: int | None = None,
                 pin: bool = False) -> StagingPool:
    """The staging slots of an engine: ``staging_slots``, by default 2 per I/O thread plus 2;
    pinned when asked and CUDA is there."""
    n_slots = staging_slots if staging_slots is not None else 2 * config.io_threads + 2
    if n_slots <= 0:
        raise ConfigError(f"staging_slots must be positive, got {n_slots}")
    return StagingPool(geometry, n_slots, bool(pin and torch.cuda.is_available()))


class IOEngine:
    """Loads and stores pages of one KV-cache group (and rank) under one root."""

    def __init__(self, root: str | os.PathLike[str], namespace: Namespace, group_index: int, *, rank: int = 0,
                 head_start: int = 0, head_count: int = 0, config: TierStoreConfig | None = None,
                 staging_slots: int | None = None, pin: bool = False, deadline_s: float | None = None,
                 tier_name: str = "disk", rank_dir: str | None = None, layout: PageLayout | None = None,
                 file_ops: Callable[[PageFiles], PageFileOps] | None = None,
                 staging: StagingPool | None = None,
                 files_over: Callable[[PageFiles], EngineFiles] | None = None) -> None:
        """``rank_dir``/``layout``: a head slice's directory (``h<start>-<count>``, header rank
        ``start // count``) and layout, from the caller (docs/DESIGN.md §9); by default
        ``r<rank>`` and the namespace group's layout. ``file_ops``: wraps the engine's
        ``PageFiles`` in the file operations its I/O threads call (a test's recorder, stall or
        fault); with it every job runs on the Python I/O threads (the native lane runs the stock
        file operations in compiled code, so it is not started). ``staging``: the pool made
        beforehand (``staging_pool``; ``staging_slots`` and ``pin`` are then its own).
        ``files_over``: the pages live in another medium than files under ``root`` (the object
        tier: ``objstore.object_files.ObjectFiles``), which stores and loads the very bytes a
        ``PageFiles`` of these arguments would write (it is given that ``PageFiles``, which never
        touches ``root``); nothing is made under ``root``, no O_DIRECT, no native lane."""
        self.root = Path(root)
        self.config = config if config is not None else TierStoreConfig(root=str(root))
        if not 0 <= group_index < len(namespace.groups):
            raise ConfigError(f"group index {group_index} is outside the namespace's {len(namespace.groups)} groups")
        self.namespace, self.group_index, self.rank = namespace, group_index, rank
        self.group = namespace.groups[group_index]
        self.layout: PageLayout = layout if layout is not None else self.group.layout
        self.head_start, self.head_count = head_start, head_count
        self.tier_name = tier_name
        self.mapper = FileMapper(self.root, namespace.digest, group_index, rank, rank_dir)
        self.codec = Codec.ZSTD if self.config.codec == "zstd" else Codec.NONE
        self.deadline_s = deadline_s if deadline_s is not None else self.config.deadline_s
        self.perms = safefs.GROUP_SHARED if self.config.shared_group_access else safefs.PRIVATE
        self.mac = PageMac.from_key_file(self.config.mac_key_file) if self.config.mac_key_file else None
        key_file = self.config.encryption_key_file
        self.sealer = KeyRing.from_files(key_file, self.config.tenant_key_files) if key_file else None
        if files_over is None:
            _prepare_root(self.root, namespace, self.mapper, self.config, self.perms)
        self.odirect, self.odirect_reason = _io_mode(self.config, self.codec, self.root, namespace, self.mapper,
                                                     mac=self.mac.name if self.mac is not None else None,
                                                     sealed=self.sealer is not None,
                                                     objects=files_over is not None)
        native.start()  # one GIL release per page once compiled (native/loader.py), off this thread
        advice = io_threads_advice(self.config.io_threads)
        if advice:
            logger.warning(advice)
        self.counters = EngineCounters()
        self._removals_lock = threading.Lock()
        page_files = PageFiles(self.mapper, namespace, group_index, rank, head_start=head_start,
                               head_count=head_count, config=self.config, codec=self.codec, perms=self.perms,
                               mac=self.mac, sealer=self.sealer, odirect=self.odirect,
                               direct_loads=self.odirect and cachestat_available(), count=self.counters.count,
                               layout=self.layout)
        self.files: EngineFiles = files_over(page_files) if files_over is not None else page_files
        self.geometry: FrameGeometry = self.files.geometry
        # what the Python I/O threads call: the files themselves, or what a caller wrapped them in
        self.ops: PageFileOps = file_ops(page_files) if file_ops is not None else self.files
        if files_over is None:
            with contextlib.suppress(PageError, OSError):  # the native lane takes jobs once it is open
                page_files.rank_dir.rank_fd()  # (a missing directory: the first store makes it)
        if staging is not None and staging.geometry != self.geometry:
            raise ValueError(f"the staging pool's frames {staging.geometry} are not this engine's {self.geometry}")
        self._pool = staging if staging is not None else staging_pool(self.geometry, self.config, staging_slots, pin)
        self.pinned = self._pool.pinned
        self._removals: list[threading.Thread] = []  # removals of pages the caller rejected
        lane = None
        if (self.config.io_loop == "native" and native.enabled_by_env() and file_ops is None
                and isinstance(self.files, PageFiles)):
            lane = NativeLane(self.files, self._pool, threads=self.config.io_threads, name=f"tierstore-io-g{group_index}")
        self._queue = JobQueue(policy=QueuePolicy(), queue_depth=self.config.queue_depth, deadline_s=self.deadline_s,
                               threads=self.config.io_threads, name=f"tierstore-io-g{group_index}", run=self._run,
                               finish=self._finish, after_run=self._after_run,
                               where=lambda key: self.mapper.final_path(key), run_batch=self._run_batch,
                               max_batch=io_batch_for(self.config.io_batch_pages, self.layout.nbytes), lane=lane)

    @property
    def direct_loads(self) -> bool:
        """Cold loads are read with O_DIRECT (O_DIRECT works here and the kernel has cachestat)."""
        return self.files.direct_loads

    @direct_loads.setter
    def direct_loads(self, value: bool) -> None:
        self.files.direct_loads = value

    @property
    def warm_piece_bytes(self) -> int:
        """The piece size of a warm load (``own_read.WARM_PIECE_BYTES``)."""
        return self.files.warm_piece_bytes

    @warm_piece_bytes.setter
    def warm_piece_bytes(self, value: int) -> None:
        self.files.warm_piece_bytes = value

    # ----------------------------------------------------------------- PageStore
    def acquire_slot(self, timeout: float | None = 0) -> StagingSlot | None:
        """A free staging slot, or None if none frees up within ``timeout`` (None = forever)."""
        if self._pool.free_count == 0:
            self._queue.harvest()  # stores the native lane finished give their slots back
            if timeout != 0:
                with self._queue.hurried():  # the lane's harvest thread: at once, not after its delay
                    return self._pool.acquire(timeout)
        return self._pool.acquire(timeout)

    def release_slot(self, slot: StagingSlot) -> None:
        self._pool.release(slot)

    @property
    def free_slots(self) -> int:
        return self._pool.free_count

    def submit_store(self, key: bytes, slot: StagingSlot, token_count: int, sums: Sequence[int] | None = None, *,
                     ticket: JobTicket | None = None) -> int:
        """Queue a store of ``slot`` under ``key`` (PageStore.submit_store); the engine releases
        the slot when done. ``sums`` (the caller's, e.g. the GPU's) go into the header unhashed:
        a wrong one is caught by every later read (the page is then reported corrupt and
        removed), never served."""
        if not self._pool.owns(slot):
            raise ValueError("submit_store: the slot does not belong to this engine")
        if sums is not None and len(sums) != len(self.layout.sections):
            raise ValueError(f"submit_store: {len(sums)} checksums for {len(self.layout.sections)} sections")
        key = bytes(key)
        check_key(key)
        ticket = JobTicket.given(ticket)
        self._queue.check_free(ticket.id)
        self._pool.claim(slot, "submit_store")
        sums_t = tuple(int(c) for c in sums) if sums is not None else None
        return self._queue.submit(new_job("store", key, ticket, self._queue.deadline_s, slot=slot,
                                          token_count=token_count, sums=sums_t))

    def submit_load(self, key: bytes, verify: bool = True, *, ticket: JobTicket | None = None) -> int:
        """Queue a load of ``key`` (PageStore.submit_load); it takes a slot of its own at once
        (none free: the job fails with ``queue_full``)."""
        key = bytes(key)
        check_key(key)
        ticket = JobTicket.given(ticket)
        self._queue.check_free(ticket.id)
        slot = self._pool.take(busy=True)
        job = new_job("load", key, ticket, self._queue.deadline_s, slot=slot, verify=verify)
        reject = None if slot is not None else PageQueueFull(
            f"no free staging slot (all {len(self._pool)} in use); release the slots "
            "of finished loads or give the engine more staging_slots", key=key)
        return self._queue.submit(job, reject)

    def poll(self) -> list[IOResult]:
        """Every result finished since the last poll/wait (never blocks)."""
        return self._queue.poll()

    def wait(self, job_ids: Iterable[int], timeout: float | None) -> list[IOResult]:
        """Wait until the given jobs finish (or ``timeout``); not returned again by ``poll``."""
        return self._queue.wait(job_ids, timeout)

    def contains(self, key: bytes) -> bool:
        """Cheap existence check (one stat, or the object index); a hit still has to be verified by a load."""
        return self.files.contains(key)

    def settle(self, result: IOResult, ok: bool, reason: str = "") -> None:
        """The caller's verdict on an unverified load result of this engine (PageStore.settle):
        ``ok`` counts it in ``loads_ok``; not ``ok`` counts a ``checksum`` failure and removes
        the file it came from, unless another file has been published under the name since.
        A verified result, or one settled already, is ignored."""
        if result.tier != self.tier_name:
            raise ValueError(f"settle: result of tier {result.tier!r} given to tier {self.tier_name!r}")
        self._settle(result.job_id, ok, reason)

    def flush(self, timeout: float | None) -> bool:
        """Wait until every submitted store, and every removal of a page ``settle`` rejected, has
        finished (ok, failed or timed out)."""
        end = None if timeout is None else time.monotonic() + timeout
        done = self._queue.flush(timeout)
        with self._removals_lock:
            removals = list(self._removals)
        for t in removals:
            t.join(None if end is None else max(0.0, end - time.monotonic()))
            done = done and not t.is_alive()
        return done

    def close(self, timeout: float | None = None) -> None:
        """Finish queued stores (up to ``timeout``, default flush_timeout_s), cancel the rest."""
        ended = self._queue.close(self.config.flush_timeout_s if timeout is None else timeout)
        if ended and not self._queue.counts()["pending"]:
            # Only then: an I/O thread stuck in a system call (even past its job's deadline, the
            # job already completed) may still open a page through the rank directory's fd, and a
            # closed fd's number is soon another file's.
            self.files.close()

    def __enter__(self) -> IOEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def stats(self) -> dict[str, Any]:
        s = self.counters.snapshot()
        s.update(self._queue.counts())
        s.update(io_mode="odirect" if self.odirect else "buffered", odirect_reason=self.odirect_reason,
                 codec=self.codec.name.lower(), free_slots=self._pool.free_count, staging_slots=len(self._pool),
                 pinned=self.pinned, tier=self.tier_name, io_batch_pages=self._queue.max_batch)
        return s

    def expectation(self, key: bytes) -> PageExpectation:
        """What a page of ``key`` written for this engine must be (``page_read.read_page``)."""
        return self.files.expectation(key)

    # ----------------------------------------------------------------- job hooks (JobQueue)
    def _run(self, job: Job) -> tuple[bool, int]:
        """In an I/O thread: the job's file operation; (stored, bytes)."""
        if job.op == "store":
            return self.ops.store(job.key, job.slot, job.token_count, job.sums)
        job.slot.source = None
        try:
            nbytes, job.sums = self.ops.load(job.key, job.slot, job.verify)
        except PageError as exc:
            if exc.kind in BAD_CONTENT_KINDS:
                self._remove_damaged(job.key, job.slot.source, exc)
            raise
        return False, nbytes

    def _run_batch(self, jobs: list[Job]) -> list[tuple[bool, int] | PageError] | None:
        """In an I/O thread: a batch of jobs of one class (``JobQueue``). Loads are read by
        ``PageFiles.load_many`` and stores written by ``PageFiles.store_many`` (one GIL-free
        call each for the common case)."""
        if jobs[0].op == "store":
            return self.ops.store_many([(job.key, job.slot, job.token_count, job.sums) for job in jobs])
        for job in jobs:
            job.slot.source = None
        got = self.ops.load_many([(job.key, job.slot, job.verify) for job in jobs])
        results: list[tuple[bool, int] | PageError] = []
        for job, r in zip(jobs, got, strict=True):
            if isinstance(r, PageError):
                if r.kind in BAD_CONTENT_KINDS:
                    self._remove_damaged(job.key, job.slot.source, r)
                results.append(r)
            else:
                nbytes, job.sums = r
                results.append((False, nbytes))
        return results

    def _finish(self, job: Job, error: PageError | None, stored: bool, nbytes: int, seconds: float) -> IOResult:
        """Under the queue's lock, once per job: the slot's next owner, the stats (``seconds``:
        the engine's own, from when it accepted the job), the result (the one made for this
        job in any layer: its ``seconds`` from the caller's submit)."""
        ok = error is None
        result_slot = None
        if job.slot is not None and not job.started:
            self._pool.release(job.slot)  # never ran: back to the pool
        elif ok and job.op == "load":
            result_slot = job.slot
            self._pool.hand_over(job.slot)  # now the caller's
        unverified = ok and job.op == "load" and job.sums is not None
        self.counters.finished(job.id, job.op, None if error is None else error.kind, stored, nbytes, seconds,
                               Served(job.key, job.slot.source, nbytes, seconds) if unverified else None)
        return IOResult(job.id, job.op, job.key, ok, error, result_slot, stored, nbytes,
                        seconds + (job.accepted - job.submitted), verified=not unverified,
                        sums=job.sums if unverified else None, tier=self.tier_name, io_seconds=job.io_seconds)

    def _after_run(self, job: Job, accepted: bool, error: PageError | None) -> None:
        """The I/O thread owned the slot: back to the pool unless the caller got it with a page."""
        if job.slot is not None and not (accepted and error is None and job.op == "load"):
            self._pool.release(job.slot)

    def _settle(self, job_id: int, ok: bool, reason: str) -> None:
        served = self.counters.settled(job_id, ok)
        if served is not None and not ok:
            # Off the caller's thread: it is the vLLM worker's step, and an unlink on a hung mount
            # must not stall it. ``flush`` waits for these removals.
            error = PageCorrupt(reason or "rejected by the caller", key=served.key)
            t = threading.Thread(target=self._remove_damaged, args=(served.key, served.source, error),
                                 name="tierstore-remove-damaged", daemon=True)
            with self._removals_lock:
                self._removals = [r for r in self._removals if r.is_alive()] + [t]
            t.start()

    def _remove_damaged(self, key: bytes, source: FileIdentity | None, error: PageError) -> None:
        self.files.remove_damaged(key, source, error)

    def header_len(self, key_len: int) -> int:
        """Header bytes of this engine's pages for a key of ``key_len`` bytes (bench/io.py)."""
        return self.files.header_len(key_len)

    @property
    def slots(self) -> list[StagingSlot]:
        """Every staging slot, free or not (bench/io.py walks them)."""
        return self._pool.slots


_MAC_COSTS_SAID = threading.Event()


def say_mac_costs(algorithm: str) -> None:
    """Say once per process, at the first engine with ``mac_key_file`` and ``io_loop`` native,
    that its page I/O runs on Python I/O threads: the native lane and the GIL-free batch calls
    do not compute MACs, so such an engine never uses them (each page also hashes a tag: keyed
    ``algorithm``). Failure policy: none (a log record)."""
    if _MAC_COSTS_SAID.is_set():
        return
    _MAC_COSTS_SAID.set()
    logger.info("tierstore: mac_key_file is set, so page loads and stores run on Python I/O threads, not the native "
                "lane (which does not compute MACs), and every page also hashes a keyed %s tag; leave "
                '"mac_key_file" unset where the root is written by this fleet only', algorithm)


# ----------------------------------------------------------------- setup (at construction)
def _prepare_root(root: Path, namespace: Namespace, mapper: FileMapper, config: TierStoreConfig,
                  perms: safefs.Perms) -> None:
    """Check that the root is ours to trust (``trust.check_root_trust``: ConfigError naming
    ``trust_shared_root``), make the 256 fan-out directories (ConfigError for a symlinked
    directory on the way: checked before the manifest is written into it), so stores never
    create a directory (see mapper.py; one removed later is made again by
    ``rank_dir.RankDir``), and write the manifest. A read-only root is logged: loads still work."""
    with contextlib.suppress(OSError):  # reported below by the manifest and the fan-out directories
        os.makedirs(root, exist_ok=True)
    if root.is_dir():
        check_root_trust(root, trust_shared_root=config.trust_shared_root)
    try:
        mapper.make_fanout_dirs(perms)
    except OSError as exc:
        logger.warning("cannot create the fan-out directories under %s (%s); loads still work, stores may fail",
                       mapper.base, exc.strerror)
    try:
        write_manifest(root, namespace, perms=perms)
    except OSError as exc:
        logger.warning("cannot write manifest.json under %s (%s); loads still work, stores may fail",
                       namespace_dir(root, namespace), exc.strerror)


def _io_mode(config: TierStoreConfig, codec: Codec, root: Path, namespace: Namespace, mapper: FileMapper, *,
             mac: str | None, sealed: bool, objects: bool) -> tuple[bool, str]:
    """(O_DIRECT stores, why) for an engine: never for objects, sealed or MAC'd pages (``mac``:
    the MAC's algorithm; an unaligned trailer, so ``odirect`` "on" is a ConfigError naming the
    setting), else ``_decide_odirect``'s probe."""
    if objects:
        return False, "not a file root (objects)"
    if sealed:
        if config.odirect == "on":
            raise ConfigError('setting "odirect" is "on" but "encryption_key_file" appends a 44-byte trailer to '
                              'each page, which O_DIRECT cannot write aligned; set "odirect" to "auto" or "off"')
        return False, "encryption_key_file: pages carry an unaligned trailer"
    if mac is not None:
        if config.io_loop == "native":
            say_mac_costs(mac)
        if config.odirect == "on":
            raise ConfigError('setting "odirect" is "on" but "mac_key_file" appends a 40-byte tag to each page, '
                              'which O_DIRECT cannot write aligned; set "odirect" to "auto" or "off"')
        return False, "mac_key_file: pages carry an unaligned MAC trailer"
    return _decide_odirect(config.odirect, codec, root, namespace, mapper)


def _decide_odirect(mode: str, codec: Codec, root: Path, namespace: Namespace, mapper: FileMapper) -> tuple[bool, str]:
    """(use O_DIRECT, why) for the ``odirect`` setting: probed under the group's directory (or
    the nearest one that exists); ``on`` raises ConfigError where it cannot work."""
    if mode == "off":
        return False, 'odirect setting is "off"'
    if codec != Codec.NONE:
        if mode == "on":
            raise ConfigError('setting "odirect" is "on" but codec "zstd" writes unaligned frames; '
                              'set "odirect" to "auto" or "off", or "codec" to "none"')
        return False, "codec zstd: compressed frames are written buffered"
    probe_dir = next((d for d in (mapper.base, namespace_dir(root, namespace)) if d.is_dir()), root)
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
