"""tierstore's metrics in vLLM's connector stats and Prometheus exporter.

Contract: every metric tierstore puts into vLLM's ``OffloadingConnectorStats`` is declared in
``metric_definitions()`` (name, type, label names); ``TierStorePromMetrics`` (vLLM's
``OffloadPromMetrics`` plus these definitions) exports them. Two sources:

- adapter counters (``TierStoreWorker.counters`` / ``TierStoreManager.counters``, keys
  ``name`` or ``name:label``) -> ``tierstore_<name>`` counters (``kind`` / ``reason`` label);
- per-tier metrics (``tierstore.metrics`` registry snapshots: host / local / shared / root) ->
  ``tierstore_tier_<counter>{tier}``, ``tierstore_tier_failures{tier,kind}``, gauges
  ``tierstore_tier_used_bytes{tier}`` / ``tierstore_tier_cap_bytes{tier}`` and histograms
  ``tierstore_tier_{load,store}_seconds{tier}``. ``TierDeltas`` turns successive snapshots into
  increments. Histogram increments are replayed as one sample per observation at its bucket's
  upper bound (the registry keeps bucket counts, not samples): bucket counts are exact, the
  exported ``_sum`` is an upper bound.

Only the worker side reports tier metrics (an in-process engine shares one registry between
both roles; reporting it twice would double count). Threading: called from vLLM's threads of
one role; ``TierDeltas`` is not shared between threads.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

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

from tierstore.metrics import COUNTER_NAMES, LATENCY_BUCKETS

PREFIX = "tierstore_"

# Adapter counters: name -> (label name or None, documentation).
ADAPTERCOUNTER_NAMES: dict[str, tuple[str | None, str]] = {
    "lookups": (None, "Scheduler page lookups (answered from the in-memory page index)."),
    "lookup_hits": (None, "Scheduler page lookups that found the page."),
    "skipped_failed": (None, "Lookups answered as a miss because the page failed to load before."),
    "lookup_retries": (None, "Lookups answered 'ask again next step' (index still loading, or a store being confirmed)."),
    "lookup_probes": (None, "Keys looked up on disk by the background prober (one stat per tier)."),
    "load_pages_ok": (None, "Pages loaded, verified and copied into KV blocks."),
    "load_bytes": (None, "Page bytes loaded."),
    "load_jobs_ok": (None, "Load jobs (requests) restored completely."),
    "load_jobs_failed": (None, "Load jobs with a failed page (the request is recomputed)."),
    "load_failed": ("kind", "Failed page loads by error kind."),
    "store_pages_ok": (None, "Pages written."),
    "store_pages_existing": (None, "Pages not written because an identical page existed."),
    "store_bytes": (None, "Page bytes written."),
    "store_failed": ("kind", "Failed page stores by error kind."),
    "store_dropped": ("reason", "Store pages dropped before they were written, by reason."),
    "store_batches": (None, "Gathers of KV blocks into staging slots."),
    "store_deferrals": (None, "Store pages put off to a later step for want of a free staging slot."),
}

TIER_COUNTER_DOCS: dict[str, str] = {
    "hits": "Pages found in the tier.",
    "misses": "Pages looked for and not found in the tier.",
    "hit_tokens": "Tokens of the pages found in the tier.",
    "miss_tokens": "Tokens of the pages not found in the tier.",
    "stores": "Pages written to the tier.",
    "stored_bytes": "File bytes written to the tier.",
    "bytes_read": "Page bytes served from the tier.",
    "evictions": "Pages evicted to keep the tier under its cap.",
    "evicted_bytes": "Bytes evicted to keep the tier under its cap.",
    "promotions": "Pages copied into the tier from a slower one.",
    "backlog_uploads": "Pages uploaded to the shared tier after it was down or busy when they were stored.",
}


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """Every metric tierstore reports, for vLLM's Prometheus exporter."""
    out: dict[str, OffloadingMetricMetadata] = {}
    for name, (label, doc) in ADAPTERCOUNTER_NAMES.items():
        out[PREFIX + name] = OffloadingCounterMetadata(documentation=doc, labelnames=(label,) if label else ())
    for name in COUNTER_NAMES:
        out[f"{PREFIX}tier_{name}"] = OffloadingCounterMetadata(
            documentation=TIER_COUNTER_DOCS.get(name, name), labelnames=("tier",))
    out[f"{PREFIX}tier_failures"] = OffloadingCounterMetadata(
        documentation="Typed failures per tier (checksum, timeout, enospc, down, ...).", labelnames=("tier", "kind"))
    out[f"{PREFIX}tier_used_bytes"] = OffloadingGaugeMetadata(
        documentation="Bytes the tier holds (its capacity accounting).", labelnames=("tier",))
    out[f"{PREFIX}tier_cap_bytes"] = OffloadingGaugeMetadata(
        documentation="Capacity of the tier in bytes.", labelnames=("tier",))
    for op in ("load", "store"):
        out[f"{PREFIX}tier_{op}_seconds"] = OffloadingHistogramMetadata(
            documentation=f"Page {op} latency per tier, seconds.", labelnames=("tier",), buckets=LATENCY_BUCKETS)
    return out


