"""NativeLane: an engine's page I/O on threads that never return to Python.

Why: every return of an I/O thread to Python is a request for the GIL. Beside a busy Python
thread (vLLM's worker, or the GPU pipeline's driver, busy 85-93% of a transfer) such a request
waits for the holder, and with one return per page the engine's stores lost 41% of their
speed (docs/measurements/scaling.md). Here the I/O threads run a compiled loop
(``native.lane_kernels.lane_serve``, numba ``nogil``) that takes jobs from shared rings, runs
``store_page`` / ``load_page`` on them and marks them done: they never hold the GIL, from the
engine's start to its close.

Contract:
- ``offer(job)`` (under the job queue's lock) puts a job into the lane when it is the common
  case the native kernels serve (codec none, no MAC, private file modes, the key length of the
  lane, a slot of the engine's staging slab, the warm read plan the lane was built with, the
  rank directory already open) and
  returns True; otherwise False and the job takes the Python I/O threads
  (``ioqueue.JobQueue``) as before. It never calls the file system (the lock is held, and
  the mount may hang): the engine's first jobs go to the Python threads, which open the rank
  directory.
- ``harvest()`` (under the job queue's lock) returns every finished entry as (job, outcome,
  seconds): outcome (None, stored, bytes) for a store stored or found existing and for a good
  load (its slot holds the page, ``job.sums`` the header's sums when unverified); (PageTimeout,
  False, 0) for a job its thread found past its deadline (not started); None for anything else
  (a missing directory, a failed write, a missing, cold, damaged or foreign file): the queue
  runs that job again on the Python path, which redoes it and names the error. So the lane
  never decides a failure itself, and the bytes and checks are the native kernels' (the same as
  ``PageFiles``' native calls, ``page_files_native.NativeFileCalls``, whose page shapes, frame
  arrays and result readings the lane uses: ``tests/native/test_native.py``).
- Stores publish create-only (``publish.py``): the root's ``PageFiles.create_only`` choice
  goes into each store entry's scratch row (``PUBLISH_LINK``), and a refusal of renameat2's
  flag met in the kernel comes back from it at the harvest; a store that loses the race for the
  name is handed back (STORE_EXISTS) and answered ``stored=False`` by the Python path.
- Loads go before stores, a store after at most ``MAX_BYPASS`` loads taken past it
  (``ioqueue.QueuePolicy``'s rule).
- ``stop(timeout)`` stops the threads (each finishes the page it is on) and returns the jobs
  never started, for the queue to cancel; ``ended()`` says whether every thread has returned
  (until then the engine keeps its directory fds open and the jobs' slots stay taken).
- A forked child's copy of a started lane is stopped (at-fork handler): its threads are the
  parent's.

Threading: the lane's arrays are shared. Entries (one per staging slot: a job holds a slot, so
the lane never fills) go FREE -> READY (``offer``, the queue's lock held) -> RUNNING (a CAS by
the thread that claimed its ring position) -> DONE (that thread) -> FREE (``harvest``, the lock
held), or READY -> FREE (``stop``'s CAS, for entries no thread marked RUNNING). A thread reads
its ring cell before the CAS that claims it (``native.lane_kernels.claim`` says why that order is
the safe one). Every shared transition is a sequentially consistent atomic. Idle lane threads sleep on a futex word the publisher bumps. One harvest thread waits,
also without the GIL (``lane_await``), until some entry has stayed done and unharvested for
``harvest_delay_s``; only then does it take the GIL and the queue's lock (``on_ready``): a
caller that polls often (the GPU pipeline's driver) harvests first, and that thread never
asks for the GIL.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tierstore.fs.mapper import fanout
from tierstore.native import loader as native
from tierstore.native import page_calls as native_page
from tierstore.native.abi import (
    CTL_LEN,
    DEADLINE_NS_MAX,
    ENTRY_DONE,
    ENTRY_FREE,
    ENTRY_READY,
    F_ARG,
    F_CODE,
    F_DEADLINE,
    F_DIRECT_LEN,
    F_FLAG,
    F_GEN,
    F_OFF,
    F_OP,
    F_RANK_FD,
    F_T0,
    F_T1,
    FAULT_FIELDS,
    FAULT_POINTS,
    FIELDS,
    LANE_EXPIRED,
    OP_LOAD,
    OP_STORE,
    PUBLISH_LINK,
    SCRATCH_LEN,
)
from tierstore.rootstore.page_io import NATIVE_OPEN_FLAGS

if TYPE_CHECKING:
    from tierstore.rootstore.ioqueue import Job
    from tierstore.rootstore.page_files import PageFiles
    from tierstore.rootstore.staging import StagingPool

logger = logging.getLogger("tierstore.engine")

_IDLE_WAIT_S = 0.5  # a sleeping thread looks at the stop flag at least this often (stop also wakes it)
HARVEST_DELAY_S = 0.001  # how long a finished entry may wait for a caller's poll

Outcome = tuple[Any, bool, int]  # (error or None, stored, bytes), as ioqueue's
_RUNNING: weakref.WeakSet[NativeLane] = weakref.WeakSet()  # started and not stopped


@atexit.register
def _stop_at_exit() -> None:
    # A lane thread holds no GIL, so interpreter shutdown would not pause it: it could still be
    # writing into arrays the shutdown frees. Stop every lane (each finishes its page) first.
    for lane in list(_RUNNING):
        lane.stop(1.0)


def _forget_lanes_in_child() -> None:
    # A forked child has none of the parent's lane threads, and its copy of a lane would take
    # jobs nobody runs (each timing out, its slot never given back). Such a lane is stopped in
    # the child; the engine refuses work there too (ioqueue.JobQueue.submit names the fork).
    for lane in list(_RUNNING):
        lane.stopped = lane.forked = True
    _RUNNING.clear()


os.register_at_fork(after_in_child=_forget_lanes_in_child)


def deadline_ns(deadline: float) -> int:
    """A job's deadline (time.monotonic() seconds) as the lane records it: ns, at most
    DEADLINE_NS_MAX (an infinite or huge ``deadline_s`` never overflows int64)."""
    ns = deadline * 1e9
    return int(ns) if ns < DEADLINE_NS_MAX else DEADLINE_NS_MAX  # NaN: the latest too


def _timespec(np: Any, seconds: float) -> Any:
    s = int(seconds)
    arr = np.array([s, int((seconds - s) * 1e9)], dtype=np.int64)
    arr.setflags(write=False)
    return arr


class NativeLane:
    """The compiled I/O threads of one engine; see the module docstring. Started at the first
    job it can take (the kernels compile in the background and the key length is the first
    job's)."""

    def __init__(self, files: PageFiles, pool: StagingPool, *, threads: int, name: str,
                 harvest_delay_s: float = HARVEST_DELAY_S) -> None:
        self.files, self.pool = files, pool
        self.calls = files.native  # the native file calls whose shapes, arrays and results the lane shares
        self.threads, self.name = threads, name
        self.harvest_delay_s = harvest_delay_s
        self._on_ready: Callable[[], None] | None = None
        self.started = False
        self.stopped = False
        self.forked = False  # this is a forked child's copy (stopped; its threads are the parent's)
        self.key_len = -1
        self._threads: list[threading.Thread] = []
        self._hurried = 0  # wait/flush calls in progress: harvest at once

    def attach(self, on_ready: Callable[[], None]) -> None:
        """The queue's harvest (it takes the queue's lock), called from the harvest thread."""
        self._on_ready = on_ready

    # ----------------------------------------------------------------- start (first job)
    def _start(self, key_len: int) -> bool:
        """Build the arrays and start the threads for keys of ``key_len`` bytes; False when the
        native store does not apply to this engine (yet: the kernels may still compile)."""
        kernels = native.lane_kernels()
        plan = self.calls.store_plan(key_len) if kernels is not None else None
        if plan is None or self.files.python_only or self._on_ready is None:
            return False
        np = native.numpy()
        files, cap = self.files, len(self.pool)
        shape, (dir_flags, store_flags), file_off, length = plan
        load_shapes = {True: self.calls.shape(key_len, True), False: self.calls.shape(key_len, False)}
        slab = self.calls.frame_in_slab(self.pool.slots[0])[0]
        sample = b"\0" * key_len
        final = files.mapper.final_path(sample)
        fan, name = fanout(sample), os.path.basename(final)
        tmp = os.path.basename(files.mapper.temp_path(sample, final))
        self._s_tmp_at = len(fan) + 1
        self._s_final_at = self._s_tmp_at + len(tmp) + 1
        s_key_at = self._s_final_at + len(name) + 1
        self._l_key_at = len(fan) + len(name) + 2
        sections = shape.sections
        self.ctl = np.zeros(CTL_LEN, dtype=np.int64)
        self.words = np.zeros(2, dtype=np.int32)
        self.states = np.zeros(cap, dtype=np.int64)
        self.ring = np.zeros(2 * cap, dtype=np.int64)  # queue q's cells: q * cap .. q * cap + cap - 1
        self.desc = np.zeros((cap, FIELDS), dtype=np.int64)
        self.snames = np.zeros((cap, s_key_at + key_len), dtype=np.uint8)
        self.lnames = np.zeros((cap, self._l_key_at + key_len), dtype=np.uint8)
        self.given = np.zeros((cap, sections), dtype=np.uint64)
        self.sums = np.zeros((cap, sections), dtype=np.uint64)
        self.header_sums = np.zeros((cap, sections), dtype=np.uint64)
        self.scratch = np.zeros((cap, SCRATCH_LEN), dtype=np.int64)
        # Pauses at native.abi.FAULT_* points, read only by a fault build's kernels (tests).
        self.faults = np.zeros(FAULT_POINTS * FAULT_FIELDS, dtype=np.int64)
        self._won = np.zeros(cap, dtype=np.int64)
        self._seen = np.zeros(2 * cap, dtype=np.int64)
        self._jobs: list[Job | None] = [None] * cap
        self._free = list(range(cap))
        self._gen = 0
        self._slab = slab
        self._file_off = file_off
        self._load_shapes = load_shapes
        self._desc_items = memoryview(self.desc).cast("B").cast("q")
        self._snames_bytes = memoryview(self.snames).cast("B")
        self._lnames_bytes = memoryview(self.lnames).cast("B")
        self.piece_bytes = files.warm_piece_bytes
        self._serve, self._publish, self._await, self._stop, self._cancel = kernels
        idle = _timespec(np, _IDLE_WAIT_S)
        self._serve_args = (
            self.ctl, self.words, self.states, self.ring, self.desc, self.snames, self.lnames, slab,
            self._s_tmp_at, self._s_final_at, s_key_at, len(fan) + 1, self._l_key_at, dir_flags, store_flags,
            NATIVE_OPEN_FLAGS[1], files.perms.file_mode, length,
            shape.size, int(files.fsync), shape.store_piece, shape.spans, shape.gaps, shape.blank, shape.const_ranges,
            shape.sum_offsets, shape.key_off, shape.token_off, shape.sum_off, load_shapes[True].plan,
            load_shapes[False].plan, load_shapes[False].load_spans, self.given, self.sums, self.header_sums,
            self.scratch, np.zeros(0, dtype=np.uint64), idle, self.faults)
        self._delay = np.array([0, int(self.harvest_delay_s * 1e9)], dtype=np.int64)
        self._set_delay()
        self._await_args = (self.ctl, self.words, self.states, self.desc, self._seen, self._delay, idle)
        self.key_len = key_len
        self._threads = [threading.Thread(target=self._serve_thread, name=f"{self.name}-n{i}", daemon=True)
                         for i in range(self.threads)]
        self._threads.append(threading.Thread(target=self._harvest_thread, name=f"{self.name}-harvest", daemon=True))
        self.started = True
        _RUNNING.add(self)
        for th in self._threads:
            th.start()
        return True

    def hurry(self, by: int) -> None:
        """A caller starts (+1) or stops (-1) blocking on results (``JobQueue.wait``/``flush``):
        while any does, the harvest thread harvests as soon as an entry is done."""
        self._hurried += by
        if self.started:
            self._set_delay()

    def _set_delay(self) -> None:
        self._delay[1] = 0 if self._hurried > 0 else int(self.harvest_delay_s * 1e9)

    def _serve_thread(self) -> None:
        clock = native.numpy().zeros(4, dtype=native.numpy().int64)  # this thread's timespecs (clock, pause)
        self._serve(*self._serve_args, clock)

    def _harvest_thread(self) -> None:
        while self._await(*self._await_args):
            assert self._on_ready is not None
            try:
                self._on_ready()
            except Exception:  # never lose the thread: the next poll harvests
                logger.exception("tierstore: harvesting the native I/O lane failed")

    # ----------------------------------------------------------------- offer (queue lock held)
    def offer(self, job: Job) -> bool:
        """Take ``job`` into the lane (module docstring); False: the Python I/O threads run it."""
        if self.stopped:
            return False
        if not self.started and not self._start(len(job.key)):
            return False
        if len(job.key) != self.key_len or not self._free or job.slot is None:
            return False
        files = self.files
        slab, off = self.calls.frame_in_slab(job.slot)
        if slab is not self._slab:
            return False
        rank_fd = self.calls.held_rank_fd()
        if rank_fd < 0:  # not opened yet: the Python threads open it (the lock is held here)
            return False
        key = job.key
        final = files.mapper.final_path(key)
        name = os.path.basename(final)
        fan = fanout(key)
        # Every value that can fail to convert is converted before anything is written: the
        # entry is taken (popped from the free list) only once nothing can raise.
        deadline = deadline_ns(job.deadline)
        if job.op == "store":
            op, arg, flag, direct_len = OP_STORE, int(job.token_count), int(job.sums is not None), 0
            names = f"{fan}\0{os.path.basename(files.mapper.temp_path(key, final))}\0{name}\0".encode() + key
            if len(names) != self.snames.shape[1]:
                return False
            q = 1
        else:
            if files.warm_piece_bytes != self.piece_bytes:
                return False
            op, arg, flag = OP_LOAD, int(bool(job.verify)), int(files.direct_loads)
            direct_len = self.calls.direct_len(self._load_shapes[job.verify])
            names = f"{fan}\0{name}\0".encode() + key
            q = 0
        e = self._free[-1]
        if op == OP_STORE:
            width = self.snames.shape[1]
            self._snames_bytes[e * width:(e + 1) * width] = names
            if job.sums is not None:
                self.given[e] = job.sums
            if files.create_only.use_link:  # the root refuses renameat2's flag: the entry's row keeps it
                self.scratch[e, PUBLISH_LINK] = 1
        else:
            width = self.lnames.shape[1]
            self._lnames_bytes[e * width:(e + 1) * width] = names
            job.slot.source = None
        # Fields go in through a flat memoryview of the array: a third of the time of numpy's
        # per-item assignment, and offer runs on the submitting thread per page.
        at = e * FIELDS
        desc = self._desc_items
        self._gen += 1
        desc[at + F_OP], desc[at + F_ARG], desc[at + F_FLAG], desc[at + F_DIRECT_LEN] = op, arg, flag, direct_len
        desc[at + F_OFF], desc[at + F_RANK_FD], desc[at + F_GEN] = off + self._file_off, rank_fd, self._gen
        desc[at + F_DEADLINE] = deadline
        desc[at + F_CODE] = desc[at + F_T0] = desc[at + F_T1] = 0
        self._free.pop()
        self._jobs[e] = job
        self._publish(self.ctl, self.words, self.states, self.ring, q, e)
        return True

    # ----------------------------------------------------------------- harvest (queue lock held)
    def harvest(self) -> list[tuple[Job, Outcome | None, float]]:
        """Every finished entry: (job, outcome or None (redo on the Python path), seconds its
        thread spent on it); the entries are free again. Nothing in a forked child's copy."""
        if not self.started or self.forked:
            return []
        np = native.numpy()
        out = []
        for e in np.flatnonzero(self.states == ENTRY_DONE).tolist():
            job = self._jobs[e]
            assert job is not None
            row = self.desc[e]
            outcome = self._outcome(job, e, int(row[F_CODE]))
            seconds = max(0, int(row[F_T1]) - int(row[F_T0])) / 1e9
            self._jobs[e] = None
            self.states[e] = ENTRY_FREE
            self._free.append(e)
            out.append((job, outcome, seconds))
        return out

    def _outcome(self, job: Job, e: int, code: int) -> Outcome | None:
        calls = self.calls
        if code == LANE_EXPIRED:
            return job.expired_in_queue(), False, 0
        if job.op == "store":
            if self.scratch[e, PUBLISH_LINK] and not self.files.create_only.use_link:
                self.files.create_only.fall_back("seen by the native lane")
            done = calls.stored(job.key, code)
            if done is None:
                return None
            return None, done[0], done[1]
        shape = self._load_shapes[job.verify]
        got = native_page.load_outcome(shape, code, self.scratch[e], self.sums[e], self.header_sums[e])
        if got[0] != 0:
            return None  # damaged, missing, cold or foreign: the Python path names it
        done = calls.load_result(job.key, job.slot, self.files.mapper.final_path(job.key), job.verify, got)
        if done is None:
            return None
        job.sums = done[1]
        return None, False, done[0]

    def queued(self) -> dict[str, int]:
        """Jobs offered and not yet taken by a lane thread, per class."""
        if not self.started:
            return {"load": 0, "store": 0}
        ready = (self.states == ENTRY_READY)
        stores = int((ready & (self.desc[:, F_OP] == OP_STORE)).sum())
        return {"load": int(ready.sum()) - stores, "store": stores}

    # ----------------------------------------------------------------- stop
    def stop(self, timeout: float) -> list[Job]:
        """Stop the threads (up to ``timeout`` for those in a system call); the jobs no thread
        took (their entries freed: the caller cancels them). An entry is withdrawn only if no
        thread has marked it running (``lane_cancel``'s CAS against the thread's): a thread
        stalled between its claim and that mark then skips it. Idempotent."""
        if self.stopped:
            return []
        self.stopped = True
        _RUNNING.discard(self)
        if not self.started:
            return []
        self._stop(self.ctl, self.words)
        end = time.monotonic() + timeout
        for th in self._threads:
            th.join(max(end - time.monotonic(), 0.01))
        stuck = [th.name for th in self._threads if th.is_alive()]
        if stuck:
            logger.warning("native I/O threads still blocked in a system call at close: %s", stuck)
        left = []
        for e in self._won[:self._cancel(self.states, self._won)].tolist():
            job = self._jobs[e]
            self._jobs[e] = None
            self._free.append(e)
            if job is not None:
                left.append(job)
        return left

    def ended(self) -> bool:
        """No thread of this lane can touch a job's slot or directory any more (never started,
        or stopped with every thread joined; a forked child's copy has none of its own)."""
        return not self.started or self.forked or (self.stopped and not any(th.is_alive() for th in self._threads))
