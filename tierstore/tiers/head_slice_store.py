"""HeadSliceStore: a ``PageStore`` (store.py) that serves a rank's slice of a group (its KV heads,
or its Gated DeltaNet states: head_slices.py) from pages written at another tensor-parallel
size, composed around the rank's normal store.

Contract:
- Everything but loads is the inner store's (slots, stores, settle, flush, stats).
- ``submit_load(key)`` goes to the inner store (the rank's own head slice) first. When that
  load ends ``missing``, the key is looked for in the other head slices of the group
  (``SliceSource.available``: listed in the background, never on the caller's thread) on this
  store's own small thread pool: ``head_slices.cover`` picks the files, a slot is taken from the
  inner store's pool and ``assembly.assemble`` fills it, each file opened through directory fds
  (no symlink followed) and verified in full with its writer's expectation, and with the inner
  store's fleet key (``mac``: its MAC tag, as every page an engine serves) before any byte is
  copied: with a key, a slice written without it is a failure of kind ``mac``, never served
  and never stored back. The result keeps the job id and comes back
  through ``poll``/``wait`` with ``verified=True`` (so it is never settled); a failure is the
  typed error of the piece that failed, or the original ``missing`` when nothing covers the
  key or no slot is free.
- An assembled page is also stored under the rank's own slice (``store_back``, default on):
  a copy in a second slot goes through the inner store's ordinary store, so the next hit of
  the key reads one file of the rank's size; the read amplification of a TP change is paid
  once per page. The store's result comes back through ``poll``/``wait`` like any store's.
- A covering file that fails verification (bad content) is removed, that file only (its
  identity as read), like an engine's own damaged pages: ``slice_damaged_removed``. One not
  verifiable with the key (kind ``mac``) is left in place.
- Deadline (the fallback reads the shared root, which may hang: a ``hard`` NFS mount blocks a
  thread until the server returns): each fallback has ``deadline_s`` (default: the inner
  store's ``shared_deadline_s``) from the moment the own load came back ``missing``. One not finished by then is handed
  to the caller as a typed ``timeout`` at the deadline (``poll``/``wait``), its thread left to
  finish on its own (a slot it took then goes back to the inner store), and the fallback is
  marked down (``health``, ``fs.deadline.Health``: a probe of the group directory under the
  deadline brings it back). While down, or while every pool thread has been reading one
  fallback for ``STALL_S`` or more (the shared root stalls), or with ``MAX_UNFINISHED``
  fallbacks unfinished, a ``missing`` own load is handed out as it is (no fallback): later
  loads never queue behind hung ones, while a burst of misses on a healthy root (a TP change:
  every page of a prompt at once) is assembled in full. A fallback that waited in the queue past its deadline
  returns ``timeout`` without touching the file system.
- ``stats`` adds ``slice_loads`` (served from other slices), ``slice_bytes_read``,
  ``slice_bytes_scattered``, ``slice_files``, ``slice_failures`` and ``slice_stored_back``:
  the measured cost of serving across a TP change (docs/DESIGN.md §9); ``slice_timeouts``
  (fallbacks past their deadline) and ``slice_skipped`` (misses not tried: down or full).

``DirectorySlices`` is the ``SliceSource`` of one group directory: it lists ``g<g>/`` once in
a background thread (and again every ``refresh_s``) for ``h<start>-<count>`` directories (and
``r0``, the full head range of a TP=1 writer).

Threading: every method may be called from any thread (one lock guards the job table); the
fallback reads run on the pool (``threads`` threads, at most as many queued); ``close`` stops it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any, Protocol

from tierstore.errors import PageError, PageTimeout
from tierstore.format.head_slices import (
    HeadRange,
    cover,
    parse_split_dir,
    segments,
    slice_layout,
    split_dir_name,
)
from tierstore.format.header import PageExpectation
from tierstore.format.mac import PageMac
from tierstore.format.page_layout import PageLayout
from tierstore.format.sealing import KeyRing
from tierstore.fs.deadline import Health, probe_root
from tierstore.fs.mapper import PAGE_SUFFIX, fanout
from tierstore.index import page_index
from tierstore.rootstore.rank_dir import RankDir
from tierstore.store import IOResult, JobTicket, PageStore
from tierstore.tiers.assembly import assemble

logger = logging.getLogger("tierstore.slices")


class SliceSource(Protocol):
    """Which head slices of a group exist, and where a slice's page of a key is."""

    def available(self) -> Sequence[HeadRange]: ...

    def locate(self, heads: HeadRange, key: bytes) -> tuple[Path, PageExpectation]: ...


