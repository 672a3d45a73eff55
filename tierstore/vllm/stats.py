"""tierstore's metrics in vLLM's connector stats and Prometheus exporter.

Contract: every metric tierstore puts into vLLM's ``OffloadingConnectorStats`` is declared in
``metric_definitions()`` (name, type, label names; docs/METRICS.md is the reference and
``tests/test_metrics_names.py`` keeps the two equal); ``TierStorePromMetrics`` (vLLM's
``OffloadPromMetrics`` plus these definitions) exports them. Names follow Prometheus'
conventions: base units (seconds, bytes), the unit last, counters declared with ``_total``
(prometheus_client exposes it once), one family per concept with labels. Three sources:

- adapter counters (``TierStoreWorker.counters`` / ``TierStoreManager.counters``, keys
  ``name`` or ``name:label``) -> the families of ``add_adapter_counters`` (``ADAPTER_FAMILIES``);
- per-tier metrics (``tierstore.metrics`` registry snapshots) -> ``tierstore_tier_*{tier}``
  through ``TierDeltas``, which turns successive snapshots into increments. Histogram
  increments are replayed per bucket as that bucket's new samples, each at their mean
  (``Histogram`` keeps per-bucket sums): bucket counts and ``_sum`` are exact (up to float
  rounding), with no samples kept;
- the scheduler's page index (``IndexedLookup.resident``) -> the residency gauges of the
  root tier ("root", or "shared" in a chain) through ``add_index_residency``.

The up gauge ``tierstore_tier_up{tier}`` (1: serves, 0: down; registry ``up``: the minimum over
the process's tier objects) is the minimum over the worker processes (ranks): vLLM merges the
ranks' stats keeping one rank's gauge value, so ``TierDeltas`` reports it with a second label
value, the reporting process (``process_reporter``: host/pid), which vLLM keeps apart;
``TierStorePromMetrics`` remembers each reporter's last value per engine and tier and exports
the minimum under the declared label ``tier`` alone. Reported when it changes (and once at
the first report), with the engine's stats: an engine that runs no step reports nothing, so
the exported value is the one of its last step.

Who reports what (no double counting): counters and histograms of the registry come from the
worker side only (an in-process engine shares one registry between both roles; reporting it
twice would double count). Gauges are values, not increments: the residency and capacity of a
tier are set by exactly one owner - host and local by the worker (its host tier, its local
index: ``RESIDENCY_FROM_WORKER``), root/shared by the scheduler's page index (pages of this
engine's namespace; bytes as pages x the group's uncompressed page file size, exact for codec
"none", an upper bound with zstd). The capacity and the up state of every tier come from the
worker. Threading: called from vLLM's threads of one role; ``TierDeltas`` is not shared
between threads.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import prometheus_client
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
    OffloadPromMetrics,
)
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
)

from tierstore.metrics import LATENCY_BUCKETS

logger = logging.getLogger("tierstore.vllm")

PREFIX = "tierstore_"

# Adapter families: exported name -> (label names, documentation).
LOOKUPS = PREFIX + "lookups_total"
LOOKUP_PROBES = PREFIX + "lookup_probes_total"
PAGE_LOADS = PREFIX + "page_loads_total"
PAGE_STORES = PREFIX + "page_stores_total"
PAGE_FAILURES = PREFIX + "page_failures_total"
STORES_DROPPED = PREFIX + "page_stores_dropped_total"
PAGE_BYTES = PREFIX + "page_bytes_total"
LOAD_JOBS = PREFIX + "load_jobs_total"
STORE_BATCHES = PREFIX + "store_batches_total"
STORE_DEFERRALS = PREFIX + "store_deferrals_total"
PAGES_REFUSED = PREFIX + "pages_refused_total"

ADAPTER_FAMILIES: dict[str, tuple[tuple[str, ...], str]] = {
    LOOKUPS: (("result",), "Scheduler page lookups by answer: hit (load it), miss (compute it), retry "
              "(ask again next step: index still loading or a store being confirmed), skipped_failed "
              "(a miss because the page failed to load before). A key is asked again each step a "
              "request waits, so these count answers, not pages."),
    LOOKUP_PROBES: ((), "Keys looked up on disk by the background prober (one stat per tier)."),
    PAGE_LOADS: (("result",), "Pages the worker loaded into KV blocks: ok (verified and copied) or failed "
                 "(the request recomputes them; kinds in tierstore_page_failures_total)."),
    PAGE_STORES: (("result",), "Pages the worker was asked to store: written, existing (an identical page was "
                  "there), failed (kinds in tierstore_page_failures_total) or dropped (reasons in "
                  "tierstore_page_stores_dropped_total)."),
    PAGE_FAILURES: (("op", "kind"), "Failed page loads and stores the engine saw, by op (load, store) and "
                    "error kind (checksum, timeout, enospc, io, down, ...): each cost a recompute or a lost "
                    "page. Faults a tier had that another tier covered are in tierstore_tier_errors_total."),
    STORES_DROPPED: (("reason",), "Store pages dropped before they were written, by reason."),
    PAGE_BYTES: (("op",), "Page payload bytes moved between the engine and tierstore, by op (load, store)."),
    LOAD_JOBS: (("result",), "Load jobs (one per request restored): ok (every page loaded) or failed "
                "(a page failed; the request recomputes)."),
    STORE_BATCHES: ((), "Gathers of KV blocks into staging slots."),
    STORE_DEFERRALS: ((), "Store pages put off to a later step for want of a free staging slot."),
    PAGES_REFUSED: ((), "Pages neither looked up nor stored because their request may not be cached: no "
                     "cache_salt while require_cache_salt is set, or a cache_salt without a key in "
                     "tenant_key_files while encryption_key_file is set."),
}

# Adapter counter key (``name`` or ``name:label``) -> [(family, label values)]; "{}" is the key's label.
_ADAPTER_KEYS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "lookup_hits": ((LOOKUPS, ("hit",)),),
    "lookup_retries": ((LOOKUPS, ("retry",)),),
    "skipped_failed": ((LOOKUPS, ("skipped_failed",)),),
    "lookup_probes": ((LOOKUP_PROBES, ()),),
    "load_pages_ok": ((PAGE_LOADS, ("ok",)),),
    "load_failed": ((PAGE_LOADS, ("failed",)), (PAGE_FAILURES, ("load", "{}"))),
    "store_pages_ok": ((PAGE_STORES, ("written",)),),
    "store_pages_existing": ((PAGE_STORES, ("existing",)),),
    "store_failed": ((PAGE_STORES, ("failed",)), (PAGE_FAILURES, ("store", "{}"))),
    "store_dropped": ((PAGE_STORES, ("dropped",)), (STORES_DROPPED, ("{}",))),
    "load_bytes": ((PAGE_BYTES, ("load",)),),
    "store_bytes": ((PAGE_BYTES, ("store",)),),
    "load_jobs_ok": ((LOAD_JOBS, ("ok",)),),
    "load_jobs_failed": ((LOAD_JOBS, ("failed",)),),
    "store_batches": ((STORE_BATCHES, ()),),
    "store_deferrals": ((STORE_DEFERRALS, ()),),
    "pages_refused": ((PAGES_REFUSED, ()),),
}

# Tier families (registry snapshot -> exported), all labelled ``tier`` first.
TIER_LOADS = PREFIX + "tier_loads_total"
TIER_LOAD_TOKENS = PREFIX + "tier_load_tokens_total"
TIER_STORES = PREFIX + "tier_stores_total"
TIER_PAGE_BYTES = PREFIX + "tier_page_bytes_total"
TIER_ERRORS = PREFIX + "tier_errors_total"
TIER_EVICTIONS = PREFIX + "tier_evictions_total"
TIER_EVICTED_BYTES = PREFIX + "tier_evicted_bytes_total"
TIER_PROMOTIONS = PREFIX + "tier_promotions_total"
TIER_BACKLOG_UPLOADS = PREFIX + "tier_backlog_uploads_total"
TIER_RESIDENT_PAGES = PREFIX + "tier_resident_pages"
TIER_RESIDENT_BYTES = PREFIX + "tier_resident_bytes"
TIER_CAPACITY_BYTES = PREFIX + "tier_capacity_bytes"
TIER_UP = PREFIX + "tier_up"
TIER_LOAD_SECONDS = PREFIX + "tier_load_seconds"
TIER_LOAD_READ_SECONDS = PREFIX + "tier_load_read_seconds"
TIER_STORE_SECONDS = PREFIX + "tier_store_seconds"

# registry counter -> (family, extra label values after ``tier``)
_TIER_COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "hits": (TIER_LOADS, ("hit",)),
    "misses": (TIER_LOADS, ("miss",)),
    "hit_tokens": (TIER_LOAD_TOKENS, ("hit",)),
    "miss_tokens": (TIER_LOAD_TOKENS, ("miss",)),
    "stores": (TIER_STORES, ()),
    "bytes_read": (TIER_PAGE_BYTES, ("read",)),
    "stored_bytes": (TIER_PAGE_BYTES, ("write",)),
    "evictions": (TIER_EVICTIONS, ()),
    "evicted_bytes": (TIER_EVICTED_BYTES, ()),
    "promotions": (TIER_PROMOTIONS, ()),
    "backlog_uploads": (TIER_BACKLOG_UPLOADS, ()),
}
_TIER_HISTOGRAMS: dict[str, str] = {
    "load_seconds": TIER_LOAD_SECONDS, "load_read_seconds": TIER_LOAD_READ_SECONDS,
    "store_seconds": TIER_STORE_SECONDS,
}

TIER_FAMILIES: dict[str, tuple[str, tuple[str, ...], str]] = {  # name -> (type, labels, documentation)
    TIER_LOADS: ("counter", ("tier", "result"), "Page loads asked of the tier: hit (it served a verified page) "
                 "or miss (it has no such page; a chain asks the next tier)."),
    TIER_LOAD_TOKENS: ("counter", ("tier", "result"), "Tokens of the pages of tierstore_tier_loads_total."),
    TIER_STORES: ("counter", ("tier",), "Pages written to the tier (new files)."),
    TIER_PAGE_BYTES: ("counter", ("tier", "op"), "Page payload bytes (file header not counted) the tier served "
                      "(op=read) or wrote (op=write)."),
    TIER_ERRORS: ("counter", ("tier", "kind"), "Faults inside the tier by kind (checksum, timeout, enospc, down, "
                  "queue_full, index, ...), including ones another tier covered; a miss is not an error."),
    TIER_EVICTIONS: ("counter", ("tier",), "Pages evicted to keep the tier under its cap."),
    TIER_EVICTED_BYTES: ("counter", ("tier",), "File bytes evicted to keep the tier under its cap."),
    TIER_PROMOTIONS: ("counter", ("tier",), "Pages copied into the tier from a slower one."),
    TIER_BACKLOG_UPLOADS: ("counter", ("tier",), "Pages uploaded to the shared tier after it was down or busy "
                           "when they were stored."),
    TIER_RESIDENT_PAGES: ("gauge", ("tier",), "Page files the tier holds now (host, local: the whole tier; "
                          "root/shared: this engine's namespace, as of the page index's last listing)."),
    TIER_RESIDENT_BYTES: ("gauge", ("tier",), "File bytes the tier holds now (same scope as "
                          "tierstore_tier_resident_pages; root/shared: pages x uncompressed page file size)."),
    TIER_CAPACITY_BYTES: ("gauge", ("tier",), "The tier's cap in bytes (host_bytes, local_max_bytes, max_bytes)."),
    TIER_UP: ("gauge", ("tier",), "1 while the tier serves, 0 while it is down (its export hangs or is unmounted, a "
              "deadline passed, or it is still opening); shared and root tiers only. The minimum over the worker "
              "ranks and the tier objects of each: one rank's down tier reads 0."),
    TIER_LOAD_SECONDS: ("histogram", ("tier",), "Page load latency per tier, submit to verified page, seconds."),
    TIER_LOAD_READ_SECONDS: ("histogram", ("tier",), "The part of each page load an I/O thread spent reading and "
                             "checking the file (storage time; the rest of tierstore_tier_load_seconds is queue "
                             "wait), seconds."),
    TIER_STORE_SECONDS: ("histogram", ("tier",), "Page store latency per tier, submit to page on disk, seconds."),
}

# Tiers whose residency gauges the worker side owns (the scheduler's page index owns the root's).
RESIDENCY_FROM_WORKER: frozenset[str] = frozenset({"host", "local"})


def process_reporter() -> str:
    """The reporting process (host/pid), the second label value of ``TIER_UP`` in connector
    stats: one registry per process, whose ``up`` already covers every tier object of the
    process. Asked when a ``TierDeltas`` is made (in the worker, after a fork), never at import."""
    return f"{socket.gethostname()}/{os.getpid()}"


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """Every metric tierstore reports through vLLM's Prometheus exporter."""
    out: dict[str, OffloadingMetricMetadata] = {}
    for name, (labels, doc) in ADAPTER_FAMILIES.items():
        out[name] = OffloadingCounterMetadata(documentation=doc, labelnames=labels)
    for name, (kind, labels, doc) in TIER_FAMILIES.items():
        if kind == "counter":
            out[name] = OffloadingCounterMetadata(documentation=doc, labelnames=labels)
        elif kind == "gauge":
            out[name] = OffloadingGaugeMetadata(documentation=doc, labelnames=labels)
        else:
            out[name] = OffloadingHistogramMetadata(documentation=doc, labelnames=labels, buckets=LATENCY_BUCKETS)
    return out


