"""IndexedLookup: "is this page on a disk tier?" answered from memory, the rest in the background.

Contract:
- One ``PageIndex`` per (tier, group, rank): tiers in lookup order (the local tier, then the
  shared ``root``), groups as the ``FileMapper`` lists given; a group's entry is one mapper or,
  under tensor parallelism, one mapper per rank (every rank writes its own file of a page).
  A page is there only when every rank's file is: a key one rank lacks (its damaged file was
  removed, its store failed) misses, so it is recomputed and stored again instead of failing
  to load on that rank forever. ``start()`` starts two daemon threads:
  the *loader* lists every fan-out directory of every index (local first; shared listings run
  on a small pool, each under ``deadline_s``) and then lists them all again every
  ``refresh_s`` (0: never again); the *prober* (``index_prober.IndexProber``) answers batches
  of keys with one ``stat`` per tier (local inline, shared on a pool of ``probe_threads``
  under ``deadline_s``), writes the verdicts into the indexes and hands ``(token, identity)``
  pairs back through ``results``.
- ``answer(group, key)`` never touches the file system: True (for every rank some tier has
  its file), False (some rank's file is on no tier, or only on a tier that is down), None (an
  index that could decide it has not listed that directory yet: ask ``probe``).
  ``answer_tier`` answers for one tier (every rank's file on that tier).
- Head slices (docs/DESIGN.md §9): a group given a ``SliceGroup`` is one whose pages are stored
  as KV-head slices readable at any TP. Its mappers are one per slice directory any TP writes
  (``head_slices.tp_slices``: ``r0`` for the full range, ``h<start>-<count>`` else), and a key
  is a hit when, for every rank of the current TP, its own slice is on some tier or
  ``head_slices.cover`` finds slices on the shared root that hold its heads (the worker's
  ``HeadSliceStore`` assembles from the root only). A key's identity is the tuple of every
  slice file found. Two shortcuts give the same verdict without the rule: every current rank
  finds the key under its own slice (a hit: the TP that wrote a page reads it), or no index
  that may hold pages has it (a miss; ``_every`` leaves out the slice directories found
  empty at the last listing, never the current ranks' own, and is rebuilt after each).
- ``removals`` counts the events after which a True answer may have become False (a page
  left an index: ``PageIndex.on_removal``; the shared tier went down); ``on_removal(fn)``
  listeners run on that event's thread, before ``shared_up`` reads False. Callers that cache
  True answers clear them there. One-rank groups that are not head slices are answered by a
  flat loop (one hash per key, ``PageIndex.contains_fp`` per tier). ``known_prefix`` answers
  the leading hits of many keys of one group at once (vLLM's prefix lookups), vectorized.
- The shared tier's ``Health`` goes down when a listing or a batch of stats passes
  ``deadline_s``; while down its index is not consulted (MISS at once) and not refreshed; a
  probe thread brings it back (``tiers.deadline.Health``).

Threading: ``answer``, ``answer_tier``, ``probe`` and ``results`` may be called from any thread
and never block on I/O; everything else that touches the file system runs on this object's
threads. ``close`` stops them (threads stuck in a hung mount are daemons and are abandoned).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from xxhash import xxh3_64_intdigest

from tierstore.format.head_slices import HeadRange, cover
from tierstore.fs.deadline import Health, probe_root
from tierstore.fs.mapper import FANOUT_DIRS, FileMapper
from tierstore.index.index_prober import IndexProber, PageIdentity, ProbeItem
from tierstore.index.lookup_views import every_view, own_views, plain_views
from tierstore.index.page_index import PageIndex, contains_any, fingerprints, found_many

log = logging.getLogger(__name__)

def per_rank(mappers: Sequence[FileMapper | Sequence[FileMapper]]) -> list[list[FileMapper]]:
    """Each group's mappers, one per rank (a lone ``FileMapper`` is a group of one rank)."""
    return [[m] if isinstance(m, FileMapper) else list(m) for m in mappers]


def all_ranks(verdicts: Sequence[bool | None]) -> bool | None:
    """False if any rank lacks the page, None if any is undecided, else True."""
    if False in verdicts:
        return False
    return None if None in verdicts else True


