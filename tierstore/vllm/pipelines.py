"""GroupPipelines: the store and load pipelines of one KV-cache group, driven together.

Both pipelines share the group's page store (whose ``poll`` returns results of either) and its
``PageTransfer`` (polled by one ``TransferPoller``). ``step`` advances both without blocking:
route the store's results, start the load transfers of pages read, finish completed
transfers (after the starts: CPU transfers are complete already), queue more reads, start
more gathers. ``flush_stores`` and ``close`` are the only calls that block on the GPU.

Used by ``TierStoreWorker`` (one per group) and by the benchmarks (``tierstore.bench``), so the
protocol between transfers and page stores is written once.

Threading: the vLLM worker thread (or a benchmark's driving thread) only.
"""

from __future__ import annotations

import time
from collections import Counter

from tierstore.kernels.transfer import PageTransfer
from tierstore.vllm.group import TransferPoller, WorkerGroup
from tierstore.vllm.jobs import JobTracker
from tierstore.vllm.load_pipeline import LoadPipeline
from tierstore.vllm.store_pipeline import StorePipeline


class GroupPipelines:
    """One group's ``StorePipeline`` and ``LoadPipeline``; see the module docstring."""

    def __init__(self, g: WorkerGroup, jobs: JobTracker, counters: Counter[str], *, defer_limit_s: float,
                 batch_limit: int | None = None) -> None:
        if g.transfer is None:
            g.transfer = PageTransfer(g.copier, g.device)
        self.g = g
        self.poller = TransferPoller(g)
        self.stores = StorePipeline(g, self.poller, jobs, counters, defer_limit_s=defer_limit_s,
                                    batch_limit=batch_limit)
        self.loads = LoadPipeline(g, self.poller, jobs, counters, batch_limit=batch_limit)

    def route_results(self) -> None:
        """Hand each finished page-store job to the pipeline that submitted it."""
        for res in self.g.store.poll():
            (self.loads if res.op == "load" else self.stores).on_result(res)

    def step(self) -> None:
        """Advance both pipelines without blocking."""
        self.route_results()
        self.loads.start_transfers()
        self.poller.poll()  # after the starts: CPU transfers are complete already
        self.loads.pump()
        self.stores.pump()

    def idle(self) -> bool:
        """Nothing queued, read, in transfer or in the page store for either pipeline."""
        s, ld = self.stores, self.loads
        return not (s.queue or s.pending() or ld.queue or ld.ready or ld.pending() or len(self.poller))

    def flush_stores(self, end: float | None) -> bool:
        """Start every queued store page, waiting on the GPU for scratch room until ``end``
        (``time.monotonic()``; None: no limit); what is left then is dropped
        (``store_dropped:flush_timeout``). Started transfers finish; gathered pages go to the
        page store. False if pages were dropped."""
        while self.stores.queue:
            left = 1.0 if end is None else end - time.monotonic()
            if left <= 0:
                break
            self.route_results()
            self.loads.start_transfers()  # read pages hold slots: copy them so the slots return
            self.poller.poll(block=True)  # a full scratch frees (a bounded GPU wait)
            self.stores.pump(slot_wait_s=min(left, 0.1))
        done = not self.stores.queue
        if not done:
            self.stores.pump(drop_reason="flush_timeout")
        self.poller.poll(block=True)
        return done

    def close(self, timeout: float) -> None:
        """Shutdown after ``flush_stores``: loads read from now on are released, not copied;
        started transfers finish (their slots come back); then the page store closes."""
        self.loads.closed = True
        self.route_results()
        self.poller.poll(block=True)
        self.loads.cancel_ready()
        self.g.store.close(timeout)