def add_adapter_counters(stats: OffloadingConnectorStats, delta: Mapping[str, int]) -> None:
    """Adapter counter increments (``name`` or ``name:label``) into ``stats``. Lookup misses are
    the lookups no other answer counted (``lookups`` minus hits, retries and skipped_failed)."""
    for key, value in delta.items():
        name, _, label = key.partition(":")
        for family, labels in _ADAPTER_KEYS.get(name, ()):
            if value > 0:  # undeclared keys are skipped: Prometheus could not export them
                stats.increase_counter(family, value, tuple(label or "other" if v == "{}" else v for v in labels))
    misses = delta.get("lookups", 0) - sum(delta.get(k, 0) for k in ("lookup_hits", "lookup_retries", "skipped_failed"))
    if misses > 0:
        stats.increase_counter(LOOKUPS, misses, ("miss",))


def add_index_residency(stats: OffloadingConnectorStats, resident: Mapping[str, Sequence[int]],
                        page_file_bytes: Sequence[int], names: Mapping[str, str]) -> bool:
    """The page index's residency gauges: ``resident`` maps an index tier ("local", "shared") to
    page files per group, ``page_file_bytes`` a group's uncompressed page file size, ``names``
    an index tier to its metrics name ("shared" -> "root" for a lone root). Tiers whose
    residency the worker owns (``RESIDENCY_FROM_WORKER``) are left out. True if any was set."""
    added = False
    for index_tier, per_group in resident.items():
        tier = names.get(index_tier, index_tier)
        if tier in RESIDENCY_FROM_WORKER:
            continue
        stats.set_gauge(TIER_RESIDENT_PAGES, sum(per_group), (tier,))
        stats.set_gauge(TIER_RESIDENT_BYTES, sum(n * b for n, b in zip(per_group, page_file_bytes, strict=False)),
                        (tier,))
        added = True
    return added


