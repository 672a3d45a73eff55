"""EngineTier: one tier of a ``TierChain`` over one ``IOEngine`` (local disk, shared export).

Contract: a ``PageStore`` (``tierstore/store.py``) whose results carry ``tier=self.name``.
- A job is filed under its ticket's id, and the engine gets the same ticket: the engine's
  result is handed up as it is. A subclass may hold a store back before the engine sees it
  (the local tier's admission) and may complete a job without the engine (``complete_now``:
  the tier is down, no slot is free); the tier makes that result itself.
- The tier counts its own metrics as results pass through it: a verified hit, a miss, a
  failure by kind, stored bytes. Unverified hits are counted by ``settle``.
- Damaged pages have one owner: a load whose failure kind is in ``errors.BAD_CONTENT_KINDS``
  was already removed by the engine that read it; a page the caller found damaged is removed by
  ``settle`` through the engine. The tier itself never unlinks a page file (a second unlink
  could remove a good page another writer published in between); subclasses only forget it
  (``forget``: the local index entry).
- Load failures of kind ``unsafe`` (errors.PageUnsafe: a symlink, FIFO or hard link under the
  page's name, or a symlinked directory on the way) count as a miss of the tier (and as
  ``failures["unsafe"]``); the tier forgets the key and never marks itself down for it. Kind
  ``mac`` (a fleet key is configured and the page's tag does not verify with it) is a miss
  too, and the file stays (``errors.UNVERIFIABLE_KINDS``: not verifiable is not damage).
- A full root (a store failed ENOSPC/EDQUOT: ``fs.deadline.SpaceBackoff``): stores to the tier
  are skipped, one trial store every 5 s, until one goes through or gc frees space under its root, each
  completed at once as ``enospc`` and counted as ``failures["full"]``; loads go on. One
  warning per episode names the root and what to do.
- Hooks for subclasses: ``admit`` (how a store reaches the engine), ``on_load``/``on_store``
  (per-result bookkeeping after the counting here), ``available`` and ``refuse``.

Threading: thread-safe. The tier's condition lock guards its job maps; under it the tier calls
only its engine's non-blocking methods (``submit_*``, ``poll``); ``wait`` blocks on the engine
outside it. Metrics and subclass hooks run outside it. Lock order: tier, then engine.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tierstore.errors import PageError, PageQueueFull, PageStoreError, PageUnsafe
from tierstore.fs.deadline import SpaceBackoff
from tierstore.metrics import TierMetrics
from tierstore.rootstore.engine import IOEngine
from tierstore.rootstore.staging import StagingSlot
from tierstore.store import IOResult, JobTicket, PageStore

# Engine settings a tier's engine takes from the chain's (the rest come from the config): a head
# slice's directory and layout too (every tier of a rank keeps the same slice, DESIGN §9).
ENGINE_KWARGS = ("head_start", "head_count", "staging_slots", "pin", "rank_dir", "layout")

# Load failure kinds that mean "this tier has no page for the key" (a miss, not a fault).
MISS_KINDS: frozenset[str] = frozenset({"missing", PageUnsafe.kind})


def count_result(metrics: TierMetrics, r: IOResult, tokens: int, seconds: float | None = None) -> None:
    """The one rule for counting a page result in a tier's metrics: a verified load is a hit
    (an unverified one is counted at ``settle``), a load failure in ``MISS_KINDS`` a miss (and,
    unless ``missing``, a failure of its kind too; a ``missing`` from ESTALE also a failure
    ``estale``), any other failure a failure; a store that
    wrote a page counts its bytes. ``seconds``: the tier's own time for the job (default the
    result's, which counts from the caller's submit)."""
    kind = r.error.kind if r.error is not None else "error"
    seconds = r.seconds if seconds is None else seconds
    if r.op == "load":
        if r.ok:
            if r.verified:
                metrics.hit(tokens, r.nbytes, seconds, r.io_seconds if r.io_seconds > 0 else None)
        elif kind in MISS_KINDS:
            metrics.miss(tokens)
            if kind != "missing":
                metrics.failure(kind)
            elif r.error is not None and r.error.errno == errno.ESTALE:
                metrics.failure("estale")  # a miss, but a stale NFS handle: worth seeing on a dashboard
        else:
            metrics.failure(kind)
    elif r.ok:
        if r.stored:
            metrics.stored(r.nbytes, seconds)
    else:
        metrics.failure(kind)
_UNVERIFIED_MAX = 4096  # unsettled unverified results remembered per tier (a caller that never settles)


class ChainTier(PageStore, Protocol):
    """What a ``TierChain`` needs of a tier beyond ``PageStore`` (``EngineTier``, ``HostStore``)."""

    name: str  # "host" | "local" | "shared": the ``IOResult.tier`` of its results
    durable: bool  # a store's result may come from it (False: a cache the chain may lose)
    metrics: TierMetrics

    @property
    def available(self) -> bool: ...

    def refuse(self, key: bytes) -> PageError:
        """The error of a job the tier cannot take now (not ``available``); counted."""
        ...

    def store_copy(self, key: bytes, page: memoryview | bytes, token_count: int,
                   sums: Sequence[int] | None = None, *, no_slot: str = "queue_full",
                   ticket: JobTicket | None = None) -> int:
        """Store a copy of ``page`` into the tier's own slot (the caller keeps its buffer)."""
        ...


