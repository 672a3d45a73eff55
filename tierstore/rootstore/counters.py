"""EngineCounters: what one ``IOEngine`` counts (``stats``), and the unverified load results
it remembers until the caller's ``settle``.

Contract: ``finished`` counts a job's result once (a verified load as ok, an unverified one
remembered instead: at most ``MAX_UNSETTLED``, the oldest forgotten); ``settled`` counts a
remembered result ok or as a ``checksum`` failure and hands it back (None: unknown or
settled already); ``count`` adds one to a named counter (``PageFiles``' reports);
``snapshot`` copies them all.

Threading: every method may be called from any thread; one leaf lock guards the counters
(the job queue calls ``finished`` under its own lock).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from tierstore.errors import PageCorrupt

MAX_UNSETTLED = 4096  # unverified load results remembered for ``settle`` (oldest forgotten)


@dataclass(frozen=True)
class Served:
    """An unverified load result awaiting the caller's ``settle``."""

    key: bytes
    source: tuple[int, int, int] | None  # the file its bytes came from (rank_dir.FileIdentity)
    nbytes: int
    seconds: float


class EngineCounters:
    """The counters of one engine (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._unsettled: dict[int, Served] = {}  # job id -> unverified result, until settled
        self._c: dict[str, Any] = {
            "loads_ok": 0, "loads_failed": {}, "load_bytes": 0, "load_seconds": 0.0,
            "stores_ok": 0, "stores_existing": 0, "stores_failed": {}, "store_bytes": 0,
            "store_seconds": 0.0, "loads_general_reader": 0,
            "loads_odirect": 0,  # cold loads read with O_DIRECT (the rest came from the page cache)
            "bad_pages_discarded": 0,  # damaged files removed so the key can be stored again
            "rank_dir_reopens": 0,
            "planted_replaced": 0,  # a FIFO, directory or link under a page's name, moved aside for the page  # the rank directory removed or replaced behind us, reopened
            "loads_unverified": 0,  # verify=False results handed out; counted ok/failed at settle
        }

    def count(self, counter: str) -> None:
        """Add one to ``counter``."""
        with self._lock:
            self._c[counter] += 1

    def finished(self, job_id: int, op: str, error_kind: str | None, stored: bool, nbytes: int, seconds: float,
                 unverified: Served | None) -> None:
        """Count one job's result (``unverified``: a load handed out unchecked, counted at settle)."""
        c = self._c
        with self._lock:
            if unverified is not None:
                c["loads_unverified"] += 1
                self._unsettled[job_id] = unverified
                if len(self._unsettled) > MAX_UNSETTLED:
                    del self._unsettled[next(iter(self._unsettled))]
            elif error_kind is None and op == "load":
                self._load_ok_locked(nbytes, seconds)
            elif error_kind is None:
                c["stores_ok" if stored else "stores_existing"] += 1
                c["store_bytes"] += nbytes
                c["store_seconds"] += seconds
            else:
                failed = c["loads_failed" if op == "load" else "stores_failed"]
                failed[error_kind] = failed.get(error_kind, 0) + 1

    def settled(self, job_id: int, ok: bool) -> Served | None:
        """The caller's verdict on a remembered unverified load: counted, and handed back."""
        with self._lock:
            served = self._unsettled.pop(job_id, None)
            if served is None:
                return None
            if ok:
                self._load_ok_locked(served.nbytes, served.seconds)
            else:
                failed = self._c["loads_failed"]
                failed[PageCorrupt.kind] = failed.get(PageCorrupt.kind, 0) + 1
        return served

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            s = dict(self._c)
            s["loads_failed"] = dict(s["loads_failed"])
            s["stores_failed"] = dict(s["stores_failed"])
            s["loads_awaiting_settle"] = len(self._unsettled)
        return s

    def _load_ok_locked(self, nbytes: int, seconds: float) -> None:
        self._c["loads_ok"] += 1
        self._c["load_bytes"] += nbytes
        self._c["load_seconds"] += seconds
