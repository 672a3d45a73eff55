"""LoadPipeline: one group's pages from page files into vLLM's KV blocks.

A page's journey, in the order of the methods below:

1. ``add``: the page (key, kernel block ids) joins the queue.
2. ``pump``: one read per page is queued in the page store while it has free staging slots (a
   read holds its slot until the transfer has copied it, so never more than are free), with
   ``verify=False`` when the transfer checks the section checksums on the GPU (not with a
   fix-up: it rewrites the slot before the transfer sees it, so then the store verifies).
3. ``on_result``: the store read the page into a slot (or failed: the page fails). A page of a
   job that is lost already is not copied.
4. ``start_transfers``: the pages read so far are copied to their blocks in batches
   (``PageTransfer.start_load``, with the header's sums to check for unverified pages); with
   no scratch room they wait for the next call. The ``TransferPoller`` hands each slot back
   as soon as the transfer no longer reads it (``slots_free``).
5. ``_scattered`` (the poller calls it when the transfer finished): a page that failed the GPU
   check left its blocks untouched and fails; the verdict on every unverified page goes to the
   store that served it (``PageStore.settle``: it counts the hit, or removes the damaged file).
   The other pages are in their blocks: done.

A job with any failed page (missing, truncated, corrupt, checksum, foreign, timed out, ...)
completes with ``success=False`` (``JobTracker``); vLLM then recomputes the request. A job is
never reported while a transfer of its pages is still running (its blocks could be reused).

Threading: the vLLM worker thread only; the page store's I/O threads touch the slots only.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

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
class LoadPage:
    job_id: int
    key: bytes
    row: torch.Tensor  # [1, kernel blocks per page], CPU int64
    res: IOResult | None = None  # the store's OK result (holds the slot), once read
    fixed: bool = False  # fixup.before_scatter already applied to the slot


class LoadPipeline:
    """file -> slot -> verify -> scatter for one group; see the module docstring."""

    def __init__(self, g: WorkerGroup, poller: TransferPoller, jobs: JobTracker, counters: Counter[str], *,
                 batch_limit: int | None = None) -> None:
        self.g = g
        self.poller = poller
        self.jobs = jobs
        self.counters = counters
        self.batch_limit = batch_limit  # pages per transfer at most (None: the transfer scratch)
        self.closed = False  # shutting down: pages read from now on are released, not copied
        self.queue: deque[LoadPage] = deque()  # waiting for a staging slot in the store
        self.ready: deque[LoadPage] = deque()  # read (slot held), waiting for transfer scratch
        self._by_store_job: dict[int, LoadPage] = {}  # page store job id -> page

    # ------------------------------------------------------------ 1-2. queue, read
    def add(self, job_id: int, key: bytes, row: torch.Tensor) -> None:
        """Queue one page of ``job_id`` (the caller told the tracker to ``expect`` it)."""
        self.queue.append(LoadPage(job_id, key, row))

    def pump(self) -> None:
        """Queue reads of waiting pages while the page store has free staging slots."""
        g = self.g
        verify = g.fixup is not None or not g.transfer.checksums_on_gpu
        while self.queue and g.store.free_slots > 0:
            page = self.queue.popleft()
            self._by_store_job[g.store.submit_load(page.key, verify=verify)] = page

    def pending(self) -> int:
        """Pages submitted to the page store whose result has not come back."""
        return len(self._by_store_job)

    # ------------------------------------------------------------ 3. read into a slot
    def on_result(self, res: IOResult) -> None:
        """The page store read one page into a slot (or failed)."""
        g = self.g
        page = self._by_store_job.pop(res.job_id, None)
        if page is None:
            if res.slot is not None:
                g.store.release_slot(res.slot)
            return
        if not (res.ok and res.slot is not None):
            err = res.error
            self.jobs.page_failed(page.job_id, g.index, res.key, err.kind if err else "error", str(err))
        elif self.jobs.is_lost(page.job_id):  # the job is lost anyway: skip the copy
            g.store.release_slot(res.slot)
            self.jobs.page_skipped(page.job_id)
        elif self.closed:
            g.store.release_slot(res.slot)
            self.jobs.page_failed(page.job_id, g.index, res.key, "cancelled", "the worker is shutting down")
        else:
            page.res = res
            self.ready.append(page)

    # ------------------------------------------------------------ 4. slot -> device
    def start_transfers(self) -> None:
        """Start transfers of the pages read so far (batched); scratch full: retry next time."""
        while self.ready:
            batch = self._next_batch()
            if not batch:
                return
            if not self._start_scatter(batch):
                self.ready.extendleft(reversed(batch))
                return

    def _next_batch(self) -> list[LoadPage]:
        batch: list[LoadPage] = []
        want = max_batch(self.g, len(self.ready), self.batch_limit)
        while self.ready and len(batch) < want:
            page = self.ready.popleft()
            if self.jobs.is_lost(page.job_id):  # the job is lost anyway: skip the copy
                self.g.store.release_slot(page.res.slot)
                self.jobs.page_skipped(page.job_id)
                continue
            batch.append(page)
        return batch

    def _start_scatter(self, batch: list[LoadPage]) -> bool:
        """Start one transfer of ``batch``. False: no scratch room (nothing changed)."""
        g = self.g
        batch.sort(key=lambda p: slot_address(p.res.slot))  # adjacent slots: one copy (PageTransfer)
        slots = [p.res.slot for p in batch]
        try:
            if g.fixup is not None:
                for p in batch:
                    if not p.fixed:
                        g.fixup.before_scatter(p.res.slot.tensor)
                        p.fixed = True
            expect = [None if p.res.verified else p.res.sums for p in batch]
            h = g.transfer.start_load(slots, stack_rows([p.row for p in batch]),
                                      expect=None if all(e is None for e in expect) else expect)
        except Exception as e:  # noqa: BLE001 - fail these pages, keep the slots and the step
            g.release(slots)
            for p in batch:
                self.jobs.page_failed(p.job_id, g.index, p.key, "transfer", f"scatter failed: {e!r}")
            return True
        if h is None:
            return False
        self.poller.track(h, slots, batch, self, self._scattered, release_slots_early=True)
        return True

    # ------------------------------------------------------------ 5. verify, in the blocks
    def _scattered(self, x: StartedTransfer) -> None:
        """A finished load transfer: pages not in ``handle.failed`` are in their blocks."""
        g = self.g
        failed = set(x.handle.failed or ())
        for i, page in enumerate(x.pages):
            res = page.res
            ok = i not in failed
            if not res.verified:  # the GPU checked it: the serving store settles it
                self._settle(res, ok)
            if ok:
                self.counters["load_pages_ok"] += 1
                self.counters["load_bytes"] += res.nbytes
                self.jobs.page_done(page.job_id, res.nbytes)
            else:
                msg = "section checksum mismatch after the copy to the device (blocks left untouched)"
                self.jobs.page_failed(page.job_id, g.index, res.key, "checksum", msg)

    def _settle(self, res: IOResult, ok: bool) -> None:
        g = self.g
        reason = "" if ok else "section checksum mismatch after the copy to the device"
        g.store.settle(res, ok, reason)

    # ------------------------------------------------------------ shutdown
    def cancel_ready(self) -> None:
        """Shutdown: pages read but not started go back (their jobs fail: cancelled)."""
        while self.ready:
            page = self.ready.popleft()
            self.g.store.release_slot(page.res.slot)
            self.jobs.page_failed(page.job_id, self.g.index, page.key, "cancelled", "the worker is shutting down")