@dataclass(eq=False)
class TierJob:
    """One job of a tier, from submit until its result is handed out."""

    ticket: JobTicket  # its id is the job's in the tier, its engine and the result
    op: str  # "load" | "store"
    key: bytes
    tokens: int
    accepted: float  # when the tier took it: the tier's metrics count from here
    at_engine: bool = False  # handed to the engine (a store may wait in admission first)
    reservation: int | None = None  # local tier: the LocalIndex reservation of a store

    @property
    def id(self) -> int:
        return self.ticket.id


class EngineTier:
    """A tier over one IOEngine; see the module docstring."""

    durable = True  # its pages survive the process (a store's result may come from it)

    def __init__(self, name: str, engine: IOEngine | None, metrics: TierMetrics, tokens_per_page: int) -> None:
        self.name = name
        self.metrics = metrics
        self.tokens_per_page = tokens_per_page
        self._engine = engine
        self._cond = threading.Condition(threading.Lock())
        self._jobs: dict[int, TierJob] = {}  # job id -> job whose result is not out yet
        # page key -> the engine's unverified result (its job id is what the engine settles by)
        self._unverified: OrderedDict[bytes, IOResult] = OrderedDict()
        self._done: dict[int, IOResult] = {}  # results completed without the engine
        self.space: SpaceBackoff | None = None  # made at the first ENOSPC/EDQUOT (the root is full)

    # ------------------------------------------------------------------ what subclasses change
    def engine(self) -> IOEngine | None:
        """The engine, or None while it cannot be used (the shared one is still opening)."""
        return self._engine

    @property
    def available(self) -> bool:
        """Whether the chain should send jobs here now (False: down, skip it at once)."""
        return self.engine() is not None

    def refuse(self, key: bytes) -> PageError:
        """The error of a job this tier cannot take now (``available`` is False); counted."""
        self.metrics.failure("down")
        return PageQueueFull(f"the {self.name} tier is not available", key=key)

    def admit(self, job: TierJob, slot: StagingSlot, sums: Sequence[int] | None) -> None:
        """Hand a store to the engine (the local tier reserves room first)."""
        self.to_engine(job, slot, sums)

    def on_load(self, result: IOResult) -> None:
        """Bookkeeping of a load result after it was counted."""

    def on_store(self, result: IOResult, job: TierJob) -> None:
        """Bookkeeping of a store result after it was counted."""

    def forget(self, key: bytes) -> None:
        """The page of ``key`` is gone (removed as damaged): drop what the tier knows of it."""

    def wrap_engine(self, wrap: Callable[[IOEngine], Any]) -> Any:
        """Put the engine inside ``wrap`` (``testing.faults.FaultInjectingStore``: failures the
        tier sees and counts as its engine's). Call while no job is in flight; returns it."""
        eng = self._front_engine()
        self._engine = wrapped = wrap(eng)
        return wrapped

    # ------------------------------------------------------------------ engine facade
    def _front_engine(self) -> IOEngine:
        eng = self.engine()
        if eng is None:
            raise RuntimeError(f"the {self.name} tier's engine is not open")
        return eng

    @property
    def layout(self) -> Any:
        return self._front_engine().layout

    @property
    def mapper(self) -> Any:
        return self._front_engine().mapper

    @property
    def pinned(self) -> bool:
        return bool(self._front_engine().pinned)

    @property
    def free_slots(self) -> int:
        eng = self.engine()
        return eng.free_slots if eng is not None else 0

    def acquire_slot(self, timeout: float | None = 0) -> StagingSlot | None:
        eng = self.engine()
        return eng.acquire_slot(timeout) if eng is not None else None

    def release_slot(self, slot: StagingSlot) -> None:
        self._front_engine().release_slot(slot)

    def contains(self, key: bytes) -> bool:
        eng = self.engine()
        return eng is not None and self.available and eng.contains(key)

    # ------------------------------------------------------------------ submit
    def _new_job(self, op: str, key: bytes, tokens: int, ticket: JobTicket | None) -> TierJob:
        with self._cond:
            job = TierJob(JobTicket.given(ticket), op, key, tokens, time.monotonic())
            if job.id in self._jobs:
                raise ValueError(f"job id {job.id} is in use in the {self.name} tier already: a ticket is for one job")
            self._jobs[job.id] = job
            return job

    def submit_load(self, key: bytes, verify: bool = True, *, ticket: JobTicket | None = None) -> int:
        job = self._new_job("load", key, self.tokens_per_page, ticket)
        eng = self.engine() if self.available else None
        if eng is None:
            self.complete_now(job, self.refuse(key), count=False)
            return job.id
        with self._cond:
            job.at_engine = True
            eng.submit_load(key, verify, ticket=job.ticket)
        return job.id

    def submit_store(self, key: bytes, slot: StagingSlot, token_count: int,
                     sums: Sequence[int] | None = None, *, ticket: JobTicket | None = None) -> int:
        job = self._new_job("store", key, token_count, ticket)
        if not self.available:
            self.release_slot(slot)
            self.complete_now(job, self.refuse(key), count=False)
        elif self._full:
            self.release_slot(slot)
            self.complete_now(job, self._skip_full(key), count=False)
        else:
            self.admit(job, slot, sums)
        return job.id

    def store_copy(self, key: bytes, page: memoryview | bytes, token_count: int,
                   sums: Sequence[int] | None = None, *, no_slot: str = "queue_full",
                   ticket: JobTicket | None = None) -> int:
        """Store a copy of ``page`` (the caller keeps its buffer): a write-through or a
        promotion. No free slot right now completes the job with ``queue_full``, counted as
        ``no_slot``."""
        if not self.available or self._full:
            job = self._new_job("store", key, token_count, ticket)
            self.complete_now(job, self.refuse(key) if not self.available else self._skip_full(key), count=False)
            return job.id
        slot = self.acquire_slot(0)
        if slot is None:
            job = self._new_job("store", key, token_count, ticket)
            self.metrics.failure(no_slot)
            self.complete_now(job, PageQueueFull(f"no free staging slot in the {self.name} tier", key=key),
                              count=False)
            return job.id
        slot.view[:] = page
        return self.submit_store(key, slot, token_count, sums, ticket=ticket)

    @property
    def _full(self) -> bool:
        """Stores to this tier are skipped now (its root is full: ``SpaceBackoff``)."""
        return self.space is not None and self.space.skip_store()

    def _skip_full(self, key: bytes) -> PageError:
        """The error of a store skipped while the root is full; counted as ``full``."""
        self.metrics.failure("full")
        code = self.space.errno if self.space is not None else errno.ENOSPC  # EDQUOT: over a quota
        return PageStoreError(f"the {self.name} tier's root is full; store skipped (see the warning in the log)",
                              errno=code, key=key)

    def _note_space(self, r: IOResult) -> None:
        """A store's result in the tier's "full" state (ENOSPC/EDQUOT start or extend it)."""
        if r.ok:
            if self.space is not None:
                self.space.note_stored()
            return
        err = r.error
        if err is None or err.kind != "enospc":
            return
        if self.space is None:
            eng = self.engine()
            if eng is None:
                return
            self.space = SpaceBackoff(self.name, eng.root)
        self.space.note_full(err.message if err.errno is None else os.strerror(err.errno), err.errno)

    def to_engine(self, job: TierJob, slot: StagingSlot, sums: Sequence[int] | None) -> None:
        """Submit a store held back by ``admit`` (any thread)."""
        eng = self._front_engine()
        with self._cond:
            job.at_engine = True
            eng.submit_store(job.key, slot, job.tokens, sums=sums, ticket=job.ticket)
            self._cond.notify_all()

    def complete_now(self, job: TierJob, error: PageError, count: bool = True) -> None:
        """Complete ``job`` with ``error`` without the engine (any thread); ``count=False``:
        the caller counted the failure under its own name."""
        res = IOResult(job.id, job.op, job.key, False, error, None, False, 0,
                       time.monotonic() - job.ticket.submitted, tier=self.name)
        if count:
            self._count(res, job)
        with self._cond:
            self._jobs.pop(job.id, None)
            self._done[job.id] = res
            self._cond.notify_all()

    # ------------------------------------------------------------------ results
    def _take(self, raw: Iterable[IOResult]) -> list[tuple[TierJob, IOResult]]:
        """This tier's jobs of the engine's results, which go up as they are (call with the
        condition held)."""
        out = []
        for r in raw:
            job = self._jobs.get(r.job_id)
            if job is None or not job.at_engine:
                continue
            del self._jobs[r.job_id]
            if r.ok and not r.verified:  # for ``settle``
                self._unverified[bytes(r.key)] = r
                while len(self._unverified) > _UNVERIFIED_MAX:  # a caller that never settles
                    self._unverified.popitem(last=False)
            out.append((job, r))
        return out

    def _count(self, r: IOResult, job: TierJob) -> None:
        count_result(self.metrics, r, job.tokens, time.monotonic() - job.accepted)

    def _finish(self, taken: list[tuple[TierJob, IOResult]]) -> list[IOResult]:
        for job, r in taken:
            self._count(r, job)
            if r.op == "load":
                if not r.ok and r.error is not None and r.error.kind == PageUnsafe.kind:
                    self.forget(r.key)  # never served from here: lookups must not point at it
                self.on_load(r)
            else:
                self._note_space(r)
                self.on_store(r, job)
        return [r for _, r in taken]

    def poll(self) -> list[IOResult]:
        eng = self.engine()
        with self._cond:
            taken = self._take(eng.poll()) if eng is not None else []
            done = list(self._done.values())
            self._done.clear()
        return self._finish(taken) + done

    def finish_completed(self) -> None:
        """Run the hooks (counts, ``on_load``, ``on_store``) of the results the engine has
        completed now and keep the results for the next ``poll``: a subclass whose hooks feed
        its own state (the local tier's index) brings that state up to date before it syncs it."""
        eng = self.engine()
        if eng is None:
            return
        with self._cond:
            taken = self._take(eng.poll())
        done = self._finish(taken)  # the hooks run outside the tier's lock
        with self._cond:
            self._done.update((r.job_id, r) for r in done)

    def wait(self, job_ids: Iterable[int], timeout: float | None) -> list[IOResult]:
        ids = list(job_ids)
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:  # stores in admission get an engine id (or a result) soon
            self._cond.wait_for(lambda: all(self._jobs[i].at_engine for i in ids if i in self._jobs), timeout)
            done = [self._done.pop(i) for i in ids if i in self._done]
            eids = [i for i in ids if (j := self._jobs.get(i)) is not None and j.at_engine]
        eng = self.engine()
        if not eids or eng is None:
            return done
        left = None if end is None else max(end - time.monotonic(), 0.0)
        raw = eng.wait(eids, left)
        with self._cond:
            taken = self._take(raw)
        return done + self._finish(taken)

    def settle(self, result: IOResult, ok: bool, reason: str = "") -> None:
        """The caller's verdict on an unverified page this tier served (``PageStore.settle``)."""
        with self._cond:
            raw = self._unverified.pop(bytes(result.key), None)
        eng = self.engine()
        if raw is not None and eng is not None:  # the engine counts it, and removes a bad file once
            eng.settle(raw, ok, reason or "the caller's checksum check failed")
        if ok:
            self.metrics.hit(self.tokens_per_page, result.nbytes, result.seconds,
                             result.io_seconds if result.io_seconds > 0 else None)
            return
        self.metrics.failure("checksum")
        self.forget(result.key)

    # ------------------------------------------------------------------ lifetime
    def flush(self, timeout: float | None) -> bool:
        eng = self.engine()
        return eng.flush(timeout) if eng is not None and self.available else True

    def close(self, timeout: float | None = None) -> None:
        eng = self.engine()
        if eng is not None:
            eng.close(timeout)

    @property
    def stats(self) -> dict[str, Any]:
        eng = self.engine()
        return eng.stats if eng is not None else {}
