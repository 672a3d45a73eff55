"""StorePipeline: one group's pages from vLLM's KV blocks to page files.

A page's journey, in the order of the methods below:

1. ``add``: the page (key, tokens, kernel block ids) joins the queue; nothing is copied yet.
2. ``pump``: free staging slots are taken (never waiting unless told) and a gather of the
   oldest queued pages into them is started (``PageTransfer.start_store``: on CUDA a side
   stream, after the forward work already queued; on CPU at once). Pages that find no slot or
   no room in the transfer's scratch stay queued, oldest first, for the next pump; one older
   than ``defer_limit_s`` is dropped.
3. ``_gathered`` (the ``TransferPoller`` calls it when the gather finished): each slot goes to
   the page store with ``submit_store`` and the section checksums the GPU computed
   (``handle.sums``; None on CPU, or after a fix-up: the store hashes). The store owns the slot
   from there.
4. ``on_result``: the store's result resolves the page in the ``JobTracker`` (done or failed).

Why deferring is safe: vLLM keeps a store job's blocks valid until the job is reported
complete, and before it reuses such blocks it calls ``fence(job_ids)`` (vLLM's ``wait``, its
``jobs_to_flush``): the job's queued pages are gathered then, waiting at most ``slot_wait_s``
for a slot, or dropped; and the current CUDA stream is made to wait (on the GPU) for the
job's gathers still reading blocks. Dropped pages and failed writes are counted: a missing
page is only a future miss.

Threading: the vLLM worker thread only; the page store's I/O threads touch the slots only.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

import torch

from tierstore.kernels.transfer import slot_address, stack_rows
from tierstore.store import IOResult
from tierstore.vllm.group import (
    StartedTransfer,
    TransferPoller,
    WorkerGroup,
    max_batch,
)
from tierstore.vllm.jobs import JobTracker


@dataclass
class StorePage:
    job_id: int
    key: bytes
    tokens: int
    row: torch.Tensor  # [1, kernel blocks per page], CPU int64
    queued: float  # time.monotonic() when queued


class StorePipeline:
    """gather -> slot -> file for one group; see the module docstring."""

    def __init__(self, g: WorkerGroup, poller: TransferPoller, jobs: JobTracker, counters: Counter[str], *,
                 defer_limit_s: float, batch_limit: int | None = None) -> None:
        self.g = g
        self.poller = poller
        self.jobs = jobs
        self.counters = counters
        self.defer_limit_s = defer_limit_s  # a queued page older than this is dropped
        self.batch_limit = batch_limit  # pages per gather at most (None: the transfer scratch)
        self.queue: deque[StorePage] = deque()  # waiting for a slot / scratch room, oldest first
        self._by_store_job: dict[int, StorePage] = {}  # page store job id -> page

    # ------------------------------------------------------------ 1. queue
    def add(self, job_id: int, key: bytes, tokens: int, row: torch.Tensor) -> None:
        """Queue one page of ``job_id`` (the caller told the tracker to ``expect`` it)."""
        self.queue.append(StorePage(job_id, key, tokens, row, time.monotonic()))

    def queued(self, job_id: int | None = None) -> int:
        return len(self.queue) if job_id is None else sum(1 for p in self.queue if p.job_id == job_id)

    def pending(self) -> int:
        """Pages submitted to the page store whose result has not come back."""
        return len(self._by_store_job)

    # ------------------------------------------------------------ 2. gather into slots
    def pump(self, *, only: set[int] | None = None, slot_wait_s: float = 0.0,
             drop_reason: str | None = None) -> None:
        """Start gathers of queued pages into free staging slots (oldest first).

        Never waits unless ``slot_wait_s`` > 0 (then at most that long per batch for a slot and
        room in the transfer scratch). ``only``: just these jobs' pages (a fence);
        ``drop_reason``: pages that still get no slot are dropped and counted under it.
        """
        self.poller.poll()  # finished gathers free scratch rows (and submit their slots)
        if not self.queue:
            return
        keep, todo = self._take(only)
        pos = 0
        while pos < len(todo):
            started = self._start_one(todo[pos:], slot_wait_s)
            if not started:
                break
            pos += started
        rest = todo[pos:]
        if rest and drop_reason is not None:
            for page in rest:
                self.jobs.page_dropped(page.job_id, self.g.index, page.key, drop_reason)
            rest = []
        # ``keep`` and ``rest`` are both in arrival order; keep-then-rest is FIFO enough
        self.queue = deque([*keep, *rest])
        self.poller.poll()  # CPU transfers are complete already: submit them now

    def _take(self, only: set[int] | None) -> tuple[list[StorePage], list[StorePage]]:
        """Split the queue into pages to keep (other jobs) and pages to start; drop stale ones."""
        now = time.monotonic()
        keep: list[StorePage] = []
        todo: list[StorePage] = []
        for page in self.queue:
            if only is not None and page.job_id not in only:
                keep.append(page)
            elif now - page.queued > self.defer_limit_s:
                self.jobs.page_dropped(page.job_id, self.g.index, page.key, "deferred_too_long")
            else:
                todo.append(page)
        return keep, todo

    def _start_one(self, todo: list[StorePage], slot_wait_s: float) -> int:
        """Start one gather of the first pages of ``todo``; how many started (0: no slot or no
        scratch room within ``slot_wait_s``)."""
        g = self.g
        end = time.monotonic() + slot_wait_s
        want = max_batch(g, len(todo), self.batch_limit)
        while True:
            left = end - time.monotonic()
            first = g.store.acquire_slot(timeout=left) if left > 0 else g.store.acquire_slot(0)
            if first is None:
                return 0
            slots = [first]
            while len(slots) < want:
                more = g.store.acquire_slot(0)
                if more is None:
                    break
                slots.append(more)
            slots.sort(key=slot_address)  # adjacent slots: one copy (PageTransfer)
            if self._start_gather(todo[: len(slots)], slots):
                return len(slots)
            # the transfer scratch is full: give the slots back; retry while the budget lasts
            g.release(slots)
            if time.monotonic() >= end:
                return 0
            time.sleep(0.001)
            self.poller.poll()

    def _start_gather(self, batch: list[StorePage], slots: list[Any]) -> bool:
        """Start one gather of ``batch`` into ``slots``. False: no scratch room (nothing changed)."""
        try:
            h = self.g.transfer.start_store(stack_rows([p.row for p in batch]), slots)
        except Exception as e:  # noqa: BLE001 - fail these pages, keep the slots and the step
            self.g.release(slots)
            for page in batch:
                self.jobs.page_failed(page.job_id, self.g.index, page.key, "transfer", f"gather failed: {e!r}")
            return True
        if h is None:
            return False
        self.poller.track(h, slots, batch, self, self._gathered)
        self.counters["store_batches"] += 1
        return True

    # ------------------------------------------------------------ 3. slot -> page store
    def _gathered(self, x: StartedTransfer) -> None:
        """A finished gather: submit each slot's page to the page store (which owns the slot then)."""
        g = self.g
        sums = x.handle.sums
        for j, (page, slot) in enumerate(zip(x.pages, x.slots, strict=True)):
            try:
                if g.fixup is not None:
                    g.fixup.after_gather(slot.tensor)  # the GPU sums (if any) are of the unfixed bytes
                page_sums = sums[j] if sums and g.fixup is None else None
                store_job = g.store.submit_store(page.key, slot, page.tokens, sums=page_sums)
            except Exception as e:  # noqa: BLE001 - one bad page must not take the step down
                g.store.release_slot(slot)
                self.jobs.page_failed(page.job_id, g.index, page.key, "error", f"submit failed: {e!r}")
                continue
            self._by_store_job[store_job] = page

    # ------------------------------------------------------------ 4. the file is written
    def on_result(self, res: IOResult) -> None:
        """The page store finished writing one page (or failed)."""
        page = self._by_store_job.pop(res.job_id, None)
        if page is None:
            return
        if res.ok:
            self.counters["store_pages_ok" if res.stored else "store_pages_existing"] += 1
            self.counters["store_bytes"] += res.nbytes if res.stored else 0
            self.jobs.page_done(page.job_id, res.nbytes)
        else:
            err = res.error
            self.jobs.page_failed(page.job_id, self.g.index, res.key, err.kind if err else "error", str(err))

    # ------------------------------------------------------------ fence
    def fence(self, job_ids: set[int], slot_wait_s: float) -> None:
        """vLLM is about to reuse these jobs' blocks: gather their queued pages now (waiting at
        most ``slot_wait_s`` per batch for a slot, else dropped: ``store_dropped:fence``), then
        make the current CUDA stream wait (on the GPU; the host does not) for their gathers
        still reading blocks. Finished gathers no longer read vLLM's blocks."""
        if any(p.job_id in job_ids for p in self.queue):
            self.pump(only=job_ids, slot_wait_s=slot_wait_s, drop_reason="fence")
        stream = None
        for x in self.poller.started(self):
            if any(p.job_id in job_ids for p in x.pages) and not x.handle.blocks_free():
                if stream is None and self.g.device.type == "cuda":
                    stream = torch.cuda.current_stream(self.g.device)
                x.handle.blocks_wait_on(stream)  # until the gather read them (CPU: never running)
