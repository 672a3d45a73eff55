"""Worker side of the tierstore offloading spec: KV blocks <-> canonical page files.

``TierStoreWorker`` implements vLLM's ``OffloadingWorker`` for one worker (rank). Per offloaded
KV-cache group it holds a ``GroupCopier`` (vLLM's per-layer tensors, expressed as strided views,
to canonical pages: ``tierstore.kernels``), a ``PageTransfer`` (the copier driven without
blocking the forward pass: ``tierstore.kernels.transfer``) and a page store (pages to files and
back: an ``IOEngine`` or a ``TierChain`` from ``tierstore.tiers.open_group_store``, same API).

- Stores: ``submit_store`` takes free staging slots and starts gathers into them
  (``PageTransfer.start_store``: on CUDA a side stream, after the forward work already queued;
  on CPU at once); it never waits for a slot. Pages that find none (or no room in the
  transfer's scratch) are deferred and started, oldest first, as slots free up (``pump_stores``
  at the next step's start, ``get_finished``, later submits). A finished gather submits each
  page to the page store with the section checksums the GPU computed (``handle.sums``; None on
  CPU: the engine hashes). That is safe because vLLM keeps a store job's blocks valid until
  the job is reported complete (after its writes), and before it reuses such blocks it calls
  ``wait(job_ids)`` (its ``jobs_to_flush`` fence): there the job's deferred pages are gathered,
  waiting at most ``fence_slot_wait_s`` for a slot, or dropped, and the current CUDA stream is
  made to wait (on the GPU) for the job's started gathers. Dropped pages (fence, older than
  ``defer_limit_s``, shutdown timeout) and failed writes are counted: a missing page is only a
  future miss.
- Loads: ``submit_load`` queues one read per page (``verify=False`` when the transfer checks
  the section checksums on the GPU); each page read is handed to ``PageTransfer.start_load``
  (batched per ``get_finished``), its slot goes back once the transfer has copied it
  (``slots_free``), and the page counts once its blocks are written (``done``). A job with any
  failed page (missing, truncated, corrupt, checksum, foreign, timed out, ...) completes with
  ``success=False``; the connector then reports the request in ``failed_recving`` and vLLM
  recomputes it (the blocks are never marked computed), and the failed keys go back to the
  scheduler so the retried lookup misses them. A job is never reported while a transfer of
  its pages is still running (its blocks could be reused under it).
- ``flush``/``shutdown`` drain started transfers (the only places that block on the GPU),
  wait up to ``flush_timeout_s`` for queued stores, then close the engines.

Threading: every method runs on the vLLM worker thread; the engines' I/O threads never touch
vLLM tensors (they read and write staging slots only). Nothing here synchronizes the host with
the GPU except ``flush``/``shutdown``: transfers are polled.
"""

from __future__ import annotations

import logging
import threading
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
from tierstore.kernels.transfer import PageTransfer
from tierstore.metrics import TierMetrics
from tierstore.tiers.chain import TierChain
from tierstore.vllm.manager import TierStoreFileSpec

logger = logging.getLogger("tierstore.vllm")


@dataclass
class WorkerGroup:
    """One offloaded KV-cache group as the worker sees it."""

    index: int  # tierstore group index (position among offloaded groups)
    vllm_group_id: int
    copier: GroupCopier
    engine: IOEngine | TierChain  # the same load/store interface; a chain records its own metrics
    blocks_per_chunk: int  # scheduler blocks per page (1 for Mamba)
    kernel_ratio: int  # kernel blocks per scheduler block
    device: torch.device
    fixup: Any = None  # in-place page fix-up (after_gather / before_scatter), see spec.KTransposeFixup
    tokens_per_page: int = 0
    # Per-tier metrics for a plain IOEngine (a TierChain records its own): the "root" tier.
    root_metrics: TierMetrics | None = None
    # Cache <-> staging slot copies; None: the worker builds a PageTransfer with default scratch.
    transfer: PageTransfer | Any = None