# The fallback's deadline when neither the caller nor the inner store's config gives one (the
# default ``shared_deadline_s``).
DEFAULT_FALLBACK_DEADLINE_S = 5.0


def inner_mac(inner: PageStore) -> PageMac | None:
    """The fleet key the inner store verifies its pages with: an engine's ``mac``, else the
    ``mac_key_file`` of its config (a tier chain); None without one. Failure policy: a key file
    that cannot be used raises ``ConfigError``, as at the inner store's start."""
    mac = getattr(inner, "mac", None)
    if isinstance(mac, PageMac):
        return mac
    key_file = getattr(getattr(inner, "config", None), "mac_key_file", None)
    return PageMac.from_key_file(key_file) if isinstance(key_file, str | os.PathLike) and key_file else None


def inner_sealer(inner: PageStore) -> KeyRing | None:
    """The encryption key the inner store seals its pages with (as ``inner_mac``)."""
    sealer = getattr(inner, "sealer", None)
    if isinstance(sealer, KeyRing):
        return sealer
    config = getattr(inner, "config", None)
    key_file = getattr(config, "encryption_key_file", None)
    if not (isinstance(key_file, str | os.PathLike) and key_file):
        return None
    return KeyRing.from_files(key_file, getattr(config, "tenant_key_files", None))


def _inner_deadline(inner: PageStore) -> float:
    """The inner store's ``shared_deadline_s`` (an engine or a chain carries its config): the
    default of a store built by hand; ``tiers.open_rank_store`` passes the root tier's deadline."""
    value = getattr(getattr(inner, "config", None), "shared_deadline_s", None)
    return float(value) if isinstance(value, int | float) and value > 0 else DEFAULT_FALLBACK_DEADLINE_S


class _Fallback:
    """One fallback in flight: its future, the original miss and its deadline (monotonic)."""

    __slots__ = ("deadline", "future", "missing")

    def __init__(self, future: Future[IOResult], missing: IOResult, deadline: float) -> None:
        self.future, self.missing, self.deadline = future, missing, deadline


class DirectorySlices:
    """The head slices under one group directory ``ROOT/<ns>/g<g>`` (see the module docstring)."""

    def __init__(self, group_dir: str | os.PathLike[str], namespace: bytes, group_index: int,
                 full_layout: PageLayout, refresh_s: float = 30.0) -> None:
        self.group_dir = Path(group_dir)
        self.namespace, self.group_index, self.full_layout = namespace, group_index, full_layout
        self.full = HeadRange(0, segments(full_layout)[0])
        self.refresh_s = refresh_s
        self._slices: tuple[HeadRange, ...] = ()
        self._stop = threading.Event()
        self.listed = threading.Event()
        threading.Thread(target=self._loop, name="tierstore-slices", daemon=True).start()

    def dir_name(self, heads: HeadRange) -> str:
        return "r0" if heads == self.full else split_dir_name(heads)

    def list_now(self) -> tuple[HeadRange, ...]:
        """List the group directory once (blocking); the slices found."""
        found = []
        try:
            with os.scandir(self.group_dir) as it:
                for e in it:
                    heads = self.full if e.name == "r0" else parse_split_dir(e.name)
                    if heads is not None and heads.end <= self.full.end and e.is_dir(follow_symlinks=False):
                        found.append(heads)
        except OSError:
            pass  # no group directory yet: nothing to serve from
        self._slices = tuple(sorted(found))
        return self._slices

    def _loop(self) -> None:
        while True:
            self.list_now()
            self.listed.set()
            if self.refresh_s <= 0 or self._stop.wait(self.refresh_s):
                return

    def available(self) -> Sequence[HeadRange]:
        return self._slices

    def locate(self, heads: HeadRange, key: bytes) -> tuple[Path, PageExpectation]:
        path = self.group_dir / self.dir_name(heads) / fanout(key) / f"{key.hex()}{PAGE_SUFFIX}"
        rank = heads.start // heads.count if heads != self.full else 0
        return path, PageExpectation(self.namespace, key, self.group_index, rank,
                                     slice_layout(self.full_layout, heads))

    def close(self) -> None:
        self._stop.set()


