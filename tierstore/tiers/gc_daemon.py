"""Background shared-root gc: ``GcDaemon`` runs ``gc.collect`` every ``interval_s`` in one
daemon thread per root and process (``GcDaemon.ensure``; the tiers factory starts it when the
config sets ``max_bytes`` and ``gc_interval_s``).

A hung mount hangs only this thread (daemon: it never blocks shutdown); the lease makes nodes
take turns. Having no caller to print them, the daemon says a refusal or a lease problem as a
warning on every pass, and the unsafe entries once while they stand; a pass that raises is
logged and retried (a gc pass must never take the engine down).
Threading: one daemon thread per ``GcDaemon``; ``ensure`` and ``stop`` are thread-safe.
"""

from __future__ import annotations

import threading

from tierstore.metrics import TierMetrics
from tierstore.tiers.gc import collect
from tierstore.tiers.gc_report import GC_LOG, GcReport


class GcDaemon:
    """Background mode: ``collect`` every ``interval_s`` in one daemon thread per process.

    A hung mount hangs only this thread (daemon: it never blocks shutdown); the lease makes
    nodes take turns.
    """

    _running: dict[str, GcDaemon] = {}
    _guard = threading.Lock()

    def __init__(self, root: str, max_bytes: int, interval_s: float, metrics: TierMetrics | None = None, **kw: object):
        self.root, self.max_bytes, self.interval_s, self.metrics, self.kw = root, max_bytes, interval_s, metrics, kw
        self.last: GcReport | None = None
        self.runs = 0
        self._unsafe_said: list[str] = []  # the entries last warned about: a standing one is said once
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"tierstore-gc:{root}", daemon=True)

    @classmethod
    def ensure(cls, root: str, max_bytes: int, interval_s: float, metrics: TierMetrics | None = None) -> GcDaemon:
        """The process's daemon for ``root``, started on first use."""
        with cls._guard:
            d = cls._running.get(root)
            if d is None or not d._thread.is_alive():
                d = cls._running[root] = cls(root, max_bytes, interval_s, metrics)
                d._thread.start()
            return d

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.last = rep = collect(self.root, self.max_bytes, metrics=self.metrics, **self.kw)  # type: ignore[arg-type]
                self.runs += 1
                if rep.refused or rep.lease_problem:  # collect leaves saying it to its caller
                    GC_LOG.warning("tierstore background gc of %s: %s; nothing done, retrying in %.0f s", self.root,
                                   rep.refused or rep.lease_problem, self.interval_s)
                if rep.unsafe and rep.unsafe != self._unsafe_said:
                    GC_LOG.warning("tierstore background gc of %s: %d entries not followed, not touched (%s); "
                                   "`tierstore fsck %s` lists them", self.root, len(rep.unsafe),
                                   "; ".join(rep.unsafe[:3]) + ("; ..." if len(rep.unsafe) > 3 else ""), self.root)
                self._unsafe_said = rep.unsafe
            except Exception:  # a gc pass must never take the engine down
                GC_LOG.exception("tierstore background gc of %s failed; retrying in %.0f s", self.root, self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        with GcDaemon._guard:
            if GcDaemon._running.get(self.root) is self:
                del GcDaemon._running[self.root]
