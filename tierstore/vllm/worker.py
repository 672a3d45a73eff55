"""Worker side of the tierstore offloading spec: KV blocks <-> canonical page files.

``TierStoreWorker`` implements vLLM's ``OffloadingWorker`` for one worker (rank). Per offloaded
KV-cache group it holds a ``GroupCopier`` (vLLM's per-layer tensors, expressed as strided views,
to canonical pages: ``tierstore.kernels``) and a page store (pages to files and back: an
``IOEngine`` or a ``TierChain`` from ``tierstore.tiers.open_group_store``, same API).

- Stores: ``submit_store`` gathers the blocks into free staging slots and queues the writes;
  it never waits for a slot. Pages that find none are deferred and gathered, oldest first, as
  slots free up (``pump_stores`` at the next step's start, ``get_finished``, later submits).
  That is safe because vLLM keeps a store job's blocks valid until the job is reported
  complete, and before it reuses such blocks it calls ``wait(job_ids)`` (its
  ``jobs_to_flush`` fence): there the job's deferred pages are gathered, waiting at most
  ``fence_slot_wait_s`` for a slot, or dropped. Dropped pages (fence, older than
  ``defer_limit_s``, shutdown timeout) and failed writes are counted: a missing page is only
  a future miss.
- Loads: ``submit_load`` queues one read per page; ``get_finished`` scatters each verified page
  into its blocks as it arrives. A job with any failed page (missing, truncated, corrupt,
  foreign, timed out, ...) completes with ``success=False``; the connector then reports the
  request in ``failed_recving`` and vLLM recomputes it (the blocks are never marked computed),
  and the failed keys go back to the scheduler so the retried lookup misses them.
- ``shutdown`` waits up to ``flush_timeout_s`` for queued stores, then closes the engines.

Threading: every method runs on the vLLM worker thread; the engines' I/O threads never touch
vLLM tensors (they read and write staging slots only).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from tierstore.engine import IOEngine, IOResult
from tierstore.kernels import GroupCopier
from tierstore.metrics import TierMetrics
from tierstore.vllm.manager import TierStoreFileSpec

logger = logging.getLogger("tierstore.vllm")


@dataclass
class WorkerGroup:
    """One offloaded KV-cache group as the worker sees it."""

    index: int  # tierstore group index (position among offloaded groups)
    vllm_group_id: int
    copier: GroupCopier
    engine: IOEngine
    blocks_per_chunk: int  # scheduler blocks per page (1 for Mamba)
    kernel_ratio: int  # kernel blocks per scheduler block
    device: torch.device
    fixup: Any = None  # in-place page fix-up (after_gather / before_scatter), see spec.KTransposeFixup
    tokens_per_page: int = 0
    # Per-tier metrics for a plain IOEngine (a TierChain records its own): the "root" tier.
    root_metrics: TierMetrics | None = None


@dataclass
class _Job:
    job_id: int
    is_load: bool
    started: float
    pending: set[tuple[int, int]] = field(default_factory=set)  # (group index, engine job id)
    failed: list[tuple[int, bytes | None, str]] = field(default_factory=list)  # (group, key, kind)
    waiting: int = 0  # page loads queued here until a staging slot frees up
    keys: list[tuple[int, bytes]] = field(default_factory=list)  # every page (group, key) of a load
    nbytes: int = 0


class TierStoreWorker(OffloadingWorker):
    def __init__(self, groups: list[WorkerGroup], flush_timeout_s: float, defer_limit_s: float = 10.0,
                 fence_slot_wait_s: float = 0.05) -> None:
        self.groups = groups
        self.flush_timeout_s = flush_timeout_s
        self.defer_limit_s = defer_limit_s  # a deferred store page older than this is dropped
        self.fence_slot_wait_s = fence_slot_wait_s  # the most a flush fence waits for one slot
        # per group: store pages waiting for a staging slot (job id, key, tokens, kernel row, queued at)
        self._store_queue: dict[int, deque[tuple[int, bytes, int, torch.Tensor, float]]] = {
            g.index: deque() for g in groups}
        self._jobs: dict[int, _Job] = {}
        self._by_engine_job: dict[tuple[int, int], tuple[int, torch.Tensor | None]] = {}
        self._finished: list[TransferResult] = []
        self._load_queue: dict[int, deque[tuple[int, bytes, torch.Tensor]]] = {g.index: deque() for g in groups}
        self.failed_loads: list[tuple[int, int, bytes, str]] = []  # (job, vLLM group, key, kind)
        self.counters: Counter[str] = Counter()
        self._closed = False

    # ------------------------------------------------------------ helpers
    def _kernel_rows(self, g: WorkerGroup, block_ids: list[int], pages: int) -> torch.Tensor:
        """Kernel block ids [pages, blocks_per_page] of ``pages`` pages, in token order."""
        ids = torch.tensor(block_ids, dtype=torch.int64)
        if g.kernel_ratio > 1:
            ids = (ids[:, None] * g.kernel_ratio + torch.arange(g.kernel_ratio)).reshape(-1)
        return ids.reshape(pages, -1).to(g.device)

    def _split(self, spec: GPULoadStoreSpec) -> list[tuple[list[int], int]]:
        """Per group (block ids, logical index of the first block)."""
        out, pos = [], 0
        ids = spec.block_ids.tolist()
        for n, first in zip(spec.group_sizes, spec.block_indices, strict=True):
            out.append((ids[pos : pos + n], int(first)))
            pos += n
        return out

    def _pages_by_group(self, spec: TierStoreFileSpec) -> dict[int, list[tuple[bytes, int]]]:
        by: dict[int, list[tuple[bytes, int]]] = {}
        for g, key, tokens in zip(spec.groups, spec.keys, spec.token_counts, strict=True):
            by.setdefault(g, []).append((key, tokens))
        return by

    def _sync(self, g: WorkerGroup) -> None:
        if g.device.type == "cuda":
            torch.cuda.current_stream(g.device).synchronize()

    def _fail(self, job: _Job, group: int, key: bytes | None, kind: str, message: str) -> None:
        job.failed.append((group, key, kind))
        op = "load" if job.is_load else "store"
        self.counters[f"{op}_failed:{kind}"] += 1
        name = key.hex()[:16] if key else "?"
        logger.warning("tierstore: %s of page %s.. (group %d) failed: %s%s", op, name, group, message,
                       "; the request's tokens are recomputed" if job.is_load else "")

    # ------------------------------------------------------------ stores
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, TierStoreFileSpec)
        job = _Job(job_id, False, time.perf_counter())
        self._jobs[job_id] = job
        pages = self._pages_by_group(dst_spec)
        for g, (block_ids, _first) in zip(self.groups, self._split(src_spec), strict=True):
            todo = pages.get(g.index, [])
            if not todo:
                continue
            if len(block_ids) != len(todo) * g.blocks_per_chunk:
                for key, _ in todo:
                    self._fail(job, g.index, key, "layout",
                               f"{len(block_ids)} blocks for {len(todo)} pages of {g.blocks_per_chunk} blocks")
                continue
            rows = self._kernel_rows(g, block_ids, len(todo))
            now = time.monotonic()
            for (key, tokens), row in zip(todo, rows, strict=True):
                job.waiting += 1
                self._store_queue[g.index].append((job_id, key, tokens, row[None, :], now))
            self._pump_stores(g)
            # pages of this job that found no free slot now (each counted once)
            self.counters["store_deferrals"] += sum(1 for item in self._store_queue[g.index] if item[0] == job_id)
        self._maybe_finish(job)
        return True

    def _pump_stores(self, g: WorkerGroup, *, only: set[int] | None = None, slot_wait_s: float = 0.0,
                     drop_reason: str | None = None) -> None:
        """Gather queued store pages into free staging slots (oldest first) and submit them.

        Never waits for a slot unless ``slot_wait_s`` > 0. A page left in the queue keeps its
        blocks fenced by vLLM until its job completes (see docs/design/vllm.md), so deferring
        it to a later step is safe. ``only``: just these jobs' pages (a flush fence);
        ``drop_reason``: pages that still get no slot are dropped and counted under it.
        """
        queue = self._store_queue[g.index]
        if not queue:
            return
        now = time.monotonic()
        keep: deque[tuple[int, bytes, int, torch.Tensor, float]] = deque()
        todo: list[tuple[int, bytes, int, torch.Tensor, float]] = []
        for item in queue:
            if only is not None and item[0] not in only:
                keep.append(item)
            elif now - item[4] > self.defer_limit_s:
                self._drop_store(g, item, "deferred_too_long")
            else:
                todo.append(item)
        pos = 0
        while pos < len(todo):
            slots = []
            first = g.engine.acquire_slot(timeout=slot_wait_s) if slot_wait_s > 0 else g.engine.acquire_slot(0)
            if first is None:
                break
            slots.append(first)
            while pos + len(slots) < len(todo):
                more = g.engine.acquire_slot(0)
                if more is None:
                    break
                slots.append(more)
            batch = todo[pos : pos + len(slots)]
            rows = torch.cat([item[3] for item in batch]) if len(batch) > 1 else batch[0][3]
            g.copier.gather(rows, [sl.tensor for sl in slots])
            self._sync(g)
            for (job_id, key, tokens, _row, _t), slot in zip(batch, slots, strict=True):
                if g.fixup is not None:
                    g.fixup.after_gather(slot.tensor)
                job = self._jobs[job_id]
                job.waiting -= 1
                eid = g.engine.submit_store(key, slot, tokens)
                job.pending.add((g.index, eid))
                self._by_engine_job[(g.index, eid)] = (job_id, None)
            self.counters["store_batches"] += 1
            pos += len(slots)
        rest = todo[pos:]
        if rest and drop_reason is not None:
            for item in rest:
                self._drop_store(g, item, drop_reason)
            rest = []
        self._store_queue[g.index] = deque([*keep, *rest]) if keep else deque(rest)
        # sort not needed: ``keep`` and ``rest`` are both in arrival order; merge keeps FIFO enough
        for job_id in {item[0] for item in todo}:
            job = self._jobs.get(job_id)
            if job is not None:
                self._maybe_finish(job)

    def _drop_store(self, g: WorkerGroup, item: tuple[int, bytes, int, torch.Tensor, float], reason: str) -> None:
        job_id, key, _tokens, _row, _t = item
        job = self._jobs[job_id]
        job.waiting -= 1
        job.failed.append((g.index, key, "store_dropped"))
        self.counters[f"store_dropped:{reason}"] += 1
        logger.debug("tierstore: store of page %s.. (group %d) dropped: %s", key.hex()[:16], g.index, reason)

    def pump_stores(self) -> None:
        """Submit deferred store pages while slots are free (never waits)."""
        for g in self.groups:
            self._pump_stores(g)

    def deferred_store_pages(self) -> int:
        return sum(len(q) for q in self._store_queue.values())

    # ------------------------------------------------------------ loads
    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        # ``expedited`` (vLLM 0.33: the step waits for this load) needs no special path: pages are
        # read by the engine's threads and scattered in get_finished either way.
        assert isinstance(src_spec, TierStoreFileSpec)
        job = _Job(job_id, True, time.perf_counter())
        job.keys = list(zip(src_spec.groups, src_spec.keys, strict=True))
        self._jobs[job_id] = job
        pages = self._pages_by_group(src_spec)
        for g, (block_ids, first) in zip(self.groups, self._split(dst_spec), strict=True):
            todo = pages.get(g.index, [])
            if not todo and not block_ids:
                continue
            bpc = g.blocks_per_chunk
            if first % bpc or len(block_ids) != len(todo) * bpc:
                # A window that starts inside a page (validation rules it out): recompute.
                msg = f"{len(block_ids)} blocks from logical block {first} for {len(todo)} pages of {bpc}"
                for key, _ in todo:
                    self._fail(job, g.index, key, "partial_chunk", msg)
                if not todo:
                    self._fail(job, g.index, None, "partial_chunk", msg)
                continue
            rows = self._kernel_rows(g, block_ids, len(todo))
            for (key, _), row in zip(todo, rows, strict=True):
                job.waiting += 1
                self._load_queue[g.index].append((job_id, key, row[None, :]))
            self._pump(g)
        self._maybe_finish(job)
        return True

    def _pump(self, g: WorkerGroup) -> None:
        """Submit queued page loads while the engine has free staging slots (a load holds its
        slot until get_finished has scattered it, so never ask for more than are free)."""
        queue = self._load_queue[g.index]
        while queue and g.engine.free_slots > 0:
            job_id, key, row = queue.popleft()
            job = self._jobs[job_id]
            job.waiting -= 1
            eid = g.engine.submit_load(key)
            job.pending.add((g.index, eid))
            self._by_engine_job[(g.index, eid)] = (job_id, row)

    # ------------------------------------------------------------ completion
    def _on_result(self, g: WorkerGroup, res: IOResult) -> None:
        entry = self._by_engine_job.pop((g.index, res.job_id), None)
        if entry is None:
            if res.slot is not None:
                g.engine.release_slot(res.slot)
            return
        job_id, rows = entry
        job = self._jobs[job_id]
        job.pending.discard((g.index, res.job_id))
        m = g.root_metrics
        if m is not None:
            if res.ok:
                if res.op == "load":
                    m.hit(g.tokens_per_page, res.nbytes, res.seconds)
                elif res.stored:
                    m.stored(res.nbytes, res.seconds)
            elif res.error is not None and res.error.kind == "missing":
                m.miss(g.tokens_per_page)
            else:
                m.failure(res.error.kind if res.error is not None else "error")
        if res.op == "load":
            if res.ok and res.slot is not None:
                try:
                    if not job.failed:  # the job is lost anyway: skip the copy
                        assert rows is not None
                        if g.fixup is not None:
                            g.fixup.before_scatter(res.slot.tensor)
                        g.copier.scatter([res.slot.tensor], rows)
                        self._sync(g)
                    job.nbytes += res.nbytes
                    self.counters["load_pages_ok"] += 1
                    self.counters["load_bytes"] += res.nbytes
                finally:
                    g.engine.release_slot(res.slot)
            else:
                err = res.error
                self._fail(job, g.index, res.key, err.kind if err else "error", str(err))
        else:
            if res.ok:
                self.counters["store_pages_ok" if res.stored else "store_pages_existing"] += 1
                self.counters["store_bytes"] += res.nbytes if res.stored else 0
                job.nbytes += res.nbytes
            else:
                err = res.error
                self._fail(job, g.index, res.key, err.kind if err else "error", str(err))
        self._maybe_finish(job)

    def _maybe_finish(self, job: _Job) -> None:
        if job.pending or job.waiting or self._jobs.get(job.job_id) is not job:
            return
        del self._jobs[job.job_id]
        ok = not job.failed
        if job.is_load:
            self.counters["load_jobs_ok" if ok else "load_jobs_failed"] += 1
            failed = [(g, k, kind) for g, k, kind in job.failed if k is not None]
            if job.failed and not failed:
                # A failure not tied to one page: skip all of the job's pages on the retry, or
                # the same lookup would hit and fail again.
                kind = job.failed[0][2]
                failed = [(g, k, kind) for g, k in job.keys]
            for group, key, kind in failed:
                self.failed_loads.append((job.job_id, self.groups[group].vllm_group_id, key, kind))
        self._finished.append(TransferResult(job.job_id, ok, job.nbytes, time.perf_counter() - job.started))

    def get_finished(self) -> list[TransferResult]:
        for g in self.groups:
            for res in g.engine.poll():
                self._on_result(g, res)
            self._pump(g)
            self._pump_stores(g)
        out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        """vLLM's fence before it reuses the blocks of these (store) jobs: gather their deferred
        pages now, waiting at most ``fence_slot_wait_s`` per batch for a slot; what still gets
        no slot is dropped (counted ``store_dropped:fence``). Submitted pages no longer read
        vLLM's blocks, so nothing else needs waiting for."""
        only = set(job_ids)
        for g in self.groups:
            if any(item[0] in only for item in self._store_queue[g.index]):
                self._pump_stores(g, only=only, slot_wait_s=self.fence_slot_wait_s, drop_reason="fence")

    def engine_stats(self) -> dict[str, Any]:
        return {f"g{g.index}": g.engine.stats for g in self.groups}

    def flush(self, timeout: float | None) -> bool:
        """Wait until every queued store has reached the disk (or failed)."""
        end = None if timeout is None else time.monotonic() + timeout
        done = True
        for g in self.groups:
            while self._store_queue[g.index]:
                left = 1.0 if end is None else end - time.monotonic()
                if left <= 0:
                    break
                for res in g.engine.poll():
                    self._on_result(g, res)
                self._pump_stores(g, slot_wait_s=min(left, 0.1))
            if self._store_queue[g.index]:
                self._pump_stores(g, drop_reason="flush_timeout")
                done = False
        for g in self.groups:
            left = None if end is None else max(0.0, end - time.monotonic())
            done = g.engine.flush(left) and done
        return done

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        t0 = time.monotonic()
        if not self.flush(self.flush_timeout_s):
            logger.warning("tierstore: stores still queued after flush_timeout_s=%.1f s are dropped",
                           self.flush_timeout_s)
        for g in self.groups:
            g.engine.close(max(0.0, self.flush_timeout_s - (time.monotonic() - t0)))