@dataclass
class _Job:
    job_id: int
    is_load: bool
    started: float
    pending: set[tuple[int, int]] = field(default_factory=set)  # (group index, engine job id)
    failed: list[tuple[int, bytes | None, str]] = field(default_factory=list)  # (group, key, kind)
    waiting: int = 0  # pages queued here (store: for a slot; load: for engine submission)
    moving: int = 0  # pages between the engine and a finished transfer (slot held by this worker)
    keys: list[tuple[int, bytes]] = field(default_factory=list)  # every page (group, key) of a load
    nbytes: int = 0


@dataclass
class _StorePage:
    job_id: int
    key: bytes
    tokens: int
    row: torch.Tensor  # [1, kernel blocks per page], CPU int64
    queued: float  # time.monotonic() when queued


@dataclass
class _LoadPage:
    job_id: int
    res: IOResult  # the engine's OK result (holds the slot)
    row: torch.Tensor
    fixed: bool = False  # fixup.before_scatter already applied to the slot


@dataclass
class _Transfer:
    """A started PageTransfer and the pages it carries (in slot order)."""

    handle: Any
    slots: list[Any]
    stores: list[_StorePage] = field(default_factory=list)
    loads: list[_LoadPage] = field(default_factory=list)
    slots_released: bool = False  # load: the slots went back to the engine (handle.slots_free())


