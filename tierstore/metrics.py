"""Per-tier counters and latency histograms, exportable as plain dicts.

Contract: one ``TierMetrics`` per tier name ("host", "local", "shared"; a single-tier store
uses "root") inside a ``MetricsRegistry``. Every tier object of every KV-cache group that
shares a registry adds into the same ``TierMetrics``, so a snapshot gives per-tier totals
for the whole process. ``MetricsRegistry.snapshot()`` returns JSON-ready dicts; adapters
(vLLM connector stats, Prometheus) read snapshots and must not reach into the objects.

Counters (all monotonically increasing except the two gauges):
    hits / misses                keys looked up and found / not found (clean misses)
    hit_tokens / miss_tokens     the same in tokens
    stores / stored_bytes        pages written (new files) and their page bytes (the layout's
                                 payload size, headers not counted; evicted_bytes are file sizes)
    bytes_read                   page bytes served from this tier
    failures[kind]               typed failures by ``PageError.kind`` (checksum, timeout,
                                 enospc, io, queue_full, down, ...); a miss is not a failure
    evictions / evicted_bytes    pages removed to keep the tier under its cap
    promotions                   pages copied into this tier from a slower one
    backlog_uploads              (shared) pages uploaded later: the local tier took them while
                                 the shared tier was down or busy (tiers.chain)
    used_bytes / cap_bytes       gauges: current accounting and cap (None = no cap)
Histograms (seconds): ``load`` and ``store`` per tier, fixed log-spaced buckets.

Threading: every method is thread-safe (one lock per object); updates are O(1).
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from typing import Any

# Upper bounds (seconds) of the latency buckets: 50 us .. 60 s, roughly x2.5 apart.
LATENCY_BUCKETS: tuple[float, ...] = (
    5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)


class Histogram:
    """Cumulative-on-export histogram of durations in seconds."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = tuple(buckets)
        self._counts = [0] * (len(self.buckets) + 1)  # last slot = +Inf
        self._sum = 0.0
        self._count = 0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        i = bisect.bisect_left(self.buckets, seconds)
        with self._lock:
            self._counts[i] += 1
            self._sum += seconds
            self._count += 1

    def to_dict(self) -> dict[str, Any]:
        """Prometheus-style: ``buckets`` maps each upper bound ("+Inf" last) to a cumulative count."""
        with self._lock:
            counts, total, n = list(self._counts), self._sum, self._count
        cumulative, acc = {}, 0
        for le, c in zip([*map(repr, self.buckets), "+Inf"], counts, strict=True):
            acc += c
            cumulative[le] = acc
        return {"count": n, "sum": total, "buckets": cumulative}

    def quantile(self, q: float) -> float | None:
        """Upper bound of the bucket holding quantile ``q`` (None when empty)."""
        with self._lock:
            counts, n = list(self._counts), self._count
        if n == 0:
            return None
        target, acc = q * n, 0
        for i, c in enumerate(counts):
            acc += c
            if acc >= target:
                return self.buckets[i] if i < len(self.buckets) else float("inf")
        return float("inf")


_COUNTERS = (
    "hits", "misses", "hit_tokens", "miss_tokens", "stores", "stored_bytes", "bytes_read",
    "evictions", "evicted_bytes", "promotions", "backlog_uploads",
)


COUNTER_NAMES: tuple[str, ...] = _COUNTERS  # public name (exporters declare one metric per counter)


class TierMetrics:
    """Counters, gauges and histograms of one tier (see the module docstring)."""

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self._lock = threading.Lock()
        self._c: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self._failures: dict[str, int] = defaultdict(int)
        self.used_bytes: int | None = None
        self.cap_bytes: int | None = None
        self.load_latency = Histogram()
        self.store_latency = Histogram()

    def add(self, name: str, n: int = 1) -> None:
        if name not in self._c:
            raise KeyError(f"unknown counter {name!r}; known: {_COUNTERS}")
        with self._lock:
            self._c[name] += n

    def hit(self, tokens: int, nbytes: int, seconds: float | None = None) -> None:
        with self._lock:
            self._c["hits"] += 1
            self._c["hit_tokens"] += tokens
            self._c["bytes_read"] += nbytes
        if seconds is not None:
            self.load_latency.observe(seconds)

    def miss(self, tokens: int) -> None:
        with self._lock:
            self._c["misses"] += 1
            self._c["miss_tokens"] += tokens

    def stored(self, nbytes: int, seconds: float | None = None) -> None:
        with self._lock:
            self._c["stores"] += 1
            self._c["stored_bytes"] += nbytes
        if seconds is not None:
            self.store_latency.observe(seconds)

    def failure(self, kind: str) -> None:
        with self._lock:
            self._failures[kind] += 1

    def evicted(self, count: int, nbytes: int) -> None:
        with self._lock:
            self._c["evictions"] += count
            self._c["evicted_bytes"] += nbytes

    def set_capacity(self, used: int | None, cap: int | None) -> None:
        with self._lock:
            self.used_bytes, self.cap_bytes = used, cap

    def get(self, name: str) -> int:
        with self._lock:
            return self._c[name]

    def failures(self) -> dict[str, int]:
        with self._lock:
            return dict(self._failures)

    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self._c)
            out["failures"] = dict(self._failures)
            out["used_bytes"] = self.used_bytes
            out["cap_bytes"] = self.cap_bytes
        out["load_seconds"] = self.load_latency.to_dict()
        out["store_seconds"] = self.store_latency.to_dict()
        return out


class MetricsRegistry:
    """Named ``TierMetrics``; one per process by default (``default_registry()``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tiers: dict[str, TierMetrics] = {}

    def tier(self, name: str) -> TierMetrics:
        with self._lock:
            m = self._tiers.get(name)
            if m is None:
                m = self._tiers[name] = TierMetrics(name)
            return m

    def names(self) -> list[str]:
        with self._lock:
            return list(self._tiers)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """``{tier name: TierMetrics.to_dict()}``, JSON-serializable."""
        with self._lock:
            tiers = list(self._tiers.values())
        return {m.tier: m.to_dict() for m in tiers}


_DEFAULT = MetricsRegistry()


def default_registry() -> MetricsRegistry:
    return _DEFAULT
