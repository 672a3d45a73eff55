"""Worker side of the tierstore offloading spec: KV blocks <-> canonical page files.

``TierStoreWorker`` implements vLLM's ``OffloadingWorker`` for one worker (rank). It turns
vLLM's transfer specs into pages and hands them, per offloaded KV-cache group, to that
group's pipelines (``tierstore.vllm.pipelines``), and answers vLLM from a ``JobTracker``:

- ``submit_store``: each page (key, kernel block ids) goes to the group's ``StorePipeline``
  (gather -> staging slot -> page file: ``store_pipeline.py``); it never waits for a slot.
- ``submit_load``: each page goes to the group's ``LoadPipeline`` (page file -> slot ->
  verify -> scatter: ``load_pipeline.py``).
- ``get_finished``: advances every group's pipelines (``GroupPipelines.step``) and returns the
  jobs the tracker saw finish; failed load pages are left in ``failed_loads`` for the
  scheduler (the connector reads them).
- ``wait``: vLLM's fence before it reuses the blocks of store jobs (``StorePipeline.fence``).
- ``flush``/``shutdown``: drain started transfers (the only places that block on the GPU),
  wait up to ``flush_timeout_s`` for queued stores, then close the page stores.

Threading: every method runs on the vLLM worker thread; the page stores' I/O threads never
touch vLLM tensors (they read and write staging slots only). Nothing here synchronizes the
host with the GPU except ``flush``/``shutdown``: transfers are polled.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from tierstore.vllm.group import WorkerGroup, kernel_rows
from tierstore.vllm.jobs import JobTracker
from tierstore.vllm.manager import TierStoreFileSpec
from tierstore.vllm.pipelines import GroupPipelines

logger = logging.getLogger("tierstore.vllm")

__all__ = ["TierStoreWorker", "WorkerGroup"]


class TierStoreWorker(OffloadingWorker):
    def __init__(self, groups: list[WorkerGroup], flush_timeout_s: float, defer_limit_s: float = 10.0,
                 fence_slot_wait_s: float = 0.05) -> None:
        self.groups = groups
        self.flush_timeout_s = flush_timeout_s
        self.fence_slot_wait_s = fence_slot_wait_s  # the most a flush fence waits for one slot
        self.counters: Counter[str] = Counter()
        self.jobs = JobTracker(self.counters, [g.vllm_group_id for g in groups])
        # a deferred store page older than defer_limit_s is dropped
        self.pipelines = [GroupPipelines(g, self.jobs, self.counters, defer_limit_s=defer_limit_s)
                          for g in groups]
        self._closed = False

    @property
    def failed_loads(self) -> list[tuple[int, int, bytes, str]]:
        """Pages of failed load jobs: (job, vLLM group, key, kind); the connector clears it."""
        return self.jobs.failed_loads

    # ------------------------------------------------------------ spec -> pages
    @staticmethod
    def _split(spec: GPULoadStoreSpec) -> list[tuple[list[int], int]]:
        """Per group (block ids, logical index of the first block)."""
        out, pos = [], 0
        ids = spec.block_ids.tolist()
        for n, first in zip(spec.group_sizes, spec.block_indices, strict=True):
            out.append((ids[pos : pos + n], int(first)))
            pos += n
        return out

    @staticmethod
    def _pages_by_group(spec: TierStoreFileSpec) -> dict[int, list[tuple[bytes, int]]]:
        by: dict[int, list[tuple[bytes, int]]] = {}
        for g, key, tokens in zip(spec.groups, spec.keys, spec.token_counts, strict=True):
            by.setdefault(g, []).append((key, tokens))
        return by

    # ------------------------------------------------------------ stores
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, TierStoreFileSpec)
        self.jobs.open(job_id, is_load=False)
        pages = self._pages_by_group(dst_spec)
        for p, (block_ids, _first) in zip(self.pipelines, self._split(src_spec), strict=True):
            g, todo = p.g, pages.get(p.g.index, [])
            if not todo or not g.stores_pages:  # no pages, or another rank writes them
                continue
            if len(block_ids) != len(todo) * g.blocks_per_chunk:
                for key, _ in todo:
                    self.jobs.record_failure(job_id, g.index, key, "layout",
                                             f"{len(block_ids)} blocks for {len(todo)} pages of "
                                             f"{g.blocks_per_chunk} blocks")
                continue
            self.jobs.expect(job_id, len(todo))
            for (key, tokens), row in zip(todo, kernel_rows(g, block_ids, len(todo)), strict=True):
                p.stores.add(job_id, key, tokens, row[None, :])
            p.stores.pump()
            # pages of this job that found no free slot now (each counted once)
            self.counters["store_deferrals"] += p.stores.queued(job_id)
        self.jobs.seal(job_id)
        return True

    def pump_stores(self) -> None:
        """Start gathers of deferred store pages while slots are free (never waits)."""
        for p in self.pipelines:
            p.stores.pump()

    def deferred_store_pages(self) -> int:
        return sum(p.stores.queued() for p in self.pipelines)

    # ------------------------------------------------------------ loads
    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        # ``expedited`` (vLLM 0.33: the step waits for this load) needs no special path: pages are
        # read by the page store's threads and scattered from get_finished either way.
        assert isinstance(src_spec, TierStoreFileSpec)
        self.jobs.open(job_id, is_load=True, keys=list(zip(src_spec.groups, src_spec.keys, strict=True)))
        pages = self._pages_by_group(src_spec)
        for p, (block_ids, first) in zip(self.pipelines, self._split(dst_spec), strict=True):
            g, todo = p.g, pages.get(p.g.index, [])
            if not todo and not block_ids:
                continue
            bpc = g.blocks_per_chunk
            if first % bpc or len(block_ids) != len(todo) * bpc:
                # A window that starts inside a page (validation rules it out): recompute.
                msg = f"{len(block_ids)} blocks from logical block {first} for {len(todo)} pages of {bpc}"
                for key in [k for k, _ in todo] or [None]:
                    self.jobs.record_failure(job_id, g.index, key, "partial_chunk", msg)
                continue
            self.jobs.expect(job_id, len(todo))
            for (key, _), row in zip(todo, kernel_rows(g, block_ids, len(todo)), strict=True):
                p.loads.add(job_id, key, row[None, :])
            p.loads.pump()
        self.jobs.seal(job_id)
        return True

    # ------------------------------------------------------------ vLLM's polls and fences
    def get_finished(self) -> list[TransferResult]:
        for p in self.pipelines:
            p.step()
        return [TransferResult(j.job_id, j.success, j.nbytes, j.seconds) for j in self.jobs.take_finished()]

    def wait(self, job_ids: set[int]) -> None:
        """vLLM's fence before it reuses the blocks of these (store) jobs: their deferred pages
        are gathered now or dropped (``store_dropped:fence``), and the current CUDA stream
        waits (on the GPU) for their running gathers; see ``StorePipeline.fence``."""
        only = set(job_ids)
        for p in self.pipelines:
            p.stores.fence(only, self.fence_slot_wait_s)

    def engine_stats(self) -> dict[str, Any]:
        return {f"g{g.index}": g.store.stats for g in self.groups}

    def flush(self, timeout: float | None) -> bool:
        """Wait until every queued store has reached the disk (or failed) and its job is resolved
        (reported at the next ``get_finished``). Blocks on the GPU for started transfers (the only
        place besides ``shutdown`` that does)."""
        end = None if timeout is None else time.monotonic() + timeout
        done = True
        for p in self.pipelines:
            done = p.flush_stores(end) and done
        for g in self.groups:
            left = None if end is None else max(0.0, end - time.monotonic())
            done = g.store.flush(left) and done
        for p in self.pipelines:
            p.route_results()  # the stores waited for resolve their jobs now, not at the next step
        return done

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for p in self.pipelines:
            p.loads.closed = True  # load pages read from now on are released, not copied
        t0 = time.monotonic()
        if not self.flush(self.flush_timeout_s):
            logger.warning("tierstore: stores still queued after flush_timeout_s=%.1f s are dropped",
                           self.flush_timeout_s)
        for p in self.pipelines:
            p.close(max(0.0, self.flush_timeout_s - (time.monotonic() - t0)))
