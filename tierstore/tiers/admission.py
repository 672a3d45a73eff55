"""LocalAdmission: the local tier's capacity policy, run before a store reaches its engine.

Contract: ``submit(job, slot, sums)`` queues a store; one admission thread per tier reserves
the page's size in the ``LocalIndex`` (evicting least-recently-used pages first, so the local
root never exceeds ``local_max_bytes`` by more than one page), then hands the store to the
engine (``EngineTier.to_engine``) with the reservation on the job, which the tier commits or
releases when the store completes. A page already on disk needs no room. A page that cannot
fit (larger than the cap, or the index failed) completes with a ``PageError`` and its slot is
released. ``sync(timeout)`` waits until every queued store was admitted or refused.

Why a thread: reserving runs sqlite and a stat, which release the GIL; in the caller's thread
each could wait a whole switch interval behind busy I/O workers.

Threading: ``submit`` and ``sync`` from any thread. The admission thread takes the admission
condition's lock, then (without it) the index's lock and the tier's; it never takes a chain's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from tierstore.errors import PageCancelled, PageError
from tierstore.index.local_index import LocalIndex
from tierstore.rootstore.staging import StagingSlot
from tierstore.tiers.tier import TierJob


class AdmittingTier(Protocol):
    """What admission calls of its tier (``local.LocalTier``, which owns it)."""

    mapper: Any  # the tier's FileMapper
    metrics: Any  # the tier's TierMetrics

    def index_failed(self, op: str, exc: sqlite3.Error) -> None: ...
    def to_engine(self, job: TierJob, slot: StagingSlot, sums: Sequence[int] | None) -> None: ...
    def release_slot(self, slot: StagingSlot) -> None: ...
    def complete_now(self, job: TierJob, error: PageError, count: bool = True) -> None: ...

log = logging.getLogger(__name__)


class LocalAdmission:
    """Reserves local room for each store in one background thread; see the module docstring."""

    def __init__(self, tier: AdmittingTier, index: LocalIndex, size_of: Callable[[bytes], int]) -> None:
        self._tier = tier
        self._index = index
        self._size_of = size_of
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[tuple[TierJob, StagingSlot, Sequence[int] | None]] = deque()
        self._queued = self._done = 0
        self._stop = False
        self._thread: threading.Thread | None = None

    def submit(self, job: TierJob, slot: StagingSlot, sums: Sequence[int] | None) -> None:
        with self._cond:
            stopped = self._stop
            if not stopped:
                self._queue.append((job, slot, sums))
                self._queued += 1
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name="tierstore-local-admit", daemon=True)
                    self._thread.start()
                self._cond.notify_all()
        if stopped:  # a store after close: the engine would cancel it too
            self._refuse(job, slot, PageCancelled("the local tier was closed before this store ran", key=job.key))

    def sync(self, timeout: float | None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._done >= self._queued, timeout)

    def close(self, timeout: float | None) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stop)
                if not self._queue:
                    return
                job, slot, sums = self._queue.popleft()
            try:
                self._admit(job, slot, sums)
            except Exception:  # never lose a slot or a job to a bug
                log.exception("tierstore local admission of %s failed", job.key.hex()[:16])
                self._refuse(job, slot, PageError("local admission failed (see the log)", key=job.key))
            finally:
                with self._cond:
                    self._done += 1
                    self._cond.notify_all()

    def _admit(self, job: TierJob, slot: StagingSlot, sums: Sequence[int] | None) -> None:
        tier = self._tier
        if not os.path.exists(tier.mapper.path_for(job.key)):  # an existing page needs no room
            try:
                job.reservation, victims = self._index.reserve(self._size_of(job.key))
            except sqlite3.Error as exc:
                tier.index_failed("reserve", exc)
                job.reservation, victims = None, []
            if victims:
                tier.metrics.evicted(len(victims), sum(v.size for v in victims))
            if job.reservation is None:
                self._refuse(job, slot, PageError("page is larger than local_max_bytes, or the local index "
                                                  "failed (see the log)", key=job.key), kind="too_big")
                return
        tier.to_engine(job, slot, sums)

    def _refuse(self, job: TierJob, slot: StagingSlot, error: PageError, kind: str = "") -> None:
        with contextlib.suppress(ValueError):  # already back in the pool
            self._tier.release_slot(slot)
        if kind:  # counted under its own name, not the error's kind
            self._tier.metrics.failure(kind)
        self._tier.complete_now(job, error, count=not kind)
