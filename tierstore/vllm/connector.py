"""TierStoreConnector: vLLM's OffloadingConnector with tierstore pages on disk.

Configuration (the whole contract with the user)::

    KVTransferConfig(kv_connector="TierStoreConnector", kv_connector_module_path="tierstore.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"root": "/path/to/cache"})

Every other ``kv_connector_extra_config`` key is a ``TierStoreConfig`` setting (validated,
unknown keys rejected). The class keeps vLLM's offloading scheduler (hybrid hit planning: full
attention prefix, sliding windows, Mamba align boundary states, minimum across groups; its
per-key prefix loop replaced by one call, ``TierStoreConnectorScheduler``) and replaces three
things:

1. the spec: ``TierStoreOffloadingSpec`` (lookups from in-memory indexes of the disk tiers,
   ``manager.py``; worker = GroupCopier +
   IOEngine per group), built here from vLLM's config with tierstore's chunking;
2. load failures: vLLM's stock worker asserts that every transfer succeeded. Here a failed load
   job is reported at request level in ``failed_recving`` (vLLM 0.32 refuses block-level
   ``invalid_block_ids`` for multi-group models) and ``kv_load_failure_policy`` is forced to
   "recompute", so the scheduler recomputes the request and never marks the blocks computed;
   the failed keys travel back in the worker metadata so the retried lookup misses them.
   Inside vLLM's ``MultiConnector`` the scheduler reads the outer config's policy, which also
   governs the other connectors: the start is refused unless it says "recompute"
   (``tierstore.vllm.multi``);
3. stores are submitted at the end of the step that computed them (``wait_for_save``), not at
   the start of the next step, and the worker flushes its engines at shutdown: a request with
   ``max_tokens=1`` followed by engine exit is stored.

Stats: ``get_kv_connector_stats`` adds tierstore's adapter counters and (worker side) the
per-tier metrics to vLLM's ``OffloadingConnectorStats``; ``build_prom_metrics`` exports them
(``tierstore.vllm.stats``). Importing this module registers ``TierStoreConnector`` in vLLM's
connector registry, where MultiConnector's statistics look children up by class name.

Threading: vLLM calls each role's methods from one thread (scheduler or worker).
"""

from __future__ import annotations

import atexit
import copy
import logging
import threading
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_offload.base import GPULoadStoreSpec, make_offload_key
from vllm.v1.outputs import KVConnectorOutput

from tierstore.config import TierStoreConfig
from tierstore.format.identity import page_file_size, write_manifest
from tierstore.metrics import default_registry
from tierstore.tiers.factory import root_tier_name
from tierstore.vllm.manager import TierStoreManager
from tierstore.vllm.multi import (
    check_failure_policy,
    enclosing_transfer_config,
    register_with_factory,
)
from tierstore.vllm.namespace import build_namespace
from tierstore.vllm.scheduler import TierStoreConnectorScheduler
from tierstore.vllm.siblings import start_check
from tierstore.vllm.spec import TierStoreOffloadingSpec
from tierstore.vllm.stats import (
    TierDeltas,
    TierStorePromMetrics,
    accumulate,
    add_adapter_counters,
    add_index_residency,
)
from tierstore.vllm.stop import stop_warnings, sweep_at_start
from tierstore.vllm.validation import offloaded_block_sizes, validate_engine
from tierstore.vllm.worker import TierStoreWorker

logger = logging.getLogger("tierstore.vllm")



