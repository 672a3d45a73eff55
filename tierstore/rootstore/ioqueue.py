"""JobQueue: bounded job queues, the I/O threads that run them, deadlines and results.

Contract:
- A job (``Job``) is submitted once and completes exactly once: by its I/O thread, by its
  deadline (``PageTimeout``, even while its thread is stuck in a system call; the late result
  is then dropped and counted), by ``reject`` (at once, with the caller's error), a full queue
  (``PageQueueFull``) or ``close`` (``PageCancelled``). Completion calls the owner's ``finish``
  hook, whose return value is the job's result for ``poll``/``wait``.
- One queue per job class, ``queue_depth`` each. Which class an idle thread takes is data
  (``QueuePolicy``): the first class of ``order`` with a queued job, except that a class whose
  queued jobs were passed over ``max_bypass`` times in a row is taken first. So loads go before
  stores, but a store is never starved by an endless stream of loads.
- ``run(job)`` (the owner's) does the I/O in the thread; a ``PageError`` it raises is the job's
  failure (its key filled in); any other exception is logged and becomes a ``PageError`` (a bug
  still completes its job). ``after_run(job, accepted, error)`` then runs in the same thread,
  outside the lock (the owner releases the job's resources there).
- Batches (``max_batch`` > 1 and a ``run_batch`` hook): a thread that wakes takes its share of
  the queued jobs of the chosen class, ceil(queued / threads) up to ``max_batch``, by the same
  policy, and hands them to ``run_batch`` in one call (one result or ``PageError`` per job,
  or None: run them one by one with ``run``); their completions go in under one lock. Why: with many I/O threads each GIL hand-off (a
  wake-up, a contended lock, a native call) costs a scheduler wake-up while the GIL sits idle,
  and a batch pays them once for several pages (docs/measurements/scaling.md). A queue no
  deeper than the threads still runs one job per thread.
- A native lane (``lane``, ``lane.NativeLane``): ``submit`` offers each job to it
  first; a job it takes runs on its compiled threads, which never return to Python, and comes
  back through ``harvest`` (called by ``poll`` and by the lane's harvest thread), completed
  here like any other, or, for anything but the common case, queued for the Python threads,
  which redo it and name the error (those threads start at the first such job). Deadlines,
  ``wait``, ``flush`` and ``close`` hold for its jobs as for the others.

Threading: every public method may be called from any thread. One lock guards the queues,
pending jobs and results; ``finish`` runs under it (it must only take leaf locks). Each submit
puts one token in a C-level queue that idle I/O threads block on, not a Condition (whose wait
allocates a lock and runs Python per job): one wakes per job; a thread that takes a batch
takes up to that many tokens with it, under the lock, so fewer threads wake for nothing; a
job completed while queued leaves its token behind, and the thread that takes it finds nothing
and waits again, so there are never fewer tokens than queued jobs; one token per thread at stop;
conditions on the lock wake a ``wait`` call only when its last job is done, and ``flush`` only
when no job of the flushed class is left.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from tierstore.errors import PageCancelled, PageError, PageQueueFull, PageTimeout
from tierstore.native.abi import MAX_BYPASS
from tierstore.store import JobTicket

logger = logging.getLogger("tierstore.engine")
LONGEST_WAIT_S = 3600.0  # one wait on the queue's conditions (_next_wake)
# the settings a job's deadline comes from, named in its timeout
DEADLINE_SETTINGS = "setting deadline_s; shared_deadline_s for a root behind a local tier"


@dataclass(frozen=True)
class QueuePolicy:
    """Which queued job an idle I/O thread takes (see the module docstring)."""

    order: tuple[str, ...] = ("load", "store")  # job classes, most urgent first
    # a class passed over this many times in a row is served next (the native lane's kernels
    # are compiled with the same number: native.abi.MAX_BYPASS)
    max_bypass: int = MAX_BYPASS


class Job:
    """One queued page operation; fields after ``deadline`` belong to the queue."""

    __slots__ = ("id", "op", "key", "slot", "token_count", "sums", "verify", "submitted", "accepted", "deadline",
                 "queued", "started", "done", "io_seconds")

    def __init__(self, job_id: int, op: str, key: bytes, *, slot: Any = None, token_count: int = 0,
                 sums: tuple[int, ...] | None = None, verify: bool = True, submitted: float, accepted: float,
                 deadline: float) -> None:
        self.id = job_id  # the caller's ``JobTicket`` id
        self.op = op
        self.key = key
        self.slot = slot  # the staging slot the job reads from (store) or into (load)
        self.token_count = token_count
        self.sums = sums  # store: the caller's section checksums; load (verify=False): the header's
        self.verify = verify  # load: check the section checksums in the I/O thread
        self.submitted = submitted  # the ticket's: when the caller submitted the job (IOResult.seconds)
        self.accepted = accepted  # when this queue took it (its deadline and its own counters run from here)
        self.deadline = deadline
        self.queued = False  # counted in ClassQueues.waiting
        self.started = False  # a thread owns the job's resources from here until it returns
        self.done = False
        self.io_seconds = 0.0  # time an I/O thread spent on it (IOResult.io_seconds)

    def expired_in_queue(self) -> PageTimeout:
        """The error of a job found past its deadline before any thread started it (the queue's
        Python threads and the native lane both report it so)."""
        return PageTimeout(f"{self.op} waited in the queue past its {self.deadline - self.accepted:.3f} s deadline "
                           f"({DEADLINE_SETTINGS})", key=self.key)


Outcome = tuple["PageError | None", bool, int]  # (error, stored, bytes) of one run job


def new_job(op: str, key: bytes, ticket: JobTicket, deadline_s: float, **fields: Any) -> Job:
    """A job under ``ticket``'s id, its deadline ``deadline_s`` from now (not yet submitted)."""
    now = time.monotonic()
    return Job(ticket.id, op, key, submitted=ticket.submitted, accepted=now, deadline=now + deadline_s, **fields)


