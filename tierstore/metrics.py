"""Per-tier counters, gauges and latency histograms, exportable as plain dicts.

Contract: one ``TierMetrics`` per tier name ("host", "local", "shared"; a lone root uses
"root") inside a ``MetricsRegistry``. Every tier object of every KV-cache group that shares a
registry adds into the same ``TierMetrics``, so a snapshot gives per-tier totals for the whole
process. ``MetricsRegistry.snapshot()`` returns JSON-ready dicts; adapters (vLLM connector
stats, Prometheus: ``tierstore.vllm.stats``; docs/METRICS.md lists the exported names) read
snapshots and must not reach into the objects.

Byte meanings (one each, everywhere): ``stored_bytes`` / ``bytes_read`` are *page payload
bytes* (the layout's payload, the file's header not counted: what ``IOResult.nbytes`` says);
``evicted_bytes``, ``used_bytes`` (resident bytes) and ``cap_bytes`` are *file bytes* (what
counts against a cap; the host tier counts the bytes it keeps in memory).

Counters (monotonically increasing):
    hits / misses                page loads the tier served verified / had no page for
    hit_tokens / miss_tokens     the same in tokens
    stores / stored_bytes        pages written (new files) and their payload bytes
    bytes_read                   payload bytes of the pages the tier served
    failures[kind]               typed faults by ``PageError.kind`` (checksum, timeout,
                                 enospc, io, queue_full, down, ...); a miss is not a failure,
                                 except that a miss from a stale NFS handle is also ``estale``
    evictions / evicted_bytes    pages removed to keep the tier under its cap (file bytes)
    promotions                   pages copied into this tier from a slower one
    backlog_uploads              (shared) pages uploaded later: the local tier took them while
                                 the shared tier was down or busy (tiers.chain)
Gauges: ``used_bytes`` (resident file bytes), ``resident_pages`` and ``cap_bytes`` (None =
not known / no cap), set by whoever owns the tier's accounting (``set_capacity``); ``up``
(1: the tier serves, 0: down; None: no tier reports it): every tier object with a health check
(``SharedTier``: the shared export, a lone root) sets its own state (``set_up``) and withdraws
it when it closes (``drop_up``), and the gauge is the minimum over them, so one group's (or one
head slice's) down tier makes the process's tier read 0. Host and local tiers report none.
Histograms (seconds): ``load`` (submit to verified page), ``load_read`` (the part of a load an
I/O thread spent reading and checking the file; observed with the same loads when the result
carries it) and ``store``, per tier, fixed log-spaced buckets. Each bucket also keeps the sum
of its samples, so an exporter can replay increments whose ``_sum`` is exact
(``Histogram.to_dict``: ``bucket_sums``).

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
    """Cumulative-on-export histogram of durations in seconds, with per-bucket sums."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = tuple(buckets)
        self._counts = [0] * (len(self.buckets) + 1)  # last slot = +Inf
        self._sums = [0.0] * (len(self.buckets) + 1)
        self._sum = 0.0
        self._count = 0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        i = bisect.bisect_left(self.buckets, seconds)  # a value equal to a bound is in it (le)
        with self._lock:
            self._counts[i] += 1
            self._sums[i] += seconds
            self._sum += seconds
            self._count += 1

    def to_dict(self) -> dict[str, Any]:
        """Prometheus-style: ``buckets`` maps each upper bound ("+Inf" last) to a cumulative
        count; ``bucket_sums`` maps the same keys to the sum of the samples in that bucket
        alone (not cumulative)."""
        with self._lock:
            counts, sums, total, n = list(self._counts), list(self._sums), self._sum, self._count
        cumulative, per_bucket, acc = {}, {}, 0
        for le, c, s in zip([*map(repr, self.buckets), "+Inf"], counts, sums, strict=True):
            acc += c
            cumulative[le] = acc
            per_bucket[le] = s
        return {"count": n, "sum": total, "buckets": cumulative, "bucket_sums": per_bucket}

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


COUNTER_NAMES: tuple[str, ...] = _COUNTERS  # public name (exporters map each to a family)
HISTOGRAM_NAMES: tuple[str, ...] = ("load_seconds", "load_read_seconds", "store_seconds")  # snapshot keys


class TierMetrics:
    """Counters, gauges and histograms of one tier (see the module docstring)."""

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self._lock = threading.Lock()
        self._c: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self._failures: dict[str, int] = defaultdict(int)
        self.used_bytes: int | None = None
        self.resident_pages: int | None = None
        self.cap_bytes: int | None = None
        self._up: dict[object, bool] = {}  # reporting tier object's token -> serves now
        self.load_latency = Histogram()
        self.load_read_latency = Histogram()
        self.store_latency = Histogram()

    def add(self, name: str, n: int = 1) -> None:
        if name not in self._c:
            raise KeyError(f"unknown counter {name!r}; known: {_COUNTERS}")
        with self._lock:
            self._c[name] += n

    def hit(self, tokens: int, nbytes: int, seconds: float | None = None, read_seconds: float | None = None) -> None:
        """A verified page served: ``seconds`` the whole load, ``read_seconds`` the part of it
        an I/O thread spent on the file (None: not measured, e.g. the host tier)."""
        with self._lock:
            self._c["hits"] += 1
            self._c["hit_tokens"] += tokens
            self._c["bytes_read"] += nbytes
        if seconds is not None:
            self.load_latency.observe(seconds)
        if read_seconds is not None:
            self.load_read_latency.observe(read_seconds)

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

    def set_capacity(self, used: int | None, cap: int | None, pages: int | None = None) -> None:
        """The tier's residency now: ``used`` file bytes held, ``pages`` files held (None: not
        known, left as it was) and ``cap`` its cap in bytes (None: no cap)."""
        with self._lock:
            self.used_bytes, self.cap_bytes = used, cap
            if pages is not None:
                self.resident_pages = pages

    def set_up(self, source: object, up: bool) -> None:
        """``source`` (a token of one tier object) serves now (``up``) or is down."""
        with self._lock:
            self._up[source] = bool(up)

    def drop_up(self, source: object) -> None:
        """``source`` is closed: its state no longer counts."""
        with self._lock:
            self._up.pop(source, None)

    @property
    def up(self) -> int | None:
        """1 if every reporting tier object serves, 0 if one is down, None if none reports."""
        with self._lock:
            return self._up_value()

    def _up_value(self) -> int | None:  # under the lock
        return min(int(v) for v in self._up.values()) if self._up else None

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
            out["resident_pages"] = self.resident_pages
            out["cap_bytes"] = self.cap_bytes
            out["up"] = self._up_value()
        out["load_seconds"] = self.load_latency.to_dict()
        out["load_read_seconds"] = self.load_read_latency.to_dict()
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