def accumulate(totals: dict[str, float], stats: OffloadingConnectorStats) -> None:
    """Running totals of reported stats, keyed like ``OffloadingConnectorStats.reduce()``
    (counters and histogram ``_count``/``_sum`` add up, gauges keep the latest value); bounded
    memory, unlike aggregating the stats objects (histogram samples pile up)."""
    types = stats.data.get("types", {})
    for key, value in stats.reduce().items():
        name = key.split(":", 1)[0]
        if types.get(name) == "gauge":
            totals[key] = value
        else:
            totals[key] = totals.get(key, 0) + value


class TierDeltas:
    """Increments between successive ``MetricsRegistry.snapshot()`` results (worker side)."""

    def __init__(self, baseline: dict[str, dict[str, Any]] | None = None,
                 residency_tiers: frozenset[str] = RESIDENCY_FROM_WORKER, reporter: str | None = None) -> None:
        # baseline: the registry when reporting starts (a process-wide registry may already hold
        # the totals of an earlier engine in the same process)
        self._last: dict[str, dict[str, Any]] = dict(baseline or {})
        self._residency_tiers = residency_tiers
        self._reporter = process_reporter() if reporter is None else reporter
        self._up_sent: dict[str, int] = {}  # tier -> the up value last reported (not the baseline's)

    def add_to(self, stats: OffloadingConnectorStats, snapshot: dict[str, dict[str, Any]]) -> bool:
        """Add what changed since the previous call to ``stats``; True if anything was added."""
        added = False
        for tier, now in snapshot.items():
            before = self._last.get(tier, {})
            for name, (family, labels) in _TIER_COUNTERS.items():
                inc = int(now.get(name, 0)) - int(before.get(name, 0))
                if inc > 0:
                    stats.increase_counter(family, inc, (tier, *labels))
                    added = True
            old_f = before.get("failures", {})
            for kind, n in now.get("failures", {}).items():
                inc = int(n) - int(old_f.get(kind, 0))
                if inc > 0:
                    stats.increase_counter(TIER_ERRORS, inc, (tier, str(kind)))
                    added = True
            gauges = [("cap_bytes", TIER_CAPACITY_BYTES)]
            if tier in self._residency_tiers:
                gauges += [("used_bytes", TIER_RESIDENT_BYTES), ("resident_pages", TIER_RESIDENT_PAGES)]
            for key, family in gauges:
                value = now.get(key)
                if value is not None and value != before.get(key):
                    stats.set_gauge(family, value, (tier,))
                    added = True
            up = now.get("up")
            if up is not None and up != self._up_sent.get(tier):  # reported by this side at least once
                stats.set_gauge(TIER_UP, int(up), (tier, self._reporter))
                self._up_sent[tier] = int(up)
                added = True
            for key, family in _TIER_HISTOGRAMS.items():
                added = replay_histogram(stats, family, (tier,), now.get(key, {}), before.get(key, {})) or added
            self._last[tier] = now
        return added