class _Waiter:
    """One ``wait`` call: how many of its jobs are still pending, and how to wake it."""

    __slots__ = ("cond", "remaining")

    def __init__(self, lock: threading.Lock) -> None:
        self.cond = threading.Condition(lock)
        self.remaining = 0


class _Watchers:
    """The ``wait`` calls waiting for jobs, by job id; every call with the queue's lock held."""

    def __init__(self) -> None:
        self._by_job: dict[int, list[_Waiter]] = {}

    def add(self, waiter: _Waiter, ids: Iterable[int], pending: dict[int, Job]) -> None:
        for i in ids:
            if i in pending:
                self._by_job.setdefault(i, []).append(waiter)
                waiter.remaining += 1

    def remove(self, waiter: _Waiter, ids: Iterable[int]) -> None:
        for i in ids:
            ws = self._by_job.get(i)
            if ws and waiter in ws:
                ws.remove(waiter)
                if not ws:
                    del self._by_job[i]

    def done(self, job_id: int) -> None:
        """Job ``job_id`` completed: a waiter whose last job it was is woken."""
        for w in self._by_job.pop(job_id, ()):
            w.remaining -= 1
            if w.remaining == 0:
                w.cond.notify()


class Lane(Protocol):
    """Compiled I/O threads that take jobs off the Python threads (``lane.NativeLane``);
    ``offer``, ``harvest``, ``queued`` and ``hurry`` are called with the queue's lock held."""

    def attach(self, on_ready: Callable[[], None]) -> None: ...
    def offer(self, job: Job) -> bool: ...
    def harvest(self) -> list[tuple[Job, Outcome | None, float]]: ...
    def queued(self) -> dict[str, int]: ...
    def hurry(self, by: int) -> None: ...
    def stop(self, timeout: float) -> list[Job]: ...
    def ended(self) -> bool: ...


class _NoLane:
    """The lane of a queue without one: takes nothing, finishes nothing."""

    def attach(self, on_ready: Callable[[], None]) -> None:
        pass

    def offer(self, job: Job) -> bool:
        return False

    def harvest(self) -> list[tuple[Job, Outcome | None, float]]:
        return []

    def queued(self) -> dict[str, int]:
        return {}

    def hurry(self, by: int) -> None:
        pass

    def stop(self, timeout: float) -> list[Job]:
        return []

    def ended(self) -> bool:
        return True