@dataclass(frozen=True)
class SliceGroup:
    """A group stored as head slices: ``have`` names the slice of each of its mappers (same
    order), ``need`` the heads of each rank of the current TP."""

    have: tuple[HeadRange, ...]
    need: tuple[HeadRange, ...]

    def covered(self, anywhere: Sequence[bool], on_root: Sequence[bool]) -> bool:
        """Every rank's heads: its own slice on some tier, or covered by slices on the root."""
        here = [h for h, f in zip(self.have, anywhere, strict=True) if f]
        root = [h for h, f in zip(self.have, on_root, strict=True) if f]
        return all(n in here or cover(n, root) is not None for n in self.need)


@dataclass
class TierIndexes:
    """The indexes of one disk tier, one per (group, rank), and its health (shared tier only)."""

    name: str
    mappers: list[list[FileMapper]]
    health: Health | None = None
    on_removal: Callable[[int, bytes | None], None] | None = None  # (group, key or None)
    lister: Callable[[PageIndex], None] | None = None  # ListedTier.lister; None: directories
    exists: Callable[[Path], bool] | None = None  # ListedTier.exists
    indexes: list[list[PageIndex]] = field(init=False)

    def __post_init__(self) -> None:
        self.indexes = [[PageIndex(m.base) for m in ranks] for ranks in self.mappers]
        if self.on_removal is not None:
            for group, ranks in enumerate(self.indexes):
                for index in ranks:
                    index.on_removal = functools.partial(self.on_removal, group)

    @property
    def up(self) -> bool:
        return self.health is None or self.health.up

    def all_indexes(self) -> list[PageIndex]:
        return [ix for ranks in self.indexes for ix in ranks]


@dataclass(frozen=True)
class ListedTier:
    """A tier behind the root whose pages are known from listings, not directories (the object
    tier): ``mappers`` name its indexes (``FileMapper.base`` under a stand-in root, never
    touched), ``lister(index)`` fills one index from one listing (``PageIndex.begin_listing``,
    ``publish_listing``; it raises when the tier does not answer), ``probe`` answers or raises
    (its health's probe, bringing it back), ``exists(path)`` answers a key not listed yet."""

    name: str
    mappers: Sequence[FileMapper | Sequence[FileMapper]]
    lister: Callable[[PageIndex], None]
    probe: Callable[[], object]
    deadline_s: float
    exists: Callable[[Path], bool] | None = None  # a page's path -> is it there (a HEAD): unlisted keys
    replaces_root: bool = False  # no root: the lookup's root tier is this one (object_url alone)

    def tier_indexes(self, mappers: list[list[FileMapper]], on_change: Callable[[bool], None],
                     on_removal: Callable[[int, bytes | None], None]) -> TierIndexes:
        health = Health(f"{self.name} (scheduler lookups)", probe=self.probe, deadline_s=self.deadline_s,
                        on_change=on_change)
        return TierIndexes(self.name, mappers, health, on_removal, self.lister, self.exists)