def start_root_chores(root: str, namespace: Any, local_root: str | None, deadline_s: float) -> threading.Thread:
    """The scheduler's start-up writes under the root, on a daemon thread (a hung export must
    not keep vLLM from starting): the namespace manifest (``write_manifest``), then the sweep of
    stale temps (``sweep_at_start``, a walk of the namespace). Waits up to ``deadline_s`` (the
    shared tier's ``shared_deadline_s``) for the manifest: an error within it is raised here, as
    before (a root that is not ours, a symlinked directory); past it vLLM starts and its
    lookups miss until the indexes have listed the root (as during any index loading), the
    thread going on alone and logging what happens. The sweep never waits and never raises."""
    manifest_done = threading.Event()
    waited_out = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            write_manifest(root, namespace)
        except Exception as exc:  # handed to the constructor, or logged once it gave up waiting
            failure.append(exc)
            manifest_done.set()
            if waited_out.is_set():
                logger.warning("tierstore: writing the namespace manifest under %s failed: %s", root, exc)
            return
        manifest_done.set()
        if waited_out.is_set():
            logger.warning("tierstore: the root %s answers again: namespace manifest written", root)
        try:
            sweep_at_start(root, namespace.digest, local_root)
        except Exception as exc:  # noqa: BLE001 - a sweep is housekeeping, never a failed start
            logger.warning("tierstore: the start-up sweep of stale temp files under %s failed: %s", root, exc)

    thread = threading.Thread(target=run, name="tierstore-root-start", daemon=True)
    thread.start()
    if not manifest_done.wait(deadline_s):
        waited_out.set()
        if not manifest_done.is_set():
            logger.warning("tierstore: the root %s did not answer within %.1f s (shared_deadline_s) while writing the "
                           "namespace manifest; vLLM starts anyway, its lookups miss until the root answers", root,
                           deadline_s)
            return thread
    if failure:
        raise failure[0]
    return thread


@dataclass
class TierStoreWorkerMetadata(OffloadingWorkerMetadata):
    """Completed jobs (vLLM's) plus the offload keys whose load failed, with the error kind."""

    failed_keys: list[tuple[bytes, str]] = field(default_factory=list)

    def aggregate(self, other: Any) -> Any:
        merged = OffloadingWorkerMetadata.aggregate(self, other)
        assert isinstance(merged, OffloadingWorkerMetadata)
        extra = list(self.failed_keys) + list(getattr(other, "failed_keys", []))
        return TierStoreWorkerMetadata(merged.completed_jobs, merged.transfer_stats, extra)


def _shutdown_ref(ref: weakref.ReferenceType[TierStoreWorker]) -> None:
    worker = ref()
    if worker is not None:
        worker.shutdown()


class TierStoreConnectorWorker(OffloadingConnectorWorker):
    """vLLM's connector worker with failure-tolerant completion and immediate stores."""

    spec: TierStoreOffloadingSpec

    def __init__(self, spec: TierStoreOffloadingSpec, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig):
        super().__init__(spec, vllm_config, kv_cache_config)
        self._failed_recving: set[str] = set()
        self._failed_keys: list[tuple[bytes, str]] = []
        self._reported: Counter[str] = Counter()

    @property
    def ts_worker(self) -> TierStoreWorker:
        assert isinstance(self.worker, TierStoreWorker), "register_kv_caches has not run yet"
        return self.worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker = self.spec.build_worker(kv_caches)
        atexit.register(_shutdown_ref, weakref.ref(self.worker))

    def prepare_store_kv(self, metadata: OffloadingConnectorMetadata) -> None:
        # Submit now (the blocks are gathered into staging at once), not at the next step's
        # start: a step that never comes (engine exit) would lose them.
        for job_id, entry in metadata.store_jobs.items():
            if not self._is_store_writer:
                self._connector_worker_meta.mark_completed(job_id)
                continue
            assert isinstance(entry.src_spec, GPULoadStoreSpec)
            self.ts_worker.submit_store(job_id, entry.src_spec, entry.dst_spec)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        # vLLM's fence first (jobs_to_flush -> worker.wait: deferred pages of blocks about to be
        # reused are gathered or dropped), then, before this step's forward, whatever store
        # pages earlier steps had to defer for want of a staging slot.
        super().handle_preemptions(kv_connector_metadata)
        if isinstance(self.worker, TierStoreWorker):
            self.worker.pump_stores()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        finished_recving: set[str] = set()
        worker = self.ts_worker
        for result in worker.get_finished():
            job_id = result.job_id
            is_load = job_id in self._load_jobs
            if result.transfer_time is not None and result.transfer_size is not None and result.success:
                stats = self._connector_worker_meta.transfer_stats
                (stats.load if is_load else stats.store).record(result.transfer_size, result.transfer_time)
            self._connector_worker_meta.mark_completed(job_id)
            req_id = self._load_jobs.pop(job_id, None)
            if req_id is not None:
                finished_recving.add(req_id)
                if not result.success:
                    self._failed_recving.add(req_id)
                    logger.warning("tierstore: request %s: KV load failed, its prompt is recomputed", req_id)
        for _job, vllm_group, key, kind in worker.failed_loads:
            self._failed_keys.append((bytes(make_offload_key(key, vllm_group)), kind))
        worker.failed_loads.clear()
        return set(), finished_recving

    def take_failed_recving(self) -> set[str]:
        out, self._failed_recving = self._failed_recving, set()
        return out

    def build_connector_worker_meta(self) -> OffloadingWorkerMetadata | None:
        meta = super().build_connector_worker_meta()
        if not self._failed_keys:
            return meta
        failed, self._failed_keys = self._failed_keys, []
        if meta is None:
            return TierStoreWorkerMetadata(failed_keys=failed)
        return TierStoreWorkerMetadata(meta.completed_jobs, meta.transfer_stats, failed)

    def stats_delta(self) -> Counter[str]:
        """Worker counters since the last call."""
        now = Counter(self.ts_worker.counters) if isinstance(self.worker, TierStoreWorker) else Counter()
        delta = now - self._reported
        self._reported = now
        return delta