def add_adapter_counters(stats: OffloadingConnectorStats, delta: Counter[str]) -> None:
    """Adapter counter increments (``name`` or ``name:label``) into ``stats``."""
    for key, value in delta.items():
        name, _, label = key.partition(":")
        spec = ADAPTERCOUNTER_NAMES.get(name)
        if spec is None or value <= 0:
            continue  # undeclared: Prometheus could not export it
        stats.increase_counter(PREFIX + name, value, (label or "other",) if spec[0] else ())


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
    """Increments between successive ``MetricsRegistry.snapshot()`` results."""

    def __init__(self, baseline: dict[str, dict[str, Any]] | None = None) -> None:
        # baseline: the registry when reporting starts (a process-wide registry may already hold
        # the totals of an earlier engine in the same process)
        self._last: dict[str, dict[str, Any]] = dict(baseline or {})

    def add_to(self, stats: OffloadingConnectorStats, snapshot: dict[str, dict[str, Any]]) -> bool:
        """Add what changed since the previous call to ``stats``; True if anything was added."""
        added = False
        for tier, now in snapshot.items():
            before = self._last.get(tier, {})
            for name in COUNTER_NAMES:
                inc = int(now.get(name, 0)) - int(before.get(name, 0))
                if inc > 0:
                    stats.increase_counter(f"{PREFIX}tier_{name}", inc, (tier,))
                    added = True
            old_f = before.get("failures", {})
            for kind, n in now.get("failures", {}).items():
                inc = int(n) - int(old_f.get(kind, 0))
                if inc > 0:
                    stats.increase_counter(f"{PREFIX}tier_failures", inc, (tier, str(kind)))
                    added = True
            for gauge in ("used_bytes", "cap_bytes"):
                value = now.get(gauge)
                if value is not None and value != before.get(gauge):
                    stats.set_gauge(f"{PREFIX}tier_{gauge}", value, (tier,))
                    added = True
            for op in ("load", "store"):
                added = self._histogram(stats, f"{PREFIX}tier_{op}_seconds", tier,
                                        now.get(f"{op}_seconds", {}), before.get(f"{op}_seconds", {})) or added
            self._last[tier] = now
        return added

    @staticmethod
    def _histogram(stats: OffloadingConnectorStats, name: str, tier: str, now: dict[str, Any],
                   before: dict[str, Any]) -> bool:
        cum_now = now.get("buckets", {})
        cum_before = before.get("buckets", {})
        prev_now = prev_before = 0
        added = False
        for le, c in cum_now.items():
            inc = (c - prev_now) - (cum_before.get(le, 0) - prev_before)
            prev_now, prev_before = c, cum_before.get(le, 0)
            bound = float(le) if le != "+Inf" else LATENCY_BUCKETS[-1] * 2
            for _ in range(max(inc, 0)):
                stats.observe_histogram(name, bound, (tier,))
                added = True
        return added


class TierStorePromMetrics(OffloadPromMetrics):
    """vLLM's offloading Prometheus metrics plus tierstore's (``metric_definitions``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name, metadata in metric_definitions().items():
            self._offloading_metric_metadata[name] = metadata
            self._offloading_metric_defs[name] = self._create_metric(name, metadata)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        # Undeclared names (e.g. from a newer adapter) are skipped: vLLM's exporter asserts on them.
        data = {k: v for k, v in transfer_stats_data.get("data", {}).items() if k in self._offloading_metric_defs}
        super().observe({"types": transfer_stats_data.get("types", {}), "data": data}, engine_idx)

    def reset(self) -> None:
        # vLLM 0.32's OffloadPromMetrics.observe calls self.reset(), which no base class defines
        # (an AttributeError on the first non-empty stats); Prometheus metrics keep no interval state.
        return