class TierStoreWorker(OffloadingWorker):
    def __init__(self, groups: list[WorkerGroup], flush_timeout_s: float, defer_limit_s: float = 10.0,
                 fence_slot_wait_s: float = 0.05) -> None:
        self.groups = groups
        for g in groups:
            if g.transfer is None:
                g.transfer = PageTransfer(g.copier, g.device)
        self.flush_timeout_s = flush_timeout_s
        self.defer_limit_s = defer_limit_s  # a deferred store page older than this is dropped
        self.fence_slot_wait_s = fence_slot_wait_s  # the most a flush fence waits for one slot
        # per group: store pages waiting for a staging slot / transfer scratch, oldest first
        self._store_queue: dict[int, deque[_StorePage]] = {g.index: deque() for g in groups}
        # per group: started transfers by id(handle), in start order
        self._transfers: dict[int, dict[int, _Transfer]] = {g.index: {} for g in groups}
        self._jobs: dict[int, _Job] = {}
        self._by_engine_job: dict[tuple[int, int], tuple[int, torch.Tensor | None]] = {}
        self._finished: list[TransferResult] = []
        self._load_queue: dict[int, deque[tuple[int, bytes, torch.Tensor]]] = {g.index: deque() for g in groups}
        # per group: loads read by the engine (slot held), waiting for transfer scratch
        self._load_ready: dict[int, deque[_LoadPage]] = {g.index: deque() for g in groups}
        self.failed_loads: list[tuple[int, int, bytes, str]] = []  # (job, vLLM group, key, kind)
        self.counters: Counter[str] = Counter()
        self._closed = False

    # ------------------------------------------------------------ helpers
    def _kernel_rows(self, g: WorkerGroup, block_ids: list[int], pages: int) -> torch.Tensor:
        """Kernel block ids [pages, blocks_per_page] of ``pages`` pages, in token order, on the
        CPU (the transfer moves them to the device asynchronously: a plain ``.to("cuda")`` of a
        pageable tensor would wait for the forward pass)."""
        ids = torch.tensor(block_ids, dtype=torch.int64)
        if g.kernel_ratio > 1:
            ids = (ids[:, None] * g.kernel_ratio + torch.arange(g.kernel_ratio)).reshape(-1)
        return ids.reshape(pages, -1)

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

    @staticmethod
    def _batch_rows(batch: list[_StorePage] | list[_LoadPage]) -> torch.Tensor:
        """The kernel block ids [pages, blocks per page] of a transfer's pages, in order."""
        return torch.cat([p.row for p in batch]) if len(batch) > 1 else batch[0].row

    @staticmethod
    def _max_batch(g: WorkerGroup, n: int) -> int:
        """Pages per transfer start: at most the scratch (GPU); no limit on CPU (capacity 0)."""
        cap = int(getattr(g.transfer, "capacity", 0) or 0)
        return min(n, cap) if cap > 0 else n

    def _fail(self, job: _Job, group: int, key: bytes | None, kind: str, message: str) -> None:
        job.failed.append((group, key, kind))
        op = "load" if job.is_load else "store"
        self.counters[f"{op}_failed:{kind}"] += 1
        name = key.hex()[:16] if key else "?"
        logger.warning("tierstore: %s of page %s.. (group %d) failed: %s%s", op, name, group, message,
                       "; the request's tokens are recomputed" if job.is_load else "")

    def _release(self, g: WorkerGroup, slots: list[Any]) -> None:
        for slot in slots:
            g.engine.release_slot(slot)

    # ------------------------------------------------------------ transfers
    def _poll_transfers(self, g: WorkerGroup, *, block: bool = False) -> None:
        """Hand back load slots the transfers no longer read and finish completed transfers.
        ``block``: wait for every started transfer first (flush/shutdown only)."""
        xfers = self._transfers[g.index]
        if not xfers:
            return
        finished = g.transfer.wait() if block else g.transfer.poll()
        for x in xfers.values():
            if x.loads and not x.slots_released and x.handle.slots_free():
                x.slots_released = True
                self._release(g, x.slots)
        for h in finished:
            x = xfers.pop(id(h), None)
            if x is None:
                continue
            if x.stores:
                self._store_gathered(g, x)
            else:
                self._load_scattered(g, x)

    def _store_gathered(self, g: WorkerGroup, x: _Transfer) -> None:
        """A finished gather: submit each slot's page to the page store (which owns the slot then)."""
        sums = x.handle.sums
        jobs = set()
        for j, (page, slot) in enumerate(zip(x.stores, x.slots, strict=True)):
            job = self._jobs[page.job_id]
            jobs.add(page.job_id)
            job.moving -= 1
            try:
                if g.fixup is not None:
                    g.fixup.after_gather(slot.tensor)  # the GPU sums (if any) are of the unfixed bytes
                page_sums = sums[j] if sums and g.fixup is None else None
                eid = g.engine.submit_store(page.key, slot, page.tokens, sums=page_sums)
            except Exception as e:  # noqa: BLE001 - one bad page must not take the step down
                g.engine.release_slot(slot)
                self._fail(job, g.index, page.key, "error", f"submit failed: {e!r}")
                continue
            job.pending.add((g.index, eid))
            self._by_engine_job[(g.index, eid)] = (page.job_id, None)
        for job_id in jobs:
            self._maybe_finish(self._jobs[job_id])

    @staticmethod
    def _discard_later(g: WorkerGroup, key: bytes, reason: str) -> None:
        """Remove a page the GPU found damaged, as the engine does with one it finds itself, on a
        short-lived thread: an unlink on a hung shared mount must not stall the step."""

        def discard() -> None:
            try:
                g.engine.discard_page(key, reason)
            except Exception as e:  # noqa: BLE001 - the page still failed; a later read finds it again
                logger.warning("tierstore: could not discard damaged page %s..: %r", key.hex()[:16], e)

        threading.Thread(target=discard, name="tierstore-discard", daemon=True).start()

    def _load_scattered(self, g: WorkerGroup, x: _Transfer) -> None:
        """A finished load transfer: pages not in ``handle.failed`` are in their blocks."""
        if not x.slots_released:
            x.slots_released = True
            self._release(g, x.slots)
        failed = set(x.handle.failed or ())
        jobs = set()
        for i, page in enumerate(x.loads):
            job = self._jobs[page.job_id]
            jobs.add(page.job_id)
            job.moving -= 1
            res = page.res
            if i in failed:
                msg = "section checksum mismatch after the copy to the device (blocks left untouched)"
                if g.root_metrics is not None:
                    g.root_metrics.failure("checksum")
                self._discard_later(g, res.key, msg)
                self._fail(job, g.index, res.key, "checksum", msg)
            else:
                if not res.verified:  # the tier metrics count it as a hit only now
                    if g.root_metrics is not None:
                        g.root_metrics.hit(g.tokens_per_page, res.nbytes, res.seconds)
                    elif isinstance(g.engine, TierChain):
                        g.engine.confirm_page(res.key, res.nbytes, res.seconds)
                job.nbytes += res.nbytes
                self.counters["load_pages_ok"] += 1
                self.counters["load_bytes"] += res.nbytes
        for job_id in jobs:
            self._maybe_finish(self._jobs[job_id])

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
                self._store_queue[g.index].append(_StorePage(job_id, key, tokens, row[None, :], now))
            self._pump_stores(g)
            # pages of this job that found no free slot now (each counted once)
            self.counters["store_deferrals"] += sum(1 for p in self._store_queue[g.index] if p.job_id == job_id)
        self._maybe_finish(job)
        return True

    def _pump_stores(self, g: WorkerGroup, *, only: set[int] | None = None, slot_wait_s: float = 0.0,
                     drop_reason: str | None = None) -> None:
        """Start gathers of queued store pages into free staging slots (oldest first).

        Never waits unless ``slot_wait_s`` > 0 (then at most that long per batch for a slot and
        room in the transfer scratch). A page left in the queue keeps its blocks fenced by vLLM
        until its job completes (see docs/DESIGN.md section 8), so deferring it to a later step
        is safe. ``only``: just these jobs' pages (a flush fence); ``drop_reason``: pages that
        still get no slot are dropped and counted under it.
        """
        self._poll_transfers(g)  # finished gathers free scratch rows (and submit their slots)
        queue = self._store_queue[g.index]
        if not queue:
            return
        now = time.monotonic()
        keep: deque[_StorePage] = deque()
        todo: list[_StorePage] = []
        for page in queue:
            if only is not None and page.job_id not in only:
                keep.append(page)
            elif now - page.queued > self.defer_limit_s:
                self._drop_store(g, page, "deferred_too_long")
            else:
                todo.append(page)
        pos = 0
        while pos < len(todo):
            end = time.monotonic() + slot_wait_s
            want = self._max_batch(g, len(todo) - pos)
            started = False
            while True:
                left = end - time.monotonic()
                first = g.engine.acquire_slot(timeout=left) if left > 0 else g.engine.acquire_slot(0)
                if first is None:
                    break
                slots = [first]
                while len(slots) < want:
                    more = g.engine.acquire_slot(0)
                    if more is None:
                        break
                    slots.append(more)
                batch = todo[pos : pos + len(slots)]
                if self._start_store(g, batch, slots):
                    pos += len(slots)
                    started = True
                    break
                # the transfer scratch is full: give the slots back; retry while the budget lasts
                self._release(g, slots)
                if time.monotonic() >= end:
                    break
                time.sleep(0.001)
                self._poll_transfers(g)
            if not started:
                break
        rest = todo[pos:]
        if rest and drop_reason is not None:
            for page in rest:
                self._drop_store(g, page, drop_reason)
            rest = []
        # ``keep`` and ``rest`` are both in arrival order; keep-then-rest is FIFO enough
        self._store_queue[g.index] = deque([*keep, *rest]) if keep else deque(rest)
        self._poll_transfers(g)  # CPU transfers are complete already: submit them now
        for job_id in {p.job_id for p in todo}:
            job = self._jobs.get(job_id)
            if job is not None:
                self._maybe_finish(job)

    def _start_store(self, g: WorkerGroup, batch: list[_StorePage], slots: list[Any]) -> bool:
        """Start one gather of ``batch`` into ``slots``. False: no scratch room (nothing changed)."""
        rows = self._batch_rows(batch)
        try:
            h = g.transfer.start_store(rows, slots)
        except Exception as e:  # noqa: BLE001 - fail these pages, keep the slots and the step
            self._release(g, slots)
            for page in batch:
                job = self._jobs[page.job_id]
                job.waiting -= 1
                self._fail(job, g.index, page.key, "transfer", f"gather failed: {e!r}")
            return True
        if h is None:
            return False
        self._transfers[g.index][id(h)] = _Transfer(h, list(slots), stores=list(batch))
        for page in batch:
            job = self._jobs[page.job_id]
            job.waiting -= 1
            job.moving += 1
        self.counters["store_batches"] += 1
        return True

    def _drop_store(self, g: WorkerGroup, page: _StorePage, reason: str) -> None:
        job = self._jobs[page.job_id]
        job.waiting -= 1
        job.failed.append((g.index, page.key, "store_dropped"))
        self.counters[f"store_dropped:{reason}"] += 1
        logger.debug("tierstore: store of page %s.. (group %d) dropped: %s", page.key.hex()[:16], g.index, reason)

    def pump_stores(self) -> None:
        """Start gathers of deferred store pages while slots are free (never waits)."""
        for g in self.groups:
            self._pump_stores(g)

    def deferred_store_pages(self) -> int:
        return sum(len(q) for q in self._store_queue.values())

    # ------------------------------------------------------------ loads
    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        # ``expedited`` (vLLM 0.33: the step waits for this load) needs no special path: pages are
        # read by the engine's threads and scattered from get_finished either way.
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
        slot until its transfer has copied it, so never ask for more than are free)."""
        queue = self._load_queue[g.index]
        # The engine skips the section checksums when the transfer checks them on the GPU; a
        # fixup rewrites the slot before the transfer sees it, so then the engine verifies.
        verify = g.fixup is not None or not g.transfer.checksums_on_gpu
        while queue and g.engine.free_slots > 0:
            job_id, key, row = queue.popleft()
            job = self._jobs[job_id]
            job.waiting -= 1
            eid = g.engine.submit_load(key, verify=verify)
            job.pending.add((g.index, eid))
            self._by_engine_job[(g.index, eid)] = (job_id, row)

    def _start_loads(self, g: WorkerGroup) -> None:
        """Start transfers of the pages read so far (batched); scratch full: retry next time."""
        ready = self._load_ready[g.index]
        while ready:
            batch: list[_LoadPage] = []
            want = self._max_batch(g, len(ready))
            while ready and len(batch) < want:
                page = ready.popleft()
                job = self._jobs[page.job_id]
                if job.failed:  # the job is lost anyway: skip the copy
                    g.engine.release_slot(page.res.slot)
                    job.moving -= 1
                    self._maybe_finish(job)
                    continue
                batch.append(page)
            if not batch:
                return
            slots = [p.res.slot for p in batch]
            try:
                if g.fixup is not None:
                    for p in batch:
                        if not p.fixed:
                            g.fixup.before_scatter(p.res.slot.tensor)
                            p.fixed = True
                expect = [None if p.res.verified else p.res.sums for p in batch]
                rows = self._batch_rows(batch)
                h = g.transfer.start_load(slots, rows,
                                          expect=None if all(e is None for e in expect) else expect)
            except Exception as e:  # noqa: BLE001 - fail these pages, keep the slots and the step
                self._release(g, slots)
                for p in batch:
                    job = self._jobs[p.job_id]
                    job.moving -= 1
                    self._fail(job, g.index, p.res.key, "transfer", f"scatter failed: {e!r}")
                    self._maybe_finish(job)
                continue
            if h is None:
                ready.extendleft(reversed(batch))
                return
            self._transfers[g.index][id(h)] = _Transfer(h, slots, loads=batch)

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
                    if res.verified:  # unverified: counted once the GPU has checked it
                        m.hit(g.tokens_per_page, res.nbytes, res.seconds)
                elif res.stored:
                    m.stored(res.nbytes, res.seconds)
            elif res.error is not None and res.error.kind == "missing":
                m.miss(g.tokens_per_page)
            else:
                m.failure(res.error.kind if res.error is not None else "error")
        if res.op == "load":
            if res.ok and res.slot is not None:
                if job.failed:  # the job is lost anyway: skip the copy
                    g.engine.release_slot(res.slot)
                elif self._closed:
                    g.engine.release_slot(res.slot)
                    self._fail(job, g.index, res.key, "cancelled", "the worker is shutting down")
                else:
                    assert rows is not None
                    job.moving += 1
                    self._load_ready[g.index].append(_LoadPage(job_id, res, rows))
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
        if job.pending or job.waiting or job.moving or self._jobs.get(job.job_id) is not job:
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

    def _poll_group(self, g: WorkerGroup) -> None:
        for res in g.engine.poll():
            self._on_result(g, res)
        self._start_loads(g)
        self._poll_transfers(g)  # after the starts: CPU transfers are complete already
        self._pump(g)
        self._pump_stores(g)

    def get_finished(self) -> list[TransferResult]:
        for g in self.groups:
            self._poll_group(g)
        out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        """vLLM's fence before it reuses the blocks of these (store) jobs: gather their deferred
        pages now, waiting at most ``fence_slot_wait_s`` per batch for a slot; what still gets
        no slot is dropped (counted ``store_dropped:fence``). Then the current CUDA stream waits
        (on the GPU, the host does not) for the gathers of these jobs still running, so work
        queued after this call cannot overwrite the blocks before they were read. Finished
        gathers no longer read vLLM's blocks, so nothing else needs waiting for."""
        only = set(job_ids)
        for g in self.groups:
            if any(p.job_id in only for p in self._store_queue[g.index]):
                self._pump_stores(g, only=only, slot_wait_s=self.fence_slot_wait_s, drop_reason="fence")
            stream = None
            for x in self._transfers[g.index].values():
                if x.stores and any(p.job_id in only for p in x.stores) and not x.handle.blocks_free():
                    if stream is None and g.device.type == "cuda":
                        stream = torch.cuda.current_stream(g.device)
                    x.handle.blocks_wait_on(stream)  # until the gather read them (CPU: never running)

    def engine_stats(self) -> dict[str, Any]:
        return {f"g{g.index}": g.engine.stats for g in self.groups}

    def flush(self, timeout: float | None) -> bool:
        """Wait until every queued store has reached the disk (or failed). Blocks on the GPU for
        started transfers (the only place besides ``shutdown`` that does)."""
        end = None if timeout is None else time.monotonic() + timeout
        done = True
        for g in self.groups:
            while self._store_queue[g.index]:
                left = 1.0 if end is None else end - time.monotonic()
                if left <= 0:
                    break
                for res in g.engine.poll():
                    self._on_result(g, res)
                self._start_loads(g)
                self._poll_transfers(g, block=True)  # a full scratch frees (a bounded GPU wait)
                self._pump_stores(g, slot_wait_s=min(left, 0.1))
            if self._store_queue[g.index]:
                self._pump_stores(g, drop_reason="flush_timeout")
                done = False
            # gathers already started finish (a bounded GPU wait) and go to the page store
            self._poll_transfers(g, block=True)
        for g in self.groups:
            left = None if end is None else max(0.0, end - time.monotonic())
            done = g.engine.flush(left) and done
        return done

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True  # load pages read from now on are released, not copied
        t0 = time.monotonic()
        if not self.flush(self.flush_timeout_s):
            logger.warning("tierstore: stores still queued after flush_timeout_s=%.1f s are dropped",
                           self.flush_timeout_s)
        for g in self.groups:
            for res in g.engine.poll():
                self._on_result(g, res)
            self._poll_transfers(g, block=True)  # load transfers: their slots come back
            while self._load_ready[g.index]:
                page = self._load_ready[g.index].popleft()
                g.engine.release_slot(page.res.slot)
                job = self._jobs[page.job_id]
                job.moving -= 1
                self._fail(job, g.index, page.res.key, "cancelled", "the worker is shutting down")
                self._maybe_finish(job)
            g.engine.close(max(0.0, self.flush_timeout_s - (time.monotonic() - t0)))