class TierStoreConnector(OffloadingConnector):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        kv_transfer_config = vllm_config.kv_transfer_config
        assert kv_transfer_config is not None
        if role == KVConnectorRole.SCHEDULER:
            self._recompute_failed_loads(kv_transfer_config)
        extra = dict(kv_transfer_config.kv_connector_extra_config or {})
        self.ts_config = TierStoreConfig.from_dict(extra)
        chunk_tokens = validate_engine(vllm_config, kv_cache_config, self.ts_config)
        offloading_config = self._offloading_config(vllm_config, kv_cache_config, chunk_tokens)
        self.namespace = build_namespace(vllm_config, kv_cache_config, offloading_config, self.ts_config)
        spec = TierStoreOffloadingSpec(offloading_config, self.ts_config, self.namespace, vllm_config, kv_cache_config,
                                       staging_slots=self.ts_config.staging_slots)
        self.spec = spec
        self._tier_deltas = TierDeltas(default_registry().snapshot())
        # running totals of what this side reported through get_kv_connector_stats (tests, debugging)
        self.reported_totals: dict[str, float] = {}
        self._canonical_layout = False
        self.connector_scheduler: OffloadingConnectorScheduler | None = None
        self.connector_worker: OffloadingConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            for warning in stop_warnings(vllm_config, self.ts_config.flush_timeout_s):
                logger.warning(warning)
            if self.ts_config.root is not None:  # (only a bucket: its tier writes the manifest object)
                start_root_chores(self.ts_config.root, self.namespace, self.ts_config.local_root,
                                  self.ts_config.shared_deadline_s)
                # other namespaces of this model under the root (a fleet whose nodes differ in a
                # setting shares no pages): said once, from a daemon thread (siblings.py)
                start_check(self.ts_config.root, self.namespace)
            self.connector_scheduler = TierStoreConnectorScheduler(spec, vllm_config, kv_cache_config)
            self._reported_sched: Counter[str] = Counter()
            self._reported_resident: dict[str, list[int]] = {}
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = TierStoreConnectorWorker(spec, vllm_config, kv_cache_config)
        logger.info("tierstore: %s side, namespace %s under %s, %d groups, %d tokens per page",
                    role.name.lower(), self.namespace.digest, self.ts_config.root or self.ts_config.object_url,
                    len(self.namespace.groups), chunk_tokens)

    @staticmethod
    def _recompute_failed_loads(kv_transfer_config: Any) -> None:
        """A page that fails to load must cost a recompute, never a failed request: vLLM's
        scheduler decides by ``kv_load_failure_policy``. Alone, tierstore sets it on the config
        it is given (the engine's). Inside a MultiConnector the scheduler reads the outer config,
        whose policy also governs the partner's failures: checked before any start-up work,
        refused unless it is "recompute" (``tierstore/vllm/multi.py``)."""
        outer = enclosing_transfer_config()
        if outer is not None:
            check_failure_policy(outer)
        elif kv_transfer_config.kv_load_failure_policy != "recompute":
            logger.info("tierstore: setting kv_load_failure_policy='recompute' (was %r)",
                        kv_transfer_config.kv_load_failure_policy)
            kv_transfer_config.kv_load_failure_policy = "recompute"

    @staticmethod
    def _offloading_config(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, chunk_tokens: int) -> Any:
        """vLLM's offloading config with tierstore's chunking (vLLM derives per-group windows
        from it), built from a shallow copy of the config whose extra_config vLLM understands."""
        block = max(offloaded_block_sizes(kv_cache_config).values())
        ktc = copy.copy(vllm_config.kv_transfer_config)
        assert ktc is not None
        ktc.kv_connector_extra_config = {"blocks_per_chunk": chunk_tokens // block}
        shadow = copy.copy(vllm_config)
        shadow.kv_transfer_config = ktc
        return build_offloading_config(shadow, kv_cache_config)

    # ------------------------------------------------------------ worker side
    @property
    def ts_worker(self) -> TierStoreConnectorWorker:
        assert isinstance(self.connector_worker, TierStoreConnectorWorker)
        return self.connector_worker

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        finished_sending, finished_recving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(finished_sending or ()),
            finished_recving=set(finished_recving or ()),
            failed_recving=self.ts_worker.take_failed_recving(),
        )

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every store submitted so far is on disk (worker side)."""
        w = self.ts_worker.worker
        return w.flush(self.ts_config.flush_timeout_s if timeout is None else timeout) if isinstance(w, TierStoreWorker) else True

    # ------------------------------------------------------------ scheduler side
    @property
    def ts_manager(self) -> TierStoreManager:
        manager = self.scheduler.manager
        assert isinstance(manager, TierStoreManager)
        return manager

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if connector_output.failed_recving and isinstance(self.connector_scheduler, TierStoreConnectorScheduler):
            self.connector_scheduler.restart_stores(connector_output.failed_recving)
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, TierStoreWorkerMetadata) and meta.failed_keys:
            for key, kind in meta.failed_keys:
                self.ts_manager.mark_failed(key, kind)  # type: ignore[arg-type]
        super().update_connector_output(connector_output)

    # ------------------------------------------------------------ stats
    def tierstore_stats(self) -> dict[str, Any]:
        """Counters of this side (scheduler: lookups/hits; worker: pages, bytes, failures by kind)."""
        if self.connector_scheduler is not None:
            return dict(self.ts_manager.counters)
        w = self.ts_worker.worker
        if isinstance(w, TierStoreWorker):
            return {**w.counters, "engines": w.engine_stats(), "tiers": default_registry().snapshot()}
        return {}

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """vLLM's offloading stats plus tierstore's adapter counters (both roles) and, on the
        worker, the per-tier metrics (``tierstore.vllm.stats``); increments since the last call."""
        stats = super().get_kv_connector_stats()
        out = stats if isinstance(stats, OffloadingConnectorStats) else OffloadingConnectorStats()
        if self.connector_scheduler is not None:
            now = Counter(self.ts_manager.counters)
            delta = now - self._reported_sched
            self._reported_sched = now
            add_adapter_counters(out, delta)
            resident = self.ts_manager.pages.resident  # replaced after each listing of the page index
            if resident is not self._reported_resident:
                self._reported_resident = resident
                sizes = [page_file_size(self.namespace, i) for i in range(len(self.namespace.groups))]
                add_index_residency(out, resident, sizes, {"shared": root_tier_name(self.ts_config)})
        else:
            add_adapter_counters(out, self.ts_worker.stats_delta())
            self._tier_deltas.add_to(out, default_registry().snapshot())
        if out.is_empty():
            return stats
        accumulate(self.reported_totals, out)
        return out

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: Any, labelnames: Any,
                           per_engine_labelvalues: Any) -> Any:
        return TierStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


# vLLM resolves connectors by name where it has no module path (MultiConnector's statistics in
# the API server): registered when this module is imported (tierstore/vllm/multi.py).
register_with_factory()
