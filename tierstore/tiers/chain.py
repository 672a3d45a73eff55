"""TierChain: one ``PageStore`` over a list of tiers, fastest first (host, local, shared).

Contract (``tierstore/store.py``; one chain per (namespace, KV-cache group, rank)):
- Loads walk the list: each available tier is asked in turn until one has the page; a tier
  that is not ``available`` (the shared tier while down) is skipped at once. The failure
  reported is the last asked tier's (a skipped tier's only if no tier was asked). A page a
  slower tier served is copied into the faster ones (``Promotion``), so that tier verifies it
  whatever the caller asked; ``verify=False`` reaches a tier only where the bytes go to the
  caller alone. The result's ``tier`` names the tier that served it; its ``slot`` belongs to
  that tier: hand it back with ``TierChain.release_slot``.
- Stores cascade down the list: the caller's slot goes to the front tier (the first durable
  one: local if present, else shared); every other tier stores a copy (host memory at once,
  the shared tier in the background, from its own staging slot). The result is the first
  durable tier's that succeeded, decided as soon as the tiers before it have failed (a local
  store does not wait for the shared copy). The result's ``tier`` names that tier.
- ``settle`` is routed by ``result.tier`` to the tier that served the page: it counts the hit
  or the checksum failure and removes a damaged file once (``EngineTier``).
- One job id: a chain job's ``JobTicket`` goes to every tier that works on its page (the tiers
  a load asks, the copies of a store, a load's promotions), so one table (``_jobs``) routes
  every tier result, and the result handed out is the tier's own, unchanged: the serving or
  storing tier's, else the last asked tier's failure. Only a job no tier took (every tier
  skipped, the chain closed, no durable tier answered) gets a result made here.
- A failing tier is skipped and counted in its metrics, never fatal. The tiers own their
  policies: local capacity (``LocalTier`` + ``LocalAdmission``), shared deadlines, health,
  background open and touch-on-hit (``SharedTier``). A page the shared tier did not take is
  uploaded later from the local tier (``SharedBacklog``).

Threading: public methods may be called from any thread. Locks (a thread holding one may take
those after it, never one before it):
1. the chain's lock: job table, lent slots; held while the chain submits to and polls
   its tiers (so their result hooks run under it), never while it blocks;
2. a tier's condition lock (its job maps), then 3. that tier's engine lock;
4. the shared tier's health lock (a hook marking it down), then 5. the backlog's lock (the
   health callback starts the uploader); the local index's lock is taken last (``defer``).
``wait`` blocks in one tier's ``wait`` (the engine's condition, or the tier's while a store is
in admission) without the chain's lock, so nothing polls on a timer.
Threads a chain starts besides each engine's I/O threads: ``tierstore-local-admit`` (one; the
admission lock alone, then the index's, then 2-3), ``tierstore-shared-open`` (once),
``tierstore-health:shared`` (while the shared tier is down; 4-5), ``tierstore-shared-upload``
(while a backlog is uploaded; 5 alone, then 1-3 to retire uploads), short-lived deadline
threads for the shared tier's ``contains``, probe and touches (bounded), the local index's
bookkeeping thread, and the process's gc daemon for the root when ``gc_interval_s`` is set.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tierstore.config import TierStoreConfig
from tierstore.errors import PageError, PageMissing
from tierstore.format.identity import Namespace
from tierstore.index.local_index import LocalIndex
from tierstore.metrics import MetricsRegistry, TierMetrics, default_registry
from tierstore.rootstore.staging import StagingSlot
from tierstore.store import IOResult, JobTicket
from tierstore.tiers.backlog import SHARED_BACKLOG_MAX, SharedBacklog
from tierstore.tiers.factory import build_tiers, tier_specs
from tierstore.tiers.host import HostTier
from tierstore.tiers.promotion import NO_SLOT_KIND, Promotion
from tierstore.tiers.tier import ChainTier

__all__ = ["TierChain", "SHARED_BACKLOG_MAX"]



@dataclass(eq=False)
class _Job:
    """A chain job: the tiers working on it under its ticket now, and what they returned."""

    ticket: JobTicket
    op: str
    key: bytes
    verify: bool = True
    subs: set[ChainTier] = field(default_factory=set)  # tiers with the job in flight (a promotion's too)
    outcome: dict[ChainTier, IOResult] = field(default_factory=dict)  # store: finished sub-jobs
    asked: int = 0  # load: tiers of the list walked so far
    failed: IOResult | None = None  # load: the last asked tier's failed result
    refused: PageError | None = None  # load: the first skipped tier's error, while none was asked
    backlogged: set[int] = field(default_factory=set)  # store: the backlogs (by index) it was handed to
    done: bool = False  # its result is out (write-behind copies and promotions may still run)

    @property
    def id(self) -> int:
        return self.ticket.id


class TierChain:
    """host -> local -> shared page store for one (namespace, group, rank); see module docstring."""

    def __init__(self, config: TierStoreConfig, namespace: Namespace, group_index: int, *, rank: int = 0,
                 host: HostTier | None = None, local_index: LocalIndex | None = None,
                 metrics: MetricsRegistry | None = None, shared: bool = True, **engine_kwargs: Any) -> None:
        self.config = config
        self.namespace = namespace
        self.group_index = group_index
        self.rank = rank
        self.metrics = reg = metrics if metrics is not None else default_registry()
        self.tokens_per_page = namespace.groups[group_index].tokens_per_chunk
        # The tiers, fastest first, from the config's specs (tiers/factory.py): a lone root is a
        # chain of one ("root"); ``shared=False`` leaves the root out (tests of the local tier).
        built = build_tiers(tier_specs(config, with_root=shared), config, namespace, group_index, rank, reg,
                            host=host, local_index=local_index, **engine_kwargs)
        self.host, self.local, self.shared, self.object = built.host, built.local, built.root, built.object
        self._front = built.front
        self.tiers: list[ChainTier] = built.tiers
        self._by_name = {t.name: t for t in self.tiers}
        self.promotion = Promotion()
        self._lock = threading.Lock()
        self._jobs: dict[int, _Job] = {}  # job id -> job some tier still works on, or whose result is not out
        self._results: dict[int, IOResult] = {}
        self._lent: dict[StagingSlot, ChainTier] = {}  # slots of load results -> the tier that owns them
        self._closed = False
        # Pages a tier stored and the tier behind it missed, uploaded later: local to root, root (or,
        # without one, local) to object.
        self.backlogs = [SharedBacklog(src, dst, self._drain_now) for src, dst in
                         ((self.local, self.shared), (self.shared or self.local, self.object)) if None not in (src, dst)]
        self.backlog = self.backlogs[0] if self.local is not None and self.shared is not None else None

    # ------------------------------------------------------------------ views
    @property
    def m_local(self) -> TierMetrics:
        return self.metrics.tier("local")

    @property
    def m_shared(self) -> TierMetrics:
        """The root's tier metrics ("shared", or "root" for a lone root)."""
        return self.shared.metrics if self.shared is not None else self.metrics.tier("shared")

    @property
    def layout(self) -> Any:
        return self._front.layout

    @property
    def mapper(self) -> Any:
        return self._front.mapper

    def wrap_tier(self, name: str, wrap: Callable[[ChainTier], ChainTier]) -> ChainTier:
        """Put the tier ``name`` inside ``wrap`` (e.g. ``testing.faults.FaultInjectingStore``)
        for jobs submitted from now on; the wrapper must forward to the tier. Returns it."""
        with self._lock:
            old = self._by_name[name]
            new = wrap(old)
            self.tiers[self.tiers.index(old)] = new
            self._by_name[name] = new
            if self._front is old:
                self._front = new  # type: ignore[assignment]
            return new

    # ------------------------------------------------------------------ slots
    def acquire_slot(self, timeout: float | None = 0) -> StagingSlot | None:
        return self._front.acquire_slot(timeout)

    @property
    def free_slots(self) -> int:
        """Free staging slots of the front tier (the ones callers fill)."""
        return self._front.free_slots

    def release_slot(self, slot: StagingSlot) -> None:
        with self._lock:
            owner = self._lent.pop(slot, self._front)
        owner.release_slot(slot)

    # ------------------------------------------------------------------ jobs and routes
    def _new_job(self, op: str, key: bytes, ticket: JobTicket | None, verify: bool = True) -> _Job:
        job = _Job(JobTicket.given(ticket), op, key, verify)
        if job.id in self._jobs:
            raise ValueError(f"job id {job.id} is in use in this chain already: a ticket is for one job")
        self._jobs[job.id] = job
        return job

    def _finish(self, job: _Job, r: IOResult | None, error: PageError | None = None) -> None:
        """Hand out ``r`` (a tier's result, as it is), else a result made here with ``error``."""
        job.done = True
        if r is None:
            r = IOResult(job.id, job.op, job.key, False, error or PageError("no tier took the job", key=job.key),
                         None, False, 0, time.monotonic() - job.ticket.submitted, tier=self._front.name)
        if r.slot is not None:
            self._lent[r.slot] = self._by_name[r.tier]
        self._results[job.id] = r
        if not job.subs:  # else retired by ``_route`` when the last tier answers
            self._jobs.pop(job.id, None)

    def _route(self, tier: ChainTier, r: IOResult) -> None:
        job = self._jobs.get(r.job_id)
        if job is None or tier not in job.subs:  # no chain job (a backlog upload's): never leak a slot
            if r.slot is not None:
                tier.release_slot(r.slot)
            return
        job.subs.discard(tier)
        if job.op == "store":
            self._on_store(job, tier, r)
        elif r.op == "store":  # a promotion of the page the job loaded
            self.promotion.stored(tier, r)
        else:
            self._on_load(job, tier, r)
        if job.done and not job.subs:
            self._jobs.pop(job.id, None)

    def _drain(self) -> None:
        """Route every finished sub-job (call with the chain's lock held)."""
        for tier in self.tiers:
            for r in tier.poll():
                self._route(tier, r)

    def _drain_now(self) -> None:
        with self._lock:
            self._drain()

    # ------------------------------------------------------------------ loads
    def submit_load(self, key: bytes, verify: bool = True, *, ticket: JobTicket | None = None) -> int:
        """``verify=False`` is passed on only to a tier whose page is copied nowhere else."""
        key = bytes(key)
        with self._lock:
            job = self._new_job("load", key, ticket, verify)
            if self._closed:
                self._finish(job, None, PageMissing("the tier chain is closed", key=key))
            else:
                self._ask_next(job)
                self._drain()
            return job.id

    def _ask_next(self, job: _Job) -> None:
        while job.asked < len(self.tiers):
            served = job.asked
            tier = self.tiers[served]
            job.asked += 1
            if not tier.available:
                if job.failed is None and job.refused is None:
                    job.refused = tier.refuse(job.key)
                continue
            verify = job.verify or self.promotion.needs_verify(self.tiers, served)
            job.subs.add(tier)
            tier.submit_load(job.key, verify, ticket=job.ticket)
            return
        self._finish(job, job.failed, job.refused or PageMissing("not in any tier", key=job.key))

    def _on_load(self, job: _Job, tier: ChainTier, r: IOResult) -> None:
        if not r.ok:
            job.failed = r
            self._ask_next(job)
            return
        assert r.slot is not None
        if self.shared is not None and tier is not self.shared:
            self.shared.stamp_hit(r.key)  # gc's LRU lives on the export: a local hit is a fleet hit
        for faster in self.promotion.targets(self.tiers, self.tiers.index(tier)):
            job.subs.add(faster)
            faster.store_copy(r.key, r.slot.view, self.tokens_per_page, no_slot=NO_SLOT_KIND, ticket=job.ticket)
        self._finish(job, r)

    # ------------------------------------------------------------------ stores
    def submit_store(self, key: bytes, slot: StagingSlot, token_count: int,
                     sums: Sequence[int] | None = None, *, ticket: JobTicket | None = None) -> int:
        """``sums``: the caller's section checksums of the slot (``PageStore.submit_store``)."""
        key = bytes(key)
        with self._lock:
            job = self._new_job("store", key, ticket)
            job.subs.update(self.tiers)
            for tier in self.tiers:  # copies first: the front tier owns ``slot`` once submitted
                if tier is not self._front:
                    tier.store_copy(key, slot.view, token_count, sums, ticket=job.ticket)
            self._front.submit_store(key, slot, token_count, sums, ticket=job.ticket)
            self._drain()
            return job.id

    def _on_store(self, job: _Job, tier: ChainTier, r: IOResult) -> None:
        job.outcome[tier] = r
        self._feed_backlog(job)
        if job.done:  # decided by an earlier tier; this was a write-behind copy
            return
        failed: IOResult | None = None
        for t in self.tiers:
            if not t.durable:
                continue
            if t in job.subs:
                return  # an earlier durable tier has not answered yet
            out = job.outcome.get(t)
            if out is not None and out.ok:
                self._finish(job, out)
                return
            failed = failed or out
        self._finish(job, failed, PageError("no tier stored the page", key=job.key))

    def _feed_backlog(self, job: _Job) -> None:
        """A page the backlog's source tier stored and its target did not: upload it later
        (only once the source's file exists, so the uploader never races the local write)."""
        got = {t.name: r for t, r in job.outcome.items()}
        for i, b in enumerate(self.backlogs):
            if i in job.backlogged:
                continue
            src, dst = got.get(b.source.name), got.get(b.target.name)
            if src is not None and src.ok and dst is not None and not dst.ok:
                job.backlogged.add(i)
                b.add(job.key)

    # ------------------------------------------------------------------ results
    def poll(self) -> list[IOResult]:
        with self._lock:
            self._drain()
            out = list(self._results.values())
            self._results.clear()
            return out

    def _blocking(self, ids: Iterable[int]) -> tuple[ChainTier, list[int]] | None:
        """The first tier (in list order) some pending job waits on, and those sub-jobs."""
        waits: dict[ChainTier, list[int]] = {}
        for i in ids:
            job = self._jobs.get(i)
            if job is None or job.done:
                continue
            for tier in self.tiers:  # a store waits on its first undecided durable tier
                if tier in job.subs and (job.op == "load" or tier.durable):
                    waits.setdefault(tier, []).append(job.id)
                    break
        return next(((t, waits[t]) for t in self.tiers if t in waits), None)

    def wait(self, job_ids: Iterable[int], timeout: float | None) -> list[IOResult]:
        """Block until the given jobs finish (or ``timeout``); returns those that finished.

        Each round blocks in one tier's ``wait`` on the sub-jobs the pending jobs depend on
        there, then routes what it returned (a load may move on to the next tier)."""
        ids = list(job_ids)
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                self._drain()
                blocking = self._blocking(ids)
            left = None if end is None else end - time.monotonic()
            if blocking is None or (left is not None and left <= 0):
                break
            tier, subs = blocking
            res = tier.wait(subs, left)
            with self._lock:
                for r in res:
                    self._route(tier, r)
        with self._lock:
            return [self._results.pop(i) for i in ids if i in self._results]

    def settle(self, result: IOResult, ok: bool, reason: str = "") -> None:
        """The caller's verdict on an unverified load, routed to the tier that served it."""
        self._by_name[result.tier].settle(result, ok, reason)

    def contains(self, key: bytes) -> bool:
        key = bytes(key)
        return any(tier.contains(key) for tier in self.tiers)

    # ------------------------------------------------------------------ lifetime
    def flush(self, timeout: float | None) -> bool:
        end, ok = None if timeout is None else time.monotonic() + timeout, True
        for tier in self.tiers:
            ok = tier.flush(None if end is None else max(end - time.monotonic(), 0.0)) and ok
        for b in self.backlogs:  # uploads to a tier that answers are stores too
            ok = b.flush(end) and ok
        self._drain_now()
        return ok

    def close(self, timeout: float | None = None) -> None:
        timeout = self.config.flush_timeout_s if timeout is None else timeout
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.flush(timeout)
        for b in self.backlogs:
            b.close(min(timeout, 1.0))
        for tier in self.tiers:
            tier.close(timeout)
        self._drain_now()

    def __enter__(self) -> TierChain:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tiers": self.metrics.snapshot(),
                               "shared_up": self.shared.health.up if self.shared is not None else True}
        fs = self._front.stats  # the keys an IOEngine's stats have that callers log
        for k in ("io_mode", "odirect_reason", "codec", "staging_slots", "free_slots", "pinned"):
            out[k] = fs.get(k)
        for tier in (self.local, self.shared):
            if tier is not None and tier.engine() is not None:
                out[f"{tier.name}_engine"] = tier.stats
        return out