class ClassQueues:
    """The queued jobs of each class, and which one an idle I/O thread takes next (the
    ``QueuePolicy``). Not locked itself: the JobQueue's lock guards every call."""

    def __init__(self, policy: QueuePolicy) -> None:
        self.policy = policy
        self._queues: dict[str, deque[Job]] = {op: deque() for op in policy.order}
        self._bypassed = dict.fromkeys(policy.order, 0)
        self.waiting = dict.fromkeys(policy.order, 0)  # queued, not started, not done

    def push(self, job: Job) -> None:
        job.queued = True
        self.waiting[job.op] += 1
        self._queues[job.op].append(job)

    def forget(self, job: Job) -> None:
        """``job`` completed (or taken): it no longer counts as queued. Its entry stays in its
        deque until a pick skips it (done) or drops it."""
        if job.queued:
            job.queued = False
            self.waiting[job.op] -= 1

    def pick(self, only: str | None = None) -> Job | None:
        """The next job by the policy, no longer counted as queued (None: nothing queued, or,
        with ``only``, the policy's next job is of another class). Done jobs are dropped."""
        while True:
            ready = [op for op in self.policy.order if self._queues[op]]
            if not ready:
                return None
            starved = [op for op in ready if self._bypassed[op] >= self.policy.max_bypass]
            op = starved[0] if starved else ready[0]
            if only is not None and op != only:
                return None
            job = self._queues[op].popleft()
            if job.done:  # expired or cancelled while queued; its resources are already back
                continue
            for other in ready:
                self._bypassed[other] = 0 if other == op else self._bypassed[other] + 1
            self.forget(job)
            return job

    def drain(self) -> Iterator[Job]:
        """Every queued job not yet done, removed (close cancels them)."""
        for q in self._queues.values():
            while q:
                job = q.popleft()
                if not job.done:
                    yield job


Finish = Callable[[Job, "PageError | None", bool, int, float], Any]
RunBatch = Callable[[list[Job]], "list[tuple[bool, int] | PageError] | None"]


