"""Prometheus metrics of ``tierstore gc`` (``--loop``): an HTTP port and/or a node_exporter textfile.

Contract: ``add_arguments(parser)`` adds ``--metrics-port PORT``, ``--metrics-address ADDR``
(alias ``--metrics-addr``; default 127.0.0.1: the endpoint is unauthenticated, so it is
reachable from other hosts only when the operator widens it) and ``--metrics-textfile PATH``; ``start(args, root, cap_bytes)`` returns a ``GcMetrics`` (or None
when neither output was asked for) that serves ``/metrics`` on the port from then on;
``GcMetrics.update(report)`` records one pass (``failed()`` one that raised) and rewrites the
textfile atomically (a temp file in the same directory, then a rename: node_exporter never
reads half a file). Every metric carries a ``root`` label (several gc loops on one host write
distinct series) and lives in a private ``CollectorRegistry`` (nothing of the process's default
registry leaks in).
``GC_METRICS`` lists the exported names (docs/METRICS.md; the alert rules' and dashboard's
PromQL may use them). Dry-run passes count in ``tierstore_gc_runs_total{result="dry_run"}``
only.

prometheus_client (a dependency of vLLM, not of tierstore) is imported only when a flag asks
for metrics.

Failure policy: a port that cannot be bound raises ``TierStoreError`` naming ``--metrics-port``
(before the first pass); a textfile that cannot be written is logged as a warning each pass
and gc goes on (metrics must not stop eviction).
Threading: ``update`` is called from the gc loop's thread; prometheus_client's HTTP server
thread reads the registry concurrently (its metrics are thread-safe).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from tierstore.errors import TierStoreError
from tierstore.tiers.gc_report import GcReport

log = logging.getLogger(__name__)

GC_DURATION_BUCKETS: tuple[float, ...] = (0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0)

# exported name (as Prometheus shows it) -> (type, labels, documentation)
GC_METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "tierstore_gc_runs_total": ("counter", ("root", "result"), "gc passes by result: ok, busy (another node "
                                "holds the lease), error (a lease problem, or a pass that failed on the file "
                                "system), dry_run."),
    "tierstore_gc_evicted_pages_total": ("counter", ("root",), "Pages gc evicted to bring the root under its cap."),
    "tierstore_gc_evicted_bytes_total": ("counter", ("root",), "File bytes gc evicted."),
    "tierstore_gc_removed_temps_total": ("counter", ("root",), "Stale temp files gc removed (abandoned writes)."),
    "tierstore_gc_held_bytes": ("gauge", ("root",), "File bytes under the root that count against the cap "
                                "(pages, temps, trash) after the last pass."),
    "tierstore_gc_held_pages": ("gauge", ("root",), "Page files under the root after the last pass."),
    "tierstore_gc_cap_bytes": ("gauge", ("root",), "The cap gc keeps the root under (--max-bytes)."),
    "tierstore_gc_last_success_timestamp_seconds": ("gauge", ("root",), "Unix time the last pass that held "
                                                    "the lease finished (0: none yet)."),
    "tierstore_gc_duration_seconds": ("histogram", ("root",), "Duration of gc passes that held the lease, seconds."),
}


DEFAULT_METRICS_ADDRESS = "127.0.0.1"  # loopback: /metrics is unauthenticated


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The exporter's flags (``tierstore gc``; useful with ``--loop``)."""
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="serve gc's Prometheus metrics on http://ADDR:PORT/metrics (default: off)")
    parser.add_argument("--metrics-address", "--metrics-addr", dest="metrics_addr", default=DEFAULT_METRICS_ADDRESS,
                        metavar="ADDR", help="address --metrics-port listens on (default 127.0.0.1, this host "
                        "only: the endpoint has no authentication; 0.0.0.0 serves every interface)")
    parser.add_argument("--metrics-textfile", type=Path, default=None, metavar="PATH",
                        help="after each pass, write gc's metrics to PATH (a *.prom file in node_exporter's "
                        "--collector.textfile.directory), atomically")