STALL_S = 1.0  # every pool thread on one fallback this long: the shared root stalls (at most deadline / 4)
MAX_UNFINISHED = 256  # fallbacks running or queued at most


class HeadSliceStore:
    """The rank's store, plus loads assembled from other head slices; see the module docstring."""

    def __init__(self, inner: PageStore, heads: HeadRange, full_layout: PageLayout, slices: SliceSource,
                 threads: int = 2, slot_wait_s: float = 1.0, store_back: bool = True,
                 deadline_s: float | None = None, mac: PageMac | None = None) -> None:
        """``mac``: the fleet key covering files must verify with (default ``inner_mac(inner)``:
        the key of the pages this store serves, so the fallback never serves less)."""
        self.inner = inner
        self.mac = mac if mac is not None else inner_mac(inner)
        self.sealer = inner_sealer(inner)  # covering files are decrypted with it, as every page served
        self.store_back = store_back
        self.layout = inner.layout
        self.heads, self.full_layout, self.slices = heads, full_layout, slices
        if slice_layout(full_layout, heads) != inner.layout:
            raise ValueError(f"the inner store's layout is not heads {split_dir_name(heads)} of the group")
        self.slot_wait_s = slot_wait_s
        self.deadline_s = deadline_s if deadline_s is not None else _inner_deadline(inner)
        self._threads = threads
        self._stall_s = min(STALL_S, self.deadline_s / 4)
        self._running: dict[int, float] = {}  # job id -> when its pool thread started it
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tierstore-slices")
        self.health = Health("head-slices", self._probe, self.deadline_s)
        self._lock = threading.Lock()
        self._fallbacks: dict[int, _Fallback] = {}
        self._unfinished = 0  # fallbacks submitted whose thread has not returned (abandoned ones too)
        self._own_stores: set[int] = set()  # store-backs: their results are not the caller's
        self._counters = {"slice_loads": 0, "slice_bytes_read": 0, "slice_bytes_scattered": 0, "slice_files": 0,
                          "slice_failures": 0, "slice_stored_back": 0,
                          "slice_store_back_failures": 0, "slice_damaged_removed": 0,
                          "slice_timeouts": 0, "slice_skipped": 0}

    # ------------------------------------------------------------ delegated
    def acquire_slot(self, timeout: float | None = 0) -> Any:
        return self.inner.acquire_slot(timeout)

    @property
    def free_slots(self) -> int:
        return self.inner.free_slots

    def release_slot(self, slot: Any) -> None:
        self.inner.release_slot(slot)

    def submit_store(self, key: bytes, slot: Any, token_count: int, sums: Sequence[int] | None = None, *,
                     ticket: JobTicket | None = None) -> int:
        return self.inner.submit_store(key, slot, token_count, sums, ticket=ticket)

    def contains(self, key: bytes) -> bool:
        return self.inner.contains(key)

    def settle(self, result: IOResult, ok: bool, reason: str = "") -> None:
        self.inner.settle(result, ok, reason)

    def flush(self, timeout: float | None) -> bool:
        return self.inner.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if hasattr(self.slices, "close"):
            self.slices.close()
        c = self.stats
        if c["slice_loads"] or c["slice_failures"]:  # the measured cost of a TP change (DESIGN §9)
            logger.info("tierstore-slices heads=%s loads=%d files=%d bytes_read=%d bytes_scattered=%d failures=%d "
                        "stored_back=%d", split_dir_name(self.heads), c["slice_loads"], c["slice_files"],
                        c["slice_bytes_read"], c["slice_bytes_scattered"], c["slice_failures"],
                        c["slice_stored_back"])
        self.inner.close(timeout)

    @property
    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {**self.inner.stats, **self._counters}

    # ------------------------------------------------------------ loads
    def submit_load(self, key: bytes, verify: bool = True, *, ticket: JobTicket | None = None) -> int:
        return self.inner.submit_load(key, verify, ticket=ticket)

    def _route(self, results: Iterable[IOResult]) -> list[IOResult]:
        """Results to hand out now; a missing own page starts a fallback instead."""
        out = []
        for r in results:
            with self._lock:
                if r.job_id in self._own_stores:
                    self._own_stores.discard(r.job_id)
                    if not r.ok:
                        self._counters["slice_store_back_failures"] += 1
                    continue
                # every load is the caller's (a store-back is a store): one job id from the caller down
                if r.op == "load" and not r.ok and r.error is not None and r.error.kind == "missing":
                    if self.health.up and not self._stalled_locked():
                        deadline = time.monotonic() + self.deadline_s
                        self._unfinished += 1
                        future = self._pool.submit(self._run_fallback, r, deadline)
                        self._fallbacks[r.job_id] = _Fallback(future, r, deadline)
                        continue
                    self._counters["slice_skipped"] += 1
            out.append(r)
        return out

    def _stalled_locked(self) -> bool:
        """Whether a new fallback would only queue behind hung ones (the lock held): every pool
        thread on one for ``_stall_s`` or more, or ``MAX_UNFINISHED`` unfinished."""
        if self._unfinished >= MAX_UNFINISHED:
            return True
        if len(self._running) < self._threads:
            return False
        return time.monotonic() - max(self._running.values()) >= self._stall_s

    def _run_fallback(self, missing: IOResult, deadline: float) -> IOResult:
        """On a pool thread: ``_from_slices``, then one fewer fallback unfinished."""
        with self._lock:
            self._running[missing.job_id] = time.monotonic()
        try:
            return self._from_slices(missing, deadline)
        finally:
            with self._lock:
                self._unfinished -= 1
                self._running.pop(missing.job_id, None)

    def _done_fallbacks(self, only: set[int] | None = None) -> list[IOResult]:
        """Finished fallbacks, and those past their deadline as ``timeout`` results (module
        docstring); of ``only`` when given."""
        now = time.monotonic()
        out: list[IOResult] = []
        late: list[_Fallback] = []
        with self._lock:
            for j, fb in list(self._fallbacks.items()):
                if only is not None and j not in only:
                    continue
                if fb.future.done():
                    del self._fallbacks[j]
                    out.append(fb.future.result())
                elif now >= fb.deadline:
                    del self._fallbacks[j]
                    late.append(fb)
                    self._counters["slice_timeouts"] += 1
        for fb in late:
            fb.future.add_done_callback(self._release_abandoned)
            m = fb.missing
            err = PageTimeout(f"reading the page from other head slices took longer than {self.deadline_s:.3f} s "
                              "(the shared root is not answering); recomputed", key=m.key)
            self.health.mark_down(str(err))
            out.append(IOResult(m.job_id, "load", m.key, False, err, None, False, 0,
                                m.seconds + self.deadline_s, tier=m.tier))
        return out

    def _release_abandoned(self, future: Future[IOResult]) -> None:
        """The late result of a fallback handed out as ``timeout``: its slot goes back."""
        if future.cancelled() or future.exception() is not None:
            return
        late = future.result()
        if late.slot is not None:
            self.inner.release_slot(late.slot)

    def _probe(self) -> None:
        """The fallback's health probe (under its deadline): a create and unlink under the group
        directory, which the file server must answer (``fs.deadline.probe_root``)."""
        group_dir = getattr(self.slices, "group_dir", None)
        if group_dir is not None:
            probe_root(Path(group_dir))

    def poll(self) -> list[IOResult]:
        return self._route(self.inner.poll()) + self._done_fallbacks()

    def wait(self, job_ids: Iterable[int], timeout: float | None) -> list[IOResult]:
        ids = set(job_ids)
        end = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            # Every job but one already handed to a fallback is the inner store's (loads and stores)
            inner_ids = ids - self._fallbacks.keys()
        out = self._route(self.inner.wait(inner_ids, timeout)) if inner_ids else []
        with self._lock:
            pending = [f for j, f in self._fallbacks.items() if j in ids]
        if pending:  # until each is done or past its deadline (or the caller's timeout)
            until = max(f.deadline for f in pending)
            if end is not None:
                until = min(until, end)
            wait_futures([f.future for f in pending], timeout=max(0.0, until - time.monotonic()))
        return out + self._done_fallbacks(ids)

    def _remove_damaged(self, path: Path, identity: Any, key: bytes, error: PageError) -> None:
        """Remove a covering file that failed verification, and only the file that was read (as
        an engine does with its own damaged pages): its writer's next store of the key replaces
        it, and no other reader pays for reading it. Through the slice directory's fd, no
        symlink followed; never raises."""
        parts = path.parts
        dirs = RankDir(Path(*parts[:-5]), parts[-5:-2])  # ROOT / <ns> / g<g> / <slice> / <aa> / <name>
        try:
            removed = dirs.remove_damaged(parts[-2], parts[-1], identity, where=str(path), key=key)
        finally:
            dirs.close()
        if removed:
            page_index.note_removed(path.parent.parent, key)
            logger.warning("removed damaged slice file %s (%s)", path, error)
            with self._lock:
                self._counters["slice_damaged_removed"] += 1

    def _store_back(self, key: bytes, slot: Any, token_count: int) -> int:
        """Store an assembled page under the rank's own slice, so the next hit reads one file of
        its own size (the TP change's read amplification is paid once per page, not per hit).
        A copy into a second slot goes through the inner store's ordinary store (a new file,
        checksummed, atomic); with no free slot it is skipped (a later hit tries again). 1 if
        submitted."""
        if not self.store_back:
            return 0
        copy = self.inner.acquire_slot(0)
        if copy is None:
            return 0
        copy.view[: self.layout.nbytes] = slot.view[: self.layout.nbytes]
        job_id = self.inner.submit_store(key, copy, token_count)
        with self._lock:
            self._own_stores.add(job_id)
        return 1

    def _from_slices(self, missing: IOResult, deadline: float) -> IOResult:
        """On a pool thread: the rank's page of ``missing.key`` from the other slices; a
        ``timeout`` without touching the file system when it waited past ``deadline``."""
        t0 = time.perf_counter()
        key = missing.key
        if time.monotonic() >= deadline:
            return IOResult(missing.job_id, "load", key, False,
                            PageTimeout("waited past its deadline behind slower reads of other head slices", key=key),
                            None, False, 0, missing.seconds, tier=missing.tier)
        # A stat of each name picks the plan (nothing is read through it); every file the plan
        # reads is then opened through directory fds (assembly.open_slice_file).
        have = [h for h in self.slices.available() if h != self.heads and self.slices.locate(h, key)[0].exists()]
        plan = cover(self.heads, have)
        if plan is None:
            return missing
        slot = self.inner.acquire_slot(self.slot_wait_s)
        if slot is None:
            return missing  # the request recomputes; nothing was read
        try:
            cost = assemble(self.heads, plan, self.full_layout, slot.view, lambda h: self.slices.locate(h, key),
                            on_damage=lambda path, ident, exc: self._remove_damaged(path, ident, key, exc),
                            mac=self.mac, sealer=self.sealer)
        except PageError as exc:
            self.inner.release_slot(slot)
            with self._lock:
                self._counters["slice_failures"] += 1
            return IOResult(missing.job_id, "load", key, False, exc, None, False, 0,
                            missing.seconds + time.perf_counter() - t0, tier=missing.tier)
        except BaseException:
            self.inner.release_slot(slot)
            raise
        stored_back = self._store_back(key, slot, cost.token_count)
        with self._lock:
            c = self._counters
            c["slice_loads"] += 1
            c["slice_bytes_read"] += cost.bytes_read
            c["slice_bytes_scattered"] += cost.bytes_scattered
            c["slice_files"] += cost.files
            c["slice_stored_back"] += stored_back
        return IOResult(missing.job_id, "load", key, True, None, slot, False, cost.bytes_scattered,
                        missing.seconds + time.perf_counter() - t0, verified=True, tier=missing.tier)