class IndexedLookup:
    """Page indexes of the disk tiers plus their background loader and prober (module doc)."""

    def __init__(self, shared: Sequence[FileMapper | Sequence[FileMapper]],
                 local: Sequence[FileMapper | Sequence[FileMapper]] | None = None,
                 refresh_s: float = 30.0, deadline_s: float = 5.0, probe_threads: int = 16,
                 list_threads: int = 4, slices: Sequence[SliceGroup | None] | None = None,
                 listed: ListedTier | None = None) -> None:
        self.deadline_s = deadline_s
        self.slices = list(slices) if slices is not None else []  # per group; None: one mapper per rank
        self.refresh_s = refresh_s
        shared_mappers = per_rank(shared)
        shared_root = shared_mappers[0][0].root
        # ``removals`` counts events after which a True answer may have become False (a page
        # left an index, the shared tier went down); ``on_removal`` listeners hear each one.
        self.removals = 0
        self._removal_listeners: list[Callable[[int | None, bytes | None], None]] = []
        self._shared_live = True  # the hot path's view of the shared health (set first)
        self._shared_up = True  # what ``shared_up`` reports (set last)
        self.local = TierIndexes("local", per_rank(local), None, self._removed) if local else None
        self.listed = None
        if listed is not None and listed.replaces_root:  # no root: the listed tier (the bucket) takes its place
            self.shared = listed.tier_indexes(shared_mappers, self._health_changed, self._removed)
            listed = None
        else:  # the worker's probe (fs.deadline.probe_root): a stat is answered by an NFS client's cache
            health = Health("shared root (scheduler lookups)", probe=lambda: probe_root(Path(shared_root)),
                            deadline_s=deadline_s, on_change=self._health_changed, root=shared_root)
            self.shared = TierIndexes("shared", shared_mappers, health, self._removed)
        if listed is not None:
            self.listed = listed.tier_indexes(per_rank(listed.mappers), self._listed_health_changed, self._removed)
        self.tiers = [t for t in (self.local, self.shared, self.listed) if t is not None]
        self._build_views()
        self.counters = {"probed": 0, "probe_timeouts": 0, "list_timeouts": 0, "refreshes": 0}
        self._prober = IndexProber(self, probe_threads)
        self.results = self._prober.results  # the prober's verdicts, one list per batch
        # Stuck threads stay stuck in a hung mount; nothing new is submitted while it is down.
        self._list_pool = ThreadPoolExecutor(list_threads, thread_name_prefix="tierstore-list")
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.first_load_s: float | None = None  # seconds the first full listing took
        # Residency (metrics): index tier name -> page files per group, summed over ranks and
        # slices, as of the last full listing (``_count_resident``); replaced, never mutated.
        self.resident: dict[str, list[int]] = {}

    def _build_views(self) -> None:
        """The per-group index lists the hot path reads (``lookup_views``): ``_plain``,
        ``_own`` and ``_every``, each a pair (shared tier up, down). Rebuilt when a listed
        tier goes down or up, and ``_every`` after each listing; each is one assignment, so the
        scheduler sees the old list or the new."""
        slices = [self.slice_group(g) for g in range(len(self.shared.indexes))]
        self._plain = plain_views(self.tiers, self.shared, slices)
        self._own = own_views(self.tiers, self.shared, slices)
        self._every = self._may_hold()

    def _may_hold(self) -> list[tuple[list[PageIndex], list[PageIndex]]]:
        return every_view(self.tiers, self.shared, [self.slice_group(g) for g in range(len(self.shared.indexes))],
                          self._own)

    def _listed_health_changed(self, up: bool) -> None:
        # Down: its index stops answering first, then the cached HITs are dropped.
        self._build_views()
        if not up:
            self._removed(None, None)

    # ------------------------------------------------------------ lifecycle
    def start(self, load: bool = True) -> IndexedLookup:
        """Start the prober and (``load``; tests leave it out to keep the index cold) the loader."""
        self._threads.append(self._prober.start())
        if load:
            t = threading.Thread(target=self._load_loop, name="tierstore-index", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def close(self) -> None:
        self._stop.set()
        self._prober.stop()
        for t in self._threads:
            t.join(timeout=1.0)
        self._prober.close()
        self._list_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def loaded(self) -> bool:
        return all(ix.loaded for t in self.tiers for ix in t.all_indexes())

    @property
    def shared_up(self) -> bool:
        """The shared tier's health as last announced: it reads False only once the removal
        listeners ran (a cache of HIT answers is empty by then)."""
        return self._shared_up

    def on_removal(self, listener: Callable[[int | None, bytes | None], None]) -> None:
        """Call ``listener(group, key)`` (on the thread of the change, after ``removals``
        moved) whenever a True answer may have become False: for that page (``key`` of
        ``group``), or for any (None: a listing lacked some page, or the shared tier went
        down). A cache of True answers drops them then."""
        self._removal_listeners.append(listener)

    def _removed(self, group: int | None, key: bytes | None) -> None:
        self.removals += 1
        for listener in self._removal_listeners:
            listener(group, key)

    def _health_changed(self, up: bool) -> None:
        # Down: no answer from the shared index from now on, then drop the cached HITs (one
        # made in between is dropped too), then report it.
        self._shared_live = up
        if not up:
            self._removed(None, None)
        self._shared_up = up

    # ------------------------------------------------------------ scheduler-thread API
    def slice_group(self, group: int) -> SliceGroup | None:
        return self.slices[group] if group < len(self.slices) else None

    def answer(self, group: int, key: bytes) -> bool | None:
        plain = self._plain[group]
        if plain is not None:  # _answer_rank for one rank, flat (the hot path)
            return contains_any(plain[0] if self._shared_live else plain[1], xxh3_64_intdigest(key))
        sg = self.slice_group(group)
        if sg is not None:
            fp = xxh3_64_intdigest(key)
            live = 0 if self._shared_live else 1
            own = self._own[group]
            if own is not None and all(contains_any(ixs, fp) for ixs in own[live]):
                return True  # every rank's own slice is there: covered (SliceGroup.covered)
            anywhere = contains_any(self._every[group][live], fp)
            if not anywhere:
                return anywhere  # in no index: False, or None while some is not listed yet
            return self._answer_slices(sg, group, fp, self.tiers)
        return all_ranks([self._answer_rank(group, r, key) for r in range(len(self.shared.indexes[group]))])

    def known_prefix(self, group: int, keys: Sequence[bytes], suffix_len: int = 0) -> int:
        """How many leading ``keys`` of ``group`` ``answer`` would call True, found in one
        vectorized pass over the indexes (``page_index.found_many``; the shortcuts ``answer``
        takes first: one-rank groups, and head slices every current rank finds under its own
        slice). The key after them is undecided here: ask ``answer``. 0 for the other groups.
        ``suffix_len``: bytes at the end of each key that are not part of the page key (vLLM's
        group index), left out of the fingerprint without a copy of each key."""
        live = 0 if self._shared_live else 1
        plain = self._plain[group]
        own = self._own[group]
        if plain is not None:
            per_rank = [plain[live]]
        elif own is not None:
            per_rank = own[live]
        else:
            return 0
        fps = fingerprints(keys, suffix_len)
        every = None
        for indexes in per_rank:
            found = found_many(indexes, fps)
            every = found if every is None else every & found
        if every is None:
            return 0
        if every.all():
            return len(keys)
        return int(np.argmin(every))

    def _answer_rank(self, group: int, rank: int, key: bytes) -> bool | None:
        """Whether some tier holds ``rank``'s file of the page (None: undecided)."""
        unknown = False
        for tier in self.tiers:
            if not tier.up:
                continue
            found = tier.indexes[group][rank].contains(key)
            if found:
                return True
            unknown |= found is None
        return None if unknown else False

    def _answer_slices(self, sg: SliceGroup, group: int, fp: int, tiers: Sequence[TierIndexes]) -> bool | None:
        """``SliceGroup.covered`` from the indexes (``fp``: the key's fingerprint); None when
        undecided and not yet covered."""
        anywhere = [False] * len(sg.have)
        on_root = [False] * len(sg.have)
        unknown = False
        for tier in tiers:
            if not tier.up:
                continue
            for i, ix in enumerate(tier.indexes[group]):
                found = ix.contains_fp(fp)
                anywhere[i] |= found is True
                on_root[i] |= found is True and tier is self.shared
                unknown |= found is None
        if sg.covered(anywhere, on_root):
            return True
        return None if unknown else False

    def answer_tier(self, tier: str, group: int, key: bytes) -> bool | None:
        t = self.shared if tier == "shared" else self.local
        if t is None or not t.up:
            return False
        sg = self.slice_group(group)
        if sg is not None:
            return self._answer_slices(sg, group, xxh3_64_intdigest(key), [t])
        return all_ranks([ix.contains(key) for ix in t.indexes[group]])

    def probe(self, items: list[ProbeItem]) -> None:
        """Look these keys up on disk in the background; ``results`` gets one list back."""
        self._prober.probe(items)

    def probe_now(self, batch: list[ProbeItem]) -> list[tuple[Any, PageIdentity | None]]:
        """``IndexProber.probe_now`` on this thread (tests and tools)."""
        return self._prober.probe_now(batch)

    def missed_deadline(self, tier: TierIndexes, futures: Iterable[Future[Any]], counter: str, what: str) -> None:
        """Cancel ``futures`` not yet started, count the miss and mark the shared tier down."""
        for f in futures:
            f.cancel()
        self.counters[counter] += 1
        assert tier.health is not None
        tier.health.mark_down(f"{what} took longer than {self.deadline_s:.3f} s (shared_deadline_s)")

    # ------------------------------------------------------------ loader thread
    def _load_loop(self) -> None:
        t0 = time.monotonic()
        self.list_all()
        self._every = self._may_hold()  # one assignment: the scheduler sees the old or the new
        self.first_load_s = time.monotonic() - t0
        self._count_resident()
        log.info("tierstore: page index loaded in %.2f s (%s)", self.first_load_s,
                 ", ".join(f"{t.name}: {sum(len(ix) for ix in t.all_indexes())} files" for t in self.tiers))
        while self.refresh_s > 0 and not self._stop.wait(self.refresh_s):
            self.list_all()
            self._every = self._may_hold()
            self.counters["refreshes"] += 1
            self._count_resident()

    # ------------------------------------------------------------ residency (metrics)
    def _count_resident(self) -> None:
        """``resident`` from the listings just made (loader thread; one assignment). A tier that
        is down keeps its last counts."""
        counts = dict(self.resident)
        for tier in self.tiers:
            if tier.health is None or tier.health.up:
                counts[tier.name] = [sum(len(ix) for ix in ranks) for ranks in tier.indexes]
        self.resident = counts

    def list_all(self) -> None:
        """List every fan-out directory of every index once (this thread; shared on the pool)."""
        for tier in self.tiers:
            for group, ranks in enumerate(tier.indexes):
                for index in ranks:
                    if self._stop.is_set():
                        return
                    if (self.slice_group(group) is not None and index.loaded and tier.lister is None
                            and not self._exists(tier, index)):
                        continue  # a slice no TP has written here: one stat, not 256 listings
                    self._list_index(tier, index)

    def _exists(self, tier: TierIndexes, index: PageIndex) -> bool:
        """Whether ``index``'s directory exists (shared tier: under the deadline; a timeout
        marks it down and answers True, so the listing is skipped by the health check)."""
        if tier.health is None:
            return os.path.isdir(index.base)
        if not tier.up:
            return True
        try:
            return self._list_pool.submit(os.path.isdir, index.base).result(timeout=self.deadline_s)
        except FutureTimeout:
            tier.health.mark_down(f"a stat took longer than {self.deadline_s:.3f} s (shared_deadline_s)")
            return True

    def _list_index(self, tier: TierIndexes, index: PageIndex) -> None:
        """List every fan-out directory of one index (local inline; shared on the pool; a listed
        tier's ``lister`` inline, its requests bounded by their own deadlines)."""
        if tier.lister is not None:
            if tier.up:
                try:
                    tier.lister(index)
                except Exception as exc:  # noqa: BLE001 - any failure of the endpoint: down, probed back
                    self.counters["list_timeouts"] += 1
                    assert tier.health is not None
                    tier.health.mark_down(f"listing failed: {exc}")
        elif tier.health is None:
            for d in range(len(FANOUT_DIRS)):
                try:
                    index.load_dir(d)
                except OSError as exc:  # the directory stays as it was; probes answer it
                    log.warning("tierstore: cannot list %s/%s: %s", index.base, FANOUT_DIRS[d], exc)
        elif tier.up:
            self._list_shared(tier, index)

    def _list_shared(self, tier: TierIndexes, index: PageIndex) -> None:
        futures: list[Future[None]] = [self._list_pool.submit(index.load_dir, d) for d in range(len(FANOUT_DIRS))]
        for f in futures:
            try:
                f.result(timeout=self.deadline_s)
            except FutureTimeout:
                self.missed_deadline(tier, futures, "list_timeouts", "listing a directory")
                return
            except OSError as exc:
                log.warning("tierstore: cannot list a directory of %s: %s", index.base, exc)
