"""IndexProber: the keys an ``IndexedLookup`` could not answer, looked up on disk off the
scheduler's thread.

Contract:
- ``probe(items)`` queues one batch of ``(token, group, page key)``; the prober thread stats
  every rank's file of every key on each tier of the lookup, in lookup order, until found
  (the local tier inline, the shared tier on a pool of ``probe_threads`` under the lookup's
  ``deadline_s``), records each verdict in that tier's index (``PageIndex.add`` / ``discard``)
  and puts one list of ``(token, identity)`` on ``results``: a key's identity is its one
  rank's ``(inode, size, mtime_ns)``, the tuple of every rank's, or for a head-sliced group
  the tuple of every slice file found when they cover every current rank; None when the page
  is not (wholly) there. A batch is never lost: an unexpected error answers None for each key.
- A tier known from listings only (``lister``: the object tier) is answered from its index,
  never stat'ed, and for a key whose directory it has not listed yet by ``exists`` (a HEAD,
  bounded by the tier's own deadline); its pages' identity is ``LISTED``.
- A batch of stats on the shared tier that passes the deadline marks that tier down
  (``IndexedLookup.missed_deadline``); its keys are then answered from the other tiers.

Threading: ``probe`` and ``results`` may be used from any thread; ``probe_now`` runs on the
prober thread (``start``), or on the caller's in tests. ``stop`` ends the thread after the
batch in hand; ``close`` abandons stats stuck in a hung mount (daemon pool threads).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, Protocol


class ProbedTier(Protocol):
    """What the prober reads of one tier of the lookup (an ``indexed_lookup.TierIndexes``)."""

    up: bool
    health: Any  # tiers' Health, or None for a tier that cannot hang (local)
    lister: Any  # None: stat its files; else its pages are known from listings only (objects)
    exists: Any  # with a lister: path -> whether its page is there (a HEAD), or None
    mappers: Sequence[Sequence[Any]]  # [group][rank] -> FileMapper
    indexes: Sequence[Sequence[Any]]  # [group][rank] -> PageIndex


class ProbedLookup(Protocol):
    """What the prober reads and calls of its ``IndexedLookup`` (passed in, not imported:
    the lookup owns the prober)."""

    counters: dict[str, int]
    deadline_s: float

    @property
    def shared(self) -> ProbedTier: ...
    @property
    def tiers(self) -> Sequence[ProbedTier]: ...
    def slice_group(self, group: int) -> Any: ...
    def missed_deadline(self, tier: ProbedTier, pending: Any, counter: str, what: str) -> None: ...

log = logging.getLogger(__name__)

Identity = tuple[int, int, int]  # (inode, size, mtime_ns) of a page file
# What a probe reports for a key: one rank's Identity, or one per rank (TP > 1).
PageIdentity = Identity | tuple[Identity, ...]
LISTED: Identity = (0, 0, 0)  # the identity of a page known from an object tier's listing only
ProbeItem = tuple[Any, int, bytes]  # (caller's token, group, page key)


def file_identity(path: str | os.PathLike[str]) -> Identity | None:
    """(inode, size, mtime_ns) of ``path``, or None when there is no such file."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class IndexProber:
    """The prober thread of one ``IndexedLookup`` (module doc)."""

    def __init__(self, lookup: ProbedLookup, probe_threads: int) -> None:
        self._lookup = lookup
        self.results: queue.SimpleQueue[list[tuple[Any, PageIdentity | None]]] = queue.SimpleQueue()
        self._probes: queue.SimpleQueue[list[ProbeItem] | None] = queue.SimpleQueue()
        # Stuck threads stay stuck in a hung mount; nothing new is submitted while it is down.
        self._stat_pool = ThreadPoolExecutor(probe_threads, thread_name_prefix="tierstore-probe")

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._loop, name="tierstore-prober", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._probes.put(None)

    def close(self) -> None:
        self._stat_pool.shutdown(wait=False, cancel_futures=True)

    def probe(self, items: list[ProbeItem]) -> None:
        """Look these keys up on disk in the background; ``results`` gets one list back."""
        if items:
            self._probes.put(items)

    def _loop(self) -> None:
        while True:
            batch = self._probes.get()
            if batch is None:
                return
            try:
                self.results.put(self.probe_now(batch))
            except Exception:  # never lose a batch: the caller would wait for it forever
                log.exception("tierstore: lookup probe failed")
                self.results.put([(token, None) for token, _g, _k in batch])

    def probe_now(self, batch: list[ProbeItem]) -> list[tuple[Any, PageIdentity | None]]:
        """Stat every rank's file of every key of ``batch`` on each tier until found (this
        thread: local; shared on the pool under the deadline); record the verdicts in the
        indexes. A key's identity is its one rank's, or the tuple of every rank's (None when
        any rank's file is on no tier)."""
        lookup = self._lookup
        lookup.counters["probed"] += len(batch)
        files = [(i, r) for i, (_t, g, _k) in enumerate(batch) for r in range(len(lookup.shared.mappers[g]))]
        found: dict[tuple[int, int], Identity] = {}
        todo = list(range(len(files)))
        for tier in lookup.tiers:
            if not todo or not tier.up:
                continue
            paths = [tier.mappers[batch[files[j][0]][1]][files[j][1]].path_for(batch[files[j][0]][2]) for j in todo]
            if tier.lister is not None:  # no files to stat (objects): its listing, else a HEAD
                for j, path in zip(todo, paths, strict=True):
                    (i, r), key = files[j], batch[files[j][0]][2]
                    there = tier.indexes[batch[i][1]][r].contains(key)
                    if there or (there is None and tier.exists is not None and tier.exists(path)):
                        found[files[j]] = LISTED
                todo = [j for j in todo if files[j] not in found]
                continue
            if tier.health is None:
                idents: list[Identity | None] | None = [file_identity(p) for p in paths]
            else:
                idents = self._stat_under_deadline(tier, paths)
                if idents is None:
                    continue  # timed out: the tier is down now, its index is not consulted
            rest = []
            for j, ident in zip(todo, idents, strict=True):
                (i, r), key = files[j], batch[files[j][0]][2]
                index = tier.indexes[batch[i][1]][r]
                if ident is None:
                    index.discard(key)
                    rest.append(j)
                else:
                    index.add(key)
                    found[files[j]] = ident
            todo = rest
        out: list[tuple[Any, PageIdentity | None]] = []
        for i, (token, g, _k) in enumerate(batch):
            idents = [found.get((i, r)) for r in range(len(lookup.shared.mappers[g]))]
            sg = lookup.slice_group(g)
            if sg is not None:  # the identities of every slice file found, if they cover every rank
                have = [ident is not None for ident in idents]
                whole = tuple(x for x in idents if x is not None) if sg.covered(have, have) else None
                out.append((token, whole))  # type: ignore[arg-type]
                continue
            whole = None if None in idents else (idents[0] if len(idents) == 1 else tuple(idents))
            out.append((token, whole))  # type: ignore[arg-type]
        return out

    def _stat_under_deadline(self, tier: ProbedTier, paths: list[Any]) -> list[Identity | None] | None:
        futures = [self._stat_pool.submit(file_identity, p) for p in paths]
        done, pending = wait_futures(futures, timeout=self._lookup.deadline_s)
        if pending:
            self._lookup.missed_deadline(tier, pending, "probe_timeouts", f"{len(pending)} lookups")
            return None
        return [f.result() for f in futures]