class JobQueue:
    """Queues, I/O threads and results of one store; see the module docstring."""

    def __init__(self, *, policy: QueuePolicy, queue_depth: int, deadline_s: float, threads: int, name: str,
                 run: Callable[[Job], tuple[bool, int]], finish: Finish,
                 after_run: Callable[[Job, bool, PageError | None], None], where: Callable[[bytes], str],
                 run_batch: RunBatch | None = None, max_batch: int = 1, lane: Lane | None = None) -> None:
        self.policy = policy
        self.max_batch = max_batch if run_batch is not None else 1
        self.queue_depth = queue_depth
        self.deadline_s = deadline_s
        self._finish, self._after_run, self._where = finish, after_run, where
        self._runner = _Runner(run, run_batch)
        self._lock = threading.Lock()
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()  # tokens (module docstring)
        self._drained = threading.Condition(self._lock)  # no store pending
        self._watch = _Watchers()
        self._classes = ClassQueues(policy)
        self._pending: dict[int, Job] = {}  # not done, in submission order (= deadline order)
        self._pending_ops = dict.fromkeys(policy.order, 0)
        self._results: dict[int, Any] = {}
        self._closed = self._stop = False
        self._pid = os.getpid()  # a forked child's copy refuses work (submit)
        # For benches (``counts``): jobs run, of them the batches of more than one job and their
        # jobs, and the native lane's; the threads' time from taking jobs to completing them.
        self.late_results_dropped = self.jobs_run = self.batches = self.batched_jobs = self.native_loop_jobs = 0
        self.busy_s = 0.0
        self._lane: Lane = lane if lane is not None else _NoLane()
        self._lane.attach(self.harvest)
        self._name, self._thread_count = name, threads
        self._threads: list[threading.Thread] = []
        if lane is None:
            self._start_threads_locked()

    def _start_threads_locked(self) -> None:
        """Start the Python I/O threads, once. With a lane they start at the first job queued
        for them (a job the lane did not take, or one it hands back): most engines with a lane
        never need them, and a hybrid model's worker has one engine per group and tier."""
        if self._threads or self._stop:
            return
        self._threads = [threading.Thread(target=self._thread, name=f"{self._name}-{i}", daemon=True)
                         for i in range(self._thread_count)]
        for t in self._threads:
            t.start()  # waits for the thread to boot, which takes no lock of ours

    # ----------------------------------------------------------------- submit
    def check_free(self, job_id: int) -> None:
        """``ValueError`` when a job under ``job_id`` is in flight or its result not handed out."""
        with self._lock:
            if job_id in self._pending or job_id in self._results:
                raise ValueError(f"job id {job_id} is in use in this engine already: a ticket is for one job")

    def submit(self, job: Job, reject: PageError | None = None) -> int:
        """Queue ``job``, or complete it at once: with ``reject`` if given, else when the queue
        is closed or full. Never blocks; returns the job id."""
        with self._lock:
            self._pending[job.id] = job
            self._pending_ops[job.op] += 1
            if reject is None and self._closed:
                reject = PageCancelled("the engine is closed", key=job.key)
            if reject is None and os.getpid() != self._pid:
                # Its I/O threads (and a native lane's) are the parent's: nothing would run it.
                reject = PageCancelled(f"this engine was created in process {self._pid}, before a fork; create "
                                       "tierstore engines in the process that uses them", key=job.key)
            if reject is None and self._classes.waiting[job.op] >= self.queue_depth:
                reject = PageQueueFull(f"{job.op} queue is full ({self.queue_depth} queued); poll results faster "
                                       'or raise the "queue_depth" setting', key=job.key)
            if reject is not None:
                self._complete_locked(job, reject)
                return job.id
            if self._lane.offer(job):
                job.started = True  # the lane owns its resources until it is harvested
                return job.id
            self._classes.push(job)
            self._start_threads_locked()
        self._wake.put(None)
        return job.id

    # ----------------------------------------------------------------- results
    def poll(self) -> list[Any]:
        """Every result finished since the last poll/wait (never blocks)."""
        with self._lock:
            self._harvest_locked()
            self._expire_locked(time.monotonic())
            out = list(self._results.values())
            self._results.clear()
            return out

    def wait(self, job_ids: Iterable[int], timeout: float | None) -> list[Any]:
        """Wait until the given jobs finish (or ``timeout``); the results of those that did.
        Results returned here are not returned again by ``poll``."""
        ids = list(job_ids)
        end = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._expire_locked(time.monotonic())
            self._harvest_locked()
            waiter = _Waiter(self._lock)
            self._lane.hurry(1)
            self._watch.add(waiter, ids, self._pending)
            try:
                while waiter.remaining > 0:
                    left = self._next_wake(time.monotonic(), end)
                    if left is not None and left <= 0:
                        break
                    waiter.cond.wait(left)
                    self._expire_locked(time.monotonic())
            finally:
                self._lane.hurry(-1)
                self._watch.remove(waiter, ids)
            return [self._results.pop(i) for i in ids if i in self._results]

    def flush(self, timeout: float | None, op: str = "store") -> bool:
        """Wait until no job of class ``op`` is pending (ok, failed or timed out); False if
        ``timeout`` passed first."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._lane.hurry(1)
            try:
                while True:
                    now = time.monotonic()
                    self._harvest_locked()
                    self._expire_locked(now)
                    if self._pending_ops[op] == 0:
                        return True
                    left = self._next_wake(now, end)
                    if left is not None and left <= 0:
                        return False
                    self._drained.wait(left)
            finally:
                self._lane.hurry(-1)

    def close(self, timeout: float, drain_op: str = "store") -> bool:
        """Cancel later submits, let queued ``drain_op`` jobs finish (up to ``timeout``), cancel
        the rest, stop the threads. True when every I/O thread (Python and lane) has returned:
        until then one may still use the owner's directory fds and a job's slot. Idempotent."""
        end = time.monotonic() + timeout
        with self._lock:
            if self._closed:
                return self._threads_ended()
            self._closed = True
        if not self.flush(timeout, drain_op):
            logger.warning("closing with %ss still queued after %.1f s; they are cancelled", drain_op, timeout)
        with self._lock:
            for job in list(self._classes.drain()):
                self._complete_locked(job, PageCancelled("the engine was closed before this job ran", key=job.key))
            self._stop = True
        left = self._lane.stop(max(end - time.monotonic(), 0.05))
        with self._lock:
            self._harvest_locked()
            for job in left:
                error = PageCancelled("the engine was closed before this job ran", key=job.key)
                self._after_run(job, self._complete_locked(job, error), error)
        for _ in self._threads:
            self._wake.put(None)
        for t in self._threads:
            t.join(max(end - time.monotonic(), 0.05))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            logger.warning("I/O threads still blocked in a system call at close: %s", stuck)
        return self._threads_ended()

    def _threads_ended(self) -> bool:
        return not any(t.is_alive() for t in self._threads) and self._lane.ended()

    def counts(self) -> dict[str, int | float]:
        """A snapshot: ``queued_<op>s`` per class, ``pending``, ``late_results_dropped``,
        ``jobs_run`` and, of those, ``jobs_in_batches`` and ``jobs_native_loop`` (the lane's); ``io_busy_s``: the I/O threads' time
        spent running jobs, summed over threads."""
        with self._lock:
            lane = self._lane.queued()
            out = {f"queued_{op}s": n + lane.get(op, 0) for op, n in self._classes.waiting.items()}
            out.update(pending=len(self._pending), late_results_dropped=self.late_results_dropped,
                       jobs_run=self.jobs_run, jobs_in_batches=self.batched_jobs,
                       jobs_native_loop=self.native_loop_jobs, io_busy_s=self.busy_s)
            return out

    def harvest(self) -> None:
        """Complete the lane's finished jobs (its harvest thread calls this)."""
        with self._lock:
            self._harvest_locked()

    @contextlib.contextmanager
    def hurried(self) -> Iterator[None]:
        """While the caller blocks on what a result frees (a staging slot): the lane's jobs
        are harvested as soon as they finish."""
        with self._lock:
            self._lane.hurry(1)
        try:
            yield
        finally:
            with self._lock:
                self._lane.hurry(-1)

    # ----------------------------------------------------------------- internals
    def _harvest_locked(self) -> None:
        """The lane's finished jobs: completed, or queued for the Python threads to redo."""
        for job, outcome, seconds in self._lane.harvest():
            self.busy_s += seconds
            if outcome is None and not job.done and not self._stop:
                job.started = False  # queued again: nobody owns its resources until taken
                self._classes.push(job)
                self._start_threads_locked()
                self._wake.put(None)
                continue
            if outcome is None:
                outcome = (PageCancelled("the engine was closed before this job ran", key=job.key), False, 0)
            self.jobs_run += 1
            self.native_loop_jobs += 1
            job.io_seconds = seconds
            accepted = self._complete_locked(job, *outcome)
            self._after_run(job, accepted, outcome[0])

    def _next_wake(self, now: float, end: float | None) -> float | None:
        """Seconds until the caller's end or the earliest pending deadline, whichever is first."""
        first = next(iter(self._pending.values()), None)
        wake = end
        if first is not None:
            wake = first.deadline if wake is None else min(wake, first.deadline)
        if wake is None:
            return None
        # At most LONGEST_WAIT_S: a Condition refuses a timeout past threading.TIMEOUT_MAX, which a
        # huge deadline_s reaches (the caller loops and waits again).
        return min(max(wake - now, 0.0) + (0.001 if wake != end else 0.0), LONGEST_WAIT_S)

    def _expire_locked(self, now: float) -> None:
        expired = []
        for job in self._pending.values():  # one deadline length: insertion order is deadline order
            if job.deadline > now:
                break
            expired.append(job)
        for job in expired:
            self._complete_locked(job, PageTimeout(
                f"{job.op} did not finish within {self.deadline_s:.3f} s "
                f"({DEADLINE_SETTINGS}); the file system may be stalled", path=self._where(job.key), key=job.key))

    def _complete_locked(self, job: Job, error: PageError | None, stored: bool = False, nbytes: int = 0) -> bool:
        """Complete ``job`` once; False if it was already completed (a late result, dropped)."""
        if job.done:
            self.late_results_dropped += 1
            return False
        job.done = True
        del self._pending[job.id]
        self._classes.forget(job)
        self._pending_ops[job.op] -= 1
        if self._pending_ops[job.op] == 0:
            self._drained.notify_all()
        self._watch.done(job.id)
        self._results[job.id] = self._finish(job, error, stored, nbytes, time.monotonic() - job.accepted)
        return True

    def _take_locked(self) -> list[Job]:
        """The jobs a woken thread runs: the policy's next one and, with batches, more of its
        class up to ceil(queued / threads) and ``max_batch``. Jobs past their deadline are
        completed (timeout) instead; the rest are marked started (the thread owns them)."""
        jobs: list[Job] = []
        want = 1
        now = time.monotonic()
        while len(jobs) < want:
            job = self._classes.pick(jobs[0].op if jobs else None)
            if job is None:
                break
            if not jobs and self.max_batch > 1:
                share = -(-(self._classes.waiting[job.op] + 1) // len(self._threads))  # queued before this pick
                want = max(1, min(self.max_batch, share))
            if now >= job.deadline:
                self._complete_locked(job, job.expired_in_queue())
                continue
            job.started = True
            jobs.append(job)
        # The tokens of the extra jobs: fewer threads wake to find nothing. Taken under the lock
        # and only while not stopping, so a stop token (put after _stop is set) is never taken.
        for _ in range(len(jobs) - 1):
            try:
                self._wake.get_nowait()
            except queue.Empty:
                break
        return jobs

    def _thread(self) -> None:
        while True:
            self._wake.get()
            with self._lock:
                if self._stop:
                    return
                jobs = self._take_locked()
            if not jobs:
                continue  # the token of a job completed while queued
            started = time.perf_counter()
            outcomes = self._runner.batch(jobs) if len(jobs) > 1 else [self._runner.one(jobs[0])]
            for job in jobs:  # its share of the thread's time (IOResult.io_seconds)
                job.io_seconds = (time.perf_counter() - started) / len(jobs)
            with self._lock:
                accepted = [self._complete_locked(job, *outcome) for job, outcome in zip(jobs, outcomes, strict=True)]
                self.busy_s += time.perf_counter() - started
                self.jobs_run += len(jobs)
                if len(jobs) > 1:
                    self.batches += 1
                    self.batched_jobs += len(jobs)
            for job, ok, outcome in zip(jobs, accepted, outcomes, strict=True):
                self._after_run(job, ok, outcome[0])


class _Runner:
    """Runs jobs through the owner's ``run`` / ``run_batch`` hooks on an I/O thread; every
    exception becomes the job's ``PageError`` (a bug still completes its job)."""

    def __init__(self, run: Callable[[Job], tuple[bool, int]], run_batch: RunBatch | None) -> None:
        self._run, self._run_batch = run, run_batch

    def batch(self, jobs: list[Job]) -> list[Outcome]:
        """``run_batch`` on ``jobs``: one outcome per job, as ``one`` makes them (each job
        through ``one`` when the hook declines the batch)."""
        assert self._run_batch is not None
        try:
            results = self._run_batch(jobs)
            if results is None:
                return [self.one(job) for job in jobs]
            if len(results) != len(jobs):
                raise RuntimeError(f"run_batch returned {len(results)} results for {len(jobs)} jobs")
        except Exception as exc:  # a bug must still come back as a per-key failure
            logger.exception("unexpected error in a batch of %d %ss", len(jobs), jobs[0].op)
            return [(PageError(f"internal error: {exc!r}", key=job.key), False, 0) for job in jobs]
        outcomes: list[Outcome] = []
        for job, got in zip(jobs, results, strict=True):
            if isinstance(got, PageError):
                if got.key is None:
                    got.key = job.key
                outcomes.append((got, False, 0))
            else:
                outcomes.append((None, got[0], got[1]))
        return outcomes

    def one(self, job: Job) -> Outcome:
        try:
            stored, nbytes = self._run(job)
            return None, stored, nbytes
        except PageError as exc:
            if exc.key is None:  # readers deep in format.py do not know the key
                exc.key = job.key
            return exc, False, 0
        except Exception as exc:  # a bug must still come back as a per-key failure
            logger.exception("unexpected error in %s of key %s", job.op, job.key.hex()[:16])
            return PageError(f"internal error: {exc!r}", key=job.key), False, 0