def replay_histogram(stats: OffloadingConnectorStats, name: str, labels: tuple[str, ...], now: dict[str, Any],
                     before: dict[str, Any]) -> bool:
    """The samples a ``Histogram.to_dict`` gained since ``before``, as observations: per bucket,
    its new count of samples at their mean (clamped into the bucket), so the exported bucket
    counts and ``_sum`` equal the registry's. True if any was added."""
    cum_now, cum_before = now.get("buckets", {}), before.get("buckets", {})
    sums_now, sums_before = now.get("bucket_sums", {}), before.get("bucket_sums", {})
    prev_now = prev_before = 0
    lower = 0.0
    added = False
    for le, c in cum_now.items():
        b = cum_before.get(le, 0)
        inc = (c - prev_now) - (b - prev_before)
        prev_now, prev_before = c, b
        upper = float(le) if le != "+Inf" else float("inf")
        if inc > 0:
            mean = (float(sums_now.get(le, 0.0)) - float(sums_before.get(le, 0.0))) / inc
            mean = min(max(mean, lower), upper)  # float rounding must not move it to a neighbour
            for _ in range(inc):
                stats.observe_histogram(name, mean, labels)
            added = True
        lower = upper
    return added


class TierStorePromMetrics(OffloadPromMetrics):
    """vLLM's offloading Prometheus metrics plus tierstore's (``metric_definitions``).

    vLLM's own families (``vllm:kv_offload_*``, built by ``OffloadPromMetrics``) are created
    unregistered and registered at the first report: another offloading connector beside
    tierstore in a ``MultiConnector`` (vLLM's ``OffloadingConnector``, on GPUs) registers the same
    names when it is built, before or after tierstore, and prometheus_client refuses a name twice
    (``Duplicated timeseries``: the API server did not start). If any of those names is taken by
    then, they are the other connector's: tierstore keeps its figures in its own families
    (``tierstore_page_bytes_total``, ``tierstore_tier_*``) and drops its copies of vLLM's, logged
    once. Alone, tierstore exports both, vLLM's from its first report on. Metric classes that are
    not prometheus_client's (Ray's wrappers) are used as given."""

    def __init__(self, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        self._held: list[Any] = []  # vLLM's families, created unregistered (``_hold``)
        super().__init__(vllm_config, self._unregistered(metric_types), labelnames, per_engine_labelvalues)
        # tierstore's own families go to the registry at once, through the classes vLLM passed
        self._gauge_cls = metric_types[prometheus_client.Gauge]
        self._counter_cls = metric_types[prometheus_client.Counter]
        self._histogram_cls = metric_types[prometheus_client.Histogram]
        self._vllm_names = frozenset(self._offloading_metric_defs)
        # None until the first report; then whether vLLM's families are tierstore's to export
        self.exports_vllm_families: bool | None = None if self._held else True
        for name, metadata in metric_definitions().items():
            self._offloading_metric_metadata[name] = metadata
            self._offloading_metric_defs[name] = self._create_metric(name, metadata)
        # (engine, tier) -> reporter -> its last up value (``TIER_UP`` is their minimum)
        self._tier_up: dict[tuple[int, str], dict[str, float]] = {}

    def _unregistered(self, metric_types: dict[Any, Any]) -> dict[Any, Any]:
        out = dict(metric_types)
        for key, cls in metric_types.items():
            if isinstance(cls, type) and issubclass(cls, prometheus_client.metrics.MetricWrapperBase):
                out[key] = functools.partial(self._hold, cls)
        return out

    def _hold(self, cls: Any, *args: Any, **kwargs: Any) -> Any:
        metric = cls(*args, registry=None, **kwargs)
        self._held.append(metric)
        return metric

    def _register_vllm_families(self) -> bool:
        """Register the held families in the default registry, all or none; False when another
        connector holds one of their names."""
        done = []
        try:
            for metric in self._held:
                prometheus_client.REGISTRY.register(metric)
                done.append(metric)
        except ValueError as exc:  # prometheus_client's DuplicateTimeseries
            for metric in done:
                prometheus_client.REGISTRY.unregister(metric)
            logger.info("tierstore: vLLM's offload metrics (vllm:kv_offload_*) are exported by another "
                        "offloading connector of this engine (%s); tierstore's transfers are in its own "
                        "tierstore_* families", exc)
            return False
        return True

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        if self.exports_vllm_families is None:
            self.exports_vllm_families = self._register_vllm_families()
            if not self.exports_vllm_families:
                self._observe_deprecated_metrics = False  # vLLM's deprecated copies: the other's too
        # Undeclared names (e.g. from a newer adapter) are skipped: vLLM's exporter asserts on them.
        data = {k: v for k, v in transfer_stats_data.get("data", {}).items() if k in self._offloading_metric_defs
                and (self.exports_vllm_families or k not in self._vllm_names)}
        if TIER_UP in data:
            data[TIER_UP] = self._min_over_reporters(data[TIER_UP], engine_idx)
        super().observe({"types": transfer_stats_data.get("types", {}), "data": data}, engine_idx)

    def _min_over_reporters(self, values: Mapping[Any, Any], engine_idx: int) -> dict[tuple[str, ...], float]:
        """``{(tier, reporter): up}`` -> ``{(tier,): min over every reporter seen}`` (a value
        without a reporter counts as the reporter "")."""
        out: dict[tuple[str, ...], float] = {}
        for labels, value in values.items():
            tier, reporter = str(labels[0]), str(labels[1]) if len(labels) > 1 else ""
            seen = self._tier_up.setdefault((engine_idx, tier), {})
            seen[reporter] = value
            out[(tier,)] = min(seen.values())
        return out

    def reset(self) -> None:
        # vLLM 0.32's OffloadPromMetrics.observe calls self.reset(), which no base class defines
        # (an AttributeError on the first non-empty stats); Prometheus metrics keep no interval state.
        return