class GcMetrics:
    """gc's metrics for one root (module docstring)."""

    def __init__(self, root: Path, cap_bytes: int, textfile: Path | None = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        self.root = str(root)
        self.textfile = textfile
        r = self.registry
        doc = {name: spec[2] for name, spec in GC_METRICS.items()}
        self.runs = Counter("tierstore_gc_runs", doc["tierstore_gc_runs_total"], ["root", "result"], registry=r)
        self.evicted_pages = Counter("tierstore_gc_evicted_pages", doc["tierstore_gc_evicted_pages_total"],
                                     ["root"], registry=r).labels(self.root)
        self.evicted_bytes = Counter("tierstore_gc_evicted_bytes", doc["tierstore_gc_evicted_bytes_total"],
                                     ["root"], registry=r).labels(self.root)
        self.removed_temps = Counter("tierstore_gc_removed_temps", doc["tierstore_gc_removed_temps_total"],
                                     ["root"], registry=r).labels(self.root)
        self.held_bytes = Gauge("tierstore_gc_held_bytes", doc["tierstore_gc_held_bytes"], ["root"],
                                registry=r).labels(self.root)
        self.held_pages = Gauge("tierstore_gc_held_pages", doc["tierstore_gc_held_pages"], ["root"],
                                registry=r).labels(self.root)
        self.cap = Gauge("tierstore_gc_cap_bytes", doc["tierstore_gc_cap_bytes"], ["root"], registry=r).labels(self.root)
        self.last_success = Gauge("tierstore_gc_last_success_timestamp_seconds",
                                  doc["tierstore_gc_last_success_timestamp_seconds"], ["root"],
                                  registry=r).labels(self.root)
        self.duration = Histogram("tierstore_gc_duration_seconds", doc["tierstore_gc_duration_seconds"], ["root"],
                                  buckets=GC_DURATION_BUCKETS, registry=r).labels(self.root)
        self.cap.set(cap_bytes)
        for result in ("ok", "busy", "error", "dry_run"):
            self.runs.labels(self.root, result)  # every series exists from the start (rate() needs two points)
        self.write_textfile()

    def update(self, rep: GcReport) -> None:
        """Record one pass (see the module docstring), then rewrite the textfile."""
        if rep.dry_run:
            self.runs.labels(self.root, "dry_run").inc()
        elif rep.busy:
            self.runs.labels(self.root, "busy").inc()
        elif rep.lease_problem or rep.refused:
            self.runs.labels(self.root, "error").inc()
        else:
            self.runs.labels(self.root, "ok").inc()
            self.evicted_pages.inc(rep.evicted)
            self.evicted_bytes.inc(rep.evicted_bytes)
            self.removed_temps.inc(rep.temps_removed)
            self.held_bytes.set(rep.total_after)
            self.held_pages.set(max(rep.pages - rep.evicted, 0))
            self.last_success.set(rep.finished)
            self.duration.observe(rep.seconds)
        self.write_textfile()

    def failed(self) -> None:
        """Record a pass that raised (the file system did not answer): an error pass."""
        self.runs.labels(self.root, "error").inc()
        self.write_textfile()

    def write_textfile(self) -> None:
        """The textfile, atomically (prometheus_client writes a temp file and renames it)."""
        if self.textfile is None:
            return
        from prometheus_client import write_to_textfile

        try:
            write_to_textfile(os.fspath(self.textfile), self.registry)
        except OSError as exc:
            log.warning("tierstore gc: cannot write --metrics-textfile %s: %s (gc goes on)", self.textfile, exc)


def start(args: argparse.Namespace, root: Path, cap_bytes: int) -> GcMetrics | None:
    """A ``GcMetrics`` serving ``--metrics-port`` and writing ``--metrics-textfile``; None when
    neither was given. Raises ``TierStoreError`` when the port cannot be bound."""
    port, textfile = getattr(args, "metrics_port", None), getattr(args, "metrics_textfile", None)
    if port is None and textfile is None:
        return None
    try:
        from prometheus_client import start_http_server
    except ImportError as exc:
        raise TierStoreError("--metrics-port and --metrics-textfile need the prometheus_client package: "
                             "pip install prometheus-client (vLLM installs it), or leave the flags out") from exc
    metrics = GcMetrics(root, cap_bytes, textfile)
    if port is not None:
        try:
            start_http_server(port, addr=args.metrics_addr, registry=metrics.registry)
        except OSError as exc:
            raise TierStoreError(f"cannot serve metrics on {args.metrics_addr}:{port}: {exc.strerror or exc}; "
                                 "pick a free --metrics-port (or leave it out)") from exc
    return metrics
