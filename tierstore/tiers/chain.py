"""TierChain: host memory -> local disk -> shared export, behind the IOEngine API.

Contract (same methods and result types as ``tierstore.engine.IOEngine``, so the vLLM adapter
can use either; one chain per (namespace, KV-cache group, rank)):

- Loads look in the host tier (a dict lookup), then the local disk tier, then the shared tier,
  and promote what they find into the faster tiers (host: a copy; local: a background store).
  A load result's ``slot`` may belong to the local or the shared engine: always hand it back
  with ``TierChain.release_slot``.
- Stores write through: the page goes into the host tier and to local disk at once, and to the
  shared tier in the background (a copy into a shared staging slot). The chain's store result
  is the local store's; if the local store fails, it is the shared store's (ok if either
  stored the page). With no local tier, the shared store is the result.
- A failing tier is skipped and counted (``metrics``), never fatal: a corrupt or vanished
  local file is dropped from the local index and the shared tier is asked; an ENOSPC on one
  tier leaves the others storing.
- Shared-tier deadlines: every shared operation (load, store, ``contains``, touch) has the
  ``shared_deadline_ms`` deadline. A timeout marks the shared tier down: from then on it answers
  misses at once (no call blocks) until a probe (``stat`` of the root, under the deadline)
  succeeds again. The shared engine itself is built in the background, so a mount that hangs
  at start-up does not hang the constructor.
- Local capacity: ``LocalIndex`` (sqlite WAL on local disk) reserves each store's size before
  it is written, evicting least-recently-used pages first, so the local root never exceeds
  ``local_max_bytes`` by more than one page. A local hit refreshes recency. Reserving runs in
  one admission thread per chain and the index's other updates in its bookkeeping thread:
  sqlite and stat release the GIL, and in the caller's thread each could wait a whole switch
  interval behind busy I/O workers.
- Pages the shared tier missed: a store the local tier took while the shared tier was down,
  out of staging slots or failing is remembered (``SHARED_BACKLOG_MAX`` keys, in memory) and
  uploaded when the shared tier answers again: an uploader thread reads the local file,
  verified (``pagefile.read_page``), into a shared slot and stores it there, one page at a
  time. A restart forgets the backlog (those pages stay local-only until stored again).
- Shared LRU stamp: a shared hit refreshes the file's mtime (``utime``), at most once per
  ``shared_touch_interval_s`` per page, in the background; ``tierstore gc`` evicts by it.

Threading: public methods may be called from any thread (one lock guards the chain's state;
no file I/O on the shared root happens in the caller's thread except under a deadline).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import sqlite3
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierstore.config import TierStoreConfig
from tierstore.engine import IOEngine, IOResult, StagingSlot
from tierstore.errors import ConfigError, PageError, PageMissing, PageQueueFull, PageTimeout
from tierstore.format import Codec, PageMeta, SectionEntry, encode_header
from tierstore.identity import Namespace
from tierstore.metrics import MetricsRegistry, default_registry
from tierstore.pagefile import read_page
from tierstore.tiers.deadline import DeadlineRunner, Health
from tierstore.tiers.host import HostTier
from tierstore.tiers.local_index import LocalIndex

log = logging.getLogger(__name__)

_LOCAL, _SHARED = "local", "shared"
_BROKEN_KINDS = ("checksum", "truncated", "format", "foreign", "key_mismatch")


@dataclass
class _Job:
    id: int
    op: str
    key: bytes
    tokens: int
    submitted: float
    waiting: set[tuple[str, int]] = field(default_factory=set)  # sub-jobs the result depends on
    local_error: PageError | None = None
    shared_ok: bool | None = None
    shared_sub: int | None = None  # the background shared store of this job
    done: bool = False
    verify: bool = True  # load: False = the caller checks the section sums (see submit_load)


def page_file_size(namespace: Namespace, group_index: int, key_len: int = 32, rank: int = 0) -> int:
    """Bytes of an uncompressed page file of this group (header + payload)."""
    group = namespace.groups[group_index]
    lay = group.layout
    meta = PageMeta(namespace.digest_bytes, b"\0" * key_len, group_index, group.kind, 0, rank)
    entries = [SectionEntry(s, o, s.nbytes, 0) for s, o in zip(lay.sections, lay.offsets, strict=True)]
    return len(encode_header(meta, Codec.NONE, entries, lay.nbytes)) + lay.nbytes


SHARED_BACKLOG_MAX = 100_000  # keys (about 10 MB of memory at most)


class _SharedEngine:
    """The shared tier's IOEngine, built in a background thread (a hung mount must not hang us)."""

    def __init__(self, factory: Any, health: Health, deadline_s: float) -> None:
        self.engine: IOEngine | None = None
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._factory = factory
        threading.Thread(target=self._build, name="tierstore-shared-open", daemon=True).start()
        if not self._ready.wait(deadline_s):
            health.mark_down(f"opening the shared root took longer than {deadline_s:.3f} s")

    def _build(self) -> None:
        try:
            self.engine = self._factory()
        except BaseException as exc:
            self.error = exc
            log.warning("tierstore shared tier could not be opened: %s", exc)
        finally:
            self._ready.set()

    def get(self) -> IOEngine | None:
        return self.engine if self._ready.is_set() else None


class TierChain:
    """host -> local -> shared page store for one (namespace, group, rank); see module docstring."""

    def __init__(
        self,
        config: TierStoreConfig,
        namespace: Namespace,
        group_index: int,
        *,
        rank: int = 0,
        host: HostTier | None = None,
        local_index: LocalIndex | None = None,
        metrics: MetricsRegistry | None = None,
        shared: bool = True,
        **engine_kwargs: Any,
    ) -> None:
        self.config = config
        self.namespace = namespace
        self.group_index = group_index
        self.rank = rank
        reg = metrics if metrics is not None else default_registry()
        self.metrics = reg
        self.m_host = reg.tier("host")
        self.m_local = reg.tier(_LOCAL)
        self.m_shared = reg.tier(_SHARED)
        self.tokens_per_page = namespace.groups[group_index].tokens_per_chunk
        self.shared_deadline_s = config.shared_deadline_ms / 1000.0
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._jobs: dict[int, _Job] = {}
        self._sub: dict[tuple[str, int], int] = {}  # (tier, engine job id) -> chain job id
        self._reservations: dict[int, int | None] = {}  # local engine job id -> reservation
        self._promotions: set[int] = set()  # local engine job ids of promotion stores
        self._results: dict[int, IOResult] = {}
        self._foreign_slots: dict[int, IOEngine] = {}  # id(slot) -> owner, for shared slots handed out
        self._touched: dict[bytes, float] = {}
        self._closed = False
        self._capacity_at = 0.0
        self._admit_cv = threading.Condition(threading.Lock())
        self._admit_q: deque[tuple[_Job | None, bytes, StagingSlot, int, Sequence[int] | None]] = deque()
        self._admit_queued = self._admit_done = 0
        self._admit_stop = False
        self._admitter: threading.Thread | None = None

        self.host = host if (host is not None and config.host_bytes > 0) else None
        self.local: IOEngine | None = None
        self.index: LocalIndex | None = None
        if config.local_root:
            self.local = IOEngine(config.local_root, namespace, group_index, rank=rank, config=config, **engine_kwargs)
            try:
                self.index = local_index if local_index is not None else LocalIndex(config.local_root, config.local_max_bytes)
            except (sqlite3.Error, OSError) as exc:
                self.local.close(0.1)
                raise ConfigError(f"cannot open the local tier's index under {config.local_root}: {exc}; "
                                  'free space there, fix its permissions, or unset "local_root"') from exc
            self._own_index = local_index is None
            if self.index.on_evict is None:
                m_local = self.m_local
                self.index.on_evict = lambda victims: m_local.evicted(len(victims), sum(v.size for v in victims))
            self.m_local.set_capacity(self.index.used_bytes(), config.local_max_bytes)
        self.scope = f"{namespace.digest}/g{group_index}/r{rank}"
        self._local_prefix = len(str(Path(config.local_root or ".") / "x")) - 1
        self._header_lens: dict[int, int] = {}

        # keys stored locally that the shared tier did not take (see the module docstring)
        self._backlog: OrderedDict[bytes, None] = OrderedDict()
        self._uploader: threading.Thread | None = None
        self._uploads: set[int] = set()  # shared engine job ids of backlog uploads
        self._uploader_lock = threading.Lock()
        self.health = Health(_SHARED, self._probe_shared, self.shared_deadline_s,
                             on_change=lambda up: self._kick_uploader() if up else None)
        self._runner = DeadlineRunner("shared-stat", max_inflight=4)
        self._touch_runner = DeadlineRunner("shared-touch", max_inflight=2)
        self._shared: _SharedEngine | None = None
        self.shared_root = Path(config.root)
        if shared:
            shared_kwargs = {k: v for k, v in engine_kwargs.items() if k in ("head_start", "head_count", "staging_slots", "pin")}
            self._shared = _SharedEngine(
                lambda: IOEngine(config.root, namespace, group_index, rank=rank, config=config,
                                 deadline_s=self.shared_deadline_s, **shared_kwargs),
                self.health, self.shared_deadline_s)
        if self.local is None and self._shared is None:
            raise ValueError("a TierChain needs local_root or the shared root")
        if self.local is None:
            # host + shared only: callers fill shared slots, so the shared engine must exist now.
            eng = self._shared.get() if self._shared else None
            if eng is None:
                raise PageTimeout(f"the shared root {config.root} did not open within the deadline "
                                  "and there is no local tier to stage pages; set \"local_root\"")
        if config.gc_interval_s and config.max_bytes:
            from tierstore.tiers.gc import GcDaemon
            GcDaemon.ensure(config.root, config.max_bytes, config.gc_interval_s, self.m_shared)

    # ------------------------------------------------------------------ helpers
    @property
    def front(self) -> IOEngine:
        """The engine whose staging slots callers fill (local if present, else shared)."""
        if self.local is not None:
            return self.local
        eng = self._shared.get() if self._shared else None
        assert eng is not None
        return eng

    @property
    def layout(self) -> Any:
        return self.front.layout

    @property
    def mapper(self) -> Any:
        return self.front.mapper

    def _shared_engine(self) -> IOEngine | None:
        if self._shared is None or not self.health.up:
            return None
        return self._shared.get()

    def _probe_shared(self) -> None:
        # a name nobody has looked up: no attribute or negative cache can answer for the server
        with contextlib.suppress(FileNotFoundError):
            os.stat(self.shared_root / f".tierstore-probe-{uuid.uuid4().hex}")
        if self._shared is not None and self._shared.get() is None:
            raise PageTimeout("shared engine still opening")

    def _file_size_estimate(self, key: bytes) -> int:
        """Upper bound of a page file's size (exact for codec none)."""
        n = self._header_lens.get(len(key))
        if n is None:
            n = self._header_lens[len(key)] = page_file_size(self.namespace, self.group_index, len(key), self.rank)
        # zstd frames of incompressible data can be slightly larger than the raw bytes
        slack = 0 if self.config.codec == "none" else 64 * len(self.front.layout.sections) + 4096
        return n + slack

    def _idx(self, method: str, *args: Any, default: Any = None) -> Any:
        """Call the local index; a sqlite failure (e.g. disk full) is counted, never raised."""
        try:
            return getattr(self.index, method)(*args)
        except sqlite3.Error as exc:
            self.m_local.failure("index")
            log.warning("tierstore local index %s failed: %s", method, exc)
            return default

    def _relpath(self, key: bytes) -> str:
        """The page's path relative to local_root (the local index's key)."""
        assert self.local is not None
        return str(self.local.mapper.path_for(key))[self._local_prefix:]

    def _finish(self, job: _Job, ok: bool, error: PageError | None, slot: StagingSlot | None,
                stored: bool = False, nbytes: int = 0, verified: bool = True,
                sums: tuple[int, ...] | None = None) -> None:
        job.done = True
        self._jobs.pop(job.id, None)
        self._results[job.id] = IOResult(job.id, job.op, job.key, ok, None if ok else error, slot, stored,
                                         nbytes, time.monotonic() - job.submitted, verified, sums)

    # ------------------------------------------------------------------ slots
    def acquire_slot(self, timeout: float | None = 0) -> StagingSlot | None:
        return self.front.acquire_slot(timeout)

    @property
    def free_slots(self) -> int:
        """Free staging slots of the front engine (the ones callers fill), as ``IOEngine.free_slots``."""
        return self.front.free_slots

    def release_slot(self, slot: StagingSlot) -> None:
        with self._lock:
            owner = self._foreign_slots.pop(id(slot), None)
        (owner or self.front).release_slot(slot)

    # ------------------------------------------------------------------ submit
    def submit_load(self, key: bytes, verify: bool = True) -> int:
        """``verify=False`` (IOEngine.submit_load) is passed on only where the bytes reach
        nobody but the caller: a page that also goes into the host tier, or is promoted from
        the shared tier to the local one, is verified here first (``IOResult.verified``)."""
        key = bytes(key)
        with self._lock:
            job = _Job(next(self._ids), "load", key, self.tokens_per_page, time.monotonic(), verify=verify)
            self._jobs[job.id] = job
            if self._closed:
                self._finish(job, False, PageMissing("the tier chain is closed", key=key), None)
                return job.id
            if self.host is not None:
                data = self.host.get(self.scope, key)
                if data is not None:
                    slot = self.front.acquire_slot(0)
                    if slot is None:
                        self.m_host.failure("queue_full")
                        self._finish(job, False, PageQueueFull("no free staging slot for a host-tier hit; "
                                                               "release the slots of finished loads", key=key), None)
                        return job.id
                    slot.view[:] = data
                    self.m_host.hit(job.tokens, len(data), time.monotonic() - job.submitted)
                    self._finish(job, True, None, slot, nbytes=len(data))
                    return job.id
                self.m_host.miss(job.tokens)
            if self.local is not None:
                sub = self.local.submit_load(key, verify=verify or self.host is not None)
                self._sub[(_LOCAL, sub)] = job.id
                job.waiting.add((_LOCAL, sub))
            else:
                self._load_shared(job)
            self._drain_locked()
            return job.id

    def _load_shared(self, job: _Job, prior: PageError | None = None) -> None:
        eng = self._shared_engine()
        if eng is None:
            if self._shared is not None:
                self.m_shared.failure("down")
            err = prior or PageMissing("not in any tier", key=job.key)
            if self._shared is not None and prior is None:
                err = PageTimeout(f"shared tier is down ({self.health.reason}); counted as a miss", key=job.key)
            self._finish(job, False, err, None)
            return
        sub = eng.submit_load(job.key, verify=job.verify or self.local is not None or self.host is not None)
        self._sub[(_SHARED, sub)] = job.id
        job.waiting.add((_SHARED, sub))

    def submit_store(self, key: bytes, slot: StagingSlot, token_count: int,
                     sums: Sequence[int] | None = None) -> int:
        """``sums``: the caller's section checksums of the slot (IOEngine.submit_store)."""
        key = bytes(key)
        with self._lock:
            job = _Job(next(self._ids), "store", key, token_count, time.monotonic())
            self._jobs[job.id] = job
            if self.host is not None:
                self.host.put(self.scope, key, slot.view)
            shared_eng = self._shared_engine()
            if self.local is None:
                if shared_eng is None:
                    self.front.release_slot(slot)
                    self.m_shared.failure("down")
                    self._finish(job, False, PageTimeout("shared tier is down; page not stored", key=key), None)
                    return job.id
                sub = shared_eng.submit_store(key, slot, token_count, sums=sums)
                self._sub[(_SHARED, sub)] = job.id
                job.waiting.add((_SHARED, sub))
                self._drain_locked()
                return job.id
            # shared copy first: the local engine owns ``slot`` once submitted
            if self._shared is not None:
                if shared_eng is None:
                    self.m_shared.failure("down")
                    self._remember_for_shared(key)
                else:
                    sslot = shared_eng.acquire_slot(0)
                    if sslot is None:
                        self.m_shared.failure("queue_full")
                        self._remember_for_shared(key)
                    else:
                        sslot.view[:] = slot.view
                        sub = shared_eng.submit_store(key, sslot, token_count, sums=sums)
                        self._sub[(_SHARED, sub)] = job.id
                        job.shared_sub = sub
            self._store_local(job, key, slot, token_count, primary=True, sums=sums)
            self._drain_locked()
            return job.id

    def _store_local(self, job: _Job | None, key: bytes, slot: StagingSlot, token_count: int, *, primary: bool,
                     sums: Sequence[int] | None = None) -> None:
        """Queue a local store; the admission thread reserves room, then submits it.

        Reserving runs sqlite and a stat, which release the GIL: in the caller's thread each
        could wait a whole GIL switch interval behind busy I/O workers, so it happens here.
        """
        if job is not None and primary:
            job.waiting.add(("admit", job.id))
        with self._admit_cv:
            self._admit_q.append((job if primary else None, key, slot, token_count, sums))
            self._admit_queued += 1
            if self._admitter is None:
                self._admitter = threading.Thread(target=self._admit_loop, name="tierstore-local-admit", daemon=True)
                self._admitter.start()
            self._admit_cv.notify_all()

    def _admit_loop(self) -> None:
        assert self.local is not None
        while True:
            with self._admit_cv:
                self._admit_cv.wait_for(lambda: self._admit_q or self._admit_stop)
                if not self._admit_q:
                    return
                job, key, slot, tokens, sums = self._admit_q.popleft()
            try:
                self._admit(job, key, slot, tokens, sums)
            except Exception:  # never lose a slot or a job to a bug
                log.exception("tierstore local admission of %s failed", key.hex()[:16])
                with self._lock:
                    with contextlib.suppress(ValueError):
                        self.local.release_slot(slot)
                    if job is not None:
                        job.waiting.discard(("admit", job.id))
                        job.local_error = job.local_error or PageError("local admission failed", key=key)
                        self._maybe_finish_store(job)
            finally:
                with self._admit_cv:
                    self._admit_done += 1
                    self._admit_cv.notify_all()

    def _admit(self, job: _Job | None, key: bytes, slot: StagingSlot, tokens: int,
               sums: Sequence[int] | None = None) -> None:
        assert self.local is not None
        rid, victims, fits = None, [], True
        if not os.path.exists(self.local.mapper.path_for(key)):  # an existing page needs no room
            rid, victims = self._idx("reserve", self._file_size_estimate(key), default=(None, []))
            fits = rid is not None
        with self._lock:
            if job is not None:
                job.waiting.discard(("admit", job.id))
            if victims:
                self.m_local.evicted(len(victims), sum(v.size for v in victims))
            if not fits:
                self.local.release_slot(slot)
                self.m_local.failure("too_big")
                if job is not None:
                    job.local_error = PageError("page is larger than local_max_bytes, or the local index "
                                                "failed (see the log)", key=key)
                    self._maybe_finish_store(job)
                return
            sub = self.local.submit_store(key, slot, tokens, sums=sums)
            self._reservations[sub] = rid
            if job is not None:
                self._sub[(_LOCAL, sub)] = job.id
                job.waiting.add((_LOCAL, sub))
            else:
                self._promotions.add(sub)

    def _admit_sync(self, timeout: float | None) -> bool:
        with self._admit_cv:
            return self._admit_cv.wait_for(lambda: self._admit_done >= self._admit_queued, timeout)

    # ------------------------------------------------------------------ results
    def _drain_locked(self) -> None:
        if self.local is not None:
            for r in self.local.poll():
                self._on_local(r)
            now = time.monotonic()
            if now - self._capacity_at > 1.0:  # the gauge, at most once a second
                self._capacity_at = now
                self.m_local.set_capacity(self._idx("used_bytes"), self.config.local_max_bytes)
        if self._shared is not None:
            eng = self._shared.get()
            if eng is not None:
                for r in eng.poll():
                    self._on_shared(r)

    def _on_local(self, r: IOResult) -> None:
        assert self.index is not None and self.local is not None
        if r.op == "store":
            rid = self._reservations.pop(r.job_id, None)
            promotion = r.job_id in self._promotions
            self._promotions.discard(r.job_id)
            if r.ok:
                rel = self._relpath(r.key)
                size: int | None = self._file_size_estimate(r.key)  # exact for codec none
                if self.config.codec != "none":
                    try:
                        size = os.stat(self.local.mapper.path_for(r.key)).st_size
                    except OSError:
                        size = None
                if size is None:
                    self.index.defer("release", rid)
                else:
                    self.index.defer("commit", rid, rel, size)
                    if r.stored:
                        self.m_local.stored(r.nbytes, r.seconds)
                        if promotion:
                            self.m_local.add("promotions")
            else:
                self.index.defer("release", rid)
                self.m_local.failure(r.error.kind if r.error else "error")
            jid = self._sub.pop((_LOCAL, r.job_id), None)
            job = self._jobs.get(jid) if jid is not None else None
            if job is not None:
                job.waiting.discard((_LOCAL, r.job_id))
                if r.ok:
                    self._finish(job, True, None, None, stored=r.stored, nbytes=r.nbytes)
                else:
                    job.local_error = r.error
                    self._maybe_finish_store(job)
            return
        jid = self._sub.pop((_LOCAL, r.job_id), None)
        job = self._jobs.get(jid) if jid is not None else None
        if job is None:  # nobody waits (cannot happen for loads, but never leak a slot)
            if r.slot is not None:
                self.local.release_slot(r.slot)
            return
        job.waiting.discard((_LOCAL, r.job_id))
        rel = self._relpath(r.key)
        if r.ok:
            assert r.slot is not None
            self.index.defer("touch", rel)
            if r.verified:  # else counted by confirm_page once the caller has checked it
                self.m_local.hit(job.tokens, r.nbytes, r.seconds)
            if self.host is not None:
                self.host.put(self.scope, r.key, r.slot.view)
            self._finish(job, True, None, r.slot, nbytes=r.nbytes, verified=r.verified, sums=r.sums)
            return
        kind = r.error.kind if r.error else "error"
        if kind == "missing":
            self.m_local.miss(job.tokens)
            self.index.defer("forget", rel)
        else:
            self.m_local.failure(kind)
            if kind in _BROKEN_KINDS:
                # our own cache copy is bad: drop it so a good page can be promoted again
                self.index.defer("forget", rel)
                with contextlib.suppress(OSError):
                    os.unlink(self.local.mapper.path_for(r.key))
        if self._shared is not None:
            self._load_shared(job, prior=r.error)
        else:
            self._finish(job, False, r.error, None)

    def _on_shared(self, r: IOResult) -> None:
        kind = r.error.kind if (r.error is not None and not r.ok) else None
        if kind == "timeout":
            self.health.mark_down(str(r.error))
        jid = self._sub.pop((_SHARED, r.job_id), None)
        job = self._jobs.get(jid) if jid is not None else None
        if r.op == "store":
            if r.ok:
                if r.stored:
                    self.m_shared.stored(r.nbytes, r.seconds)
            else:
                self.m_shared.failure(kind or "error")
                if r.job_id not in self._uploads:  # an upload that fails is not retried
                    self._remember_for_shared(r.key)
            self._uploads.discard(r.job_id)
            if job is not None:
                job.shared_ok = r.ok
                if (_SHARED, r.job_id) in job.waiting or self.local is None:
                    job.waiting.discard((_SHARED, r.job_id))
                    if self.local is None:
                        self._finish(job, r.ok, r.error, None, stored=r.stored, nbytes=r.nbytes)
                    else:
                        self._maybe_finish_store(job)
            return
        if job is None:
            if r.slot is not None:
                self._shared.get().release_slot(r.slot)  # type: ignore[union-attr]
            return
        job.waiting.discard((_SHARED, r.job_id))
        if not r.ok:
            if kind == "missing":
                self.m_shared.miss(job.tokens)
            else:
                self.m_shared.failure(kind or "error")
            self._finish(job, False, r.error, None)
            return
        assert r.slot is not None
        eng = self._shared.get()  # type: ignore[union-attr]
        if r.verified:  # else counted by confirm_page once the caller has checked it
            self.m_shared.hit(job.tokens, r.nbytes, r.seconds)
        self._touch_shared(r.key)
        if self.host is not None:
            self.host.put(self.scope, r.key, r.slot.view)
        if self.local is not None:
            pslot = self.local.acquire_slot(0)
            if pslot is None:
                self.m_local.failure("promotion_skipped")
            else:
                pslot.view[:] = r.slot.view
                self._store_local(None, r.key, pslot, job.tokens, primary=False)
        if eng is not self.front:
            self._foreign_slots[id(r.slot)] = eng  # type: ignore[assignment]
        self._finish(job, True, None, r.slot, nbytes=r.nbytes, verified=r.verified, sums=r.sums)

    def _maybe_finish_store(self, job: _Job) -> None:
        """A store whose local write failed: wait for the shared write if one is in flight."""
        if job.done:
            return
        if job.shared_sub is not None and job.shared_ok is None:
            job.waiting.add((_SHARED, job.shared_sub))
            return
        if job.shared_ok:
            self._finish(job, True, None, None, stored=True)
        else:
            self._finish(job, False, job.local_error, None)

    def _touch_shared(self, key: bytes) -> None:
        now = time.monotonic()
        last = self._touched.get(key)
        if last is not None and now - last < self.config.shared_touch_interval_s:
            return
        if len(self._touched) > 100_000:
            self._touched.clear()
        self._touched[key] = now
        eng = self._shared.get() if self._shared else None
        if eng is None:
            return
        path = eng.mapper.path_for(key)

        def touch() -> None:
            try:
                os.utime(path)
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.ESTALE):
                    raise

        self._touch_runner.fire(touch)

    # ------------------------------------------------------------------ API
    def poll(self) -> list[IOResult]:
        with self._lock:
            self._drain_locked()
            out = list(self._results.values())
            self._results.clear()
            return out

    def wait(self, job_ids: Any, timeout: float | None) -> list[IOResult]:
        """Wait until the given jobs finish (or ``timeout``); returns those that finished."""
        ids = list(job_ids)
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                self._drain_locked()
                pending = [self._jobs[i] for i in ids if i not in self._results and i in self._jobs]
                sub = next((w for job in pending for w in job.waiting if w[0] in (_LOCAL, _SHARED)), None)
            left = None if end is None else end - time.monotonic()
            if not pending or (left is not None and left <= 0):
                break
            step = 0.05 if left is None else min(left, 0.05)
            eng = None
            if sub is not None:
                eng = self.local if sub[0] == _LOCAL else (self._shared.get() if self._shared else None)
            if eng is None:
                time.sleep(min(step, 0.001))  # in admission: a moment
                continue
            # block on the engine itself (not the chain lock); hand what it returns to the chain
            res = eng.wait([sub[1]], step)
            if res:
                with self._lock:
                    for r in res:
                        (self._on_local if eng is self.local else self._on_shared)(r)
        with self._lock:
            return [self._results.pop(i) for i in ids if i in self._results]

    # ------------------------------------------------------------------ shared backlog
    def _remember_for_shared(self, key: bytes) -> None:
        """A page the local tier stores but the shared tier did not take: upload it later."""
        if self.local is None:
            return
        with self._lock:
            self._backlog[key] = None
            self._backlog.move_to_end(key)
            while len(self._backlog) > SHARED_BACKLOG_MAX:
                self._backlog.popitem(last=False)
                self.m_shared.failure("backlog_full")
        if self.health.up:
            self._kick_uploader()

    @property
    def shared_backlog(self) -> int:
        """Pages waiting to be uploaded to the shared tier."""
        return len(self._backlog)

    def _kick_uploader(self) -> None:
        # Never takes the chain's lock: Health calls this with its own lock held, and the chain
        # calls Health.mark_down with its lock held. The loop exits only under _uploader_lock,
        # after seeing an empty backlog, so a key added before this call is never stranded.
        with self._uploader_lock:
            if self._closed or not self._backlog or (self._uploader is not None and self._uploader.is_alive()):
                return
            self._uploader = threading.Thread(target=self._upload_loop, name="tierstore-shared-upload", daemon=True)
            self._uploader.start()

    def _upload_loop(self) -> None:
        """Upload the backlog while the shared tier is up, a page at a time and only while the
        shared engine has no store waiting in its queue (the caller's stores go first)."""
        assert self.local is not None
        while True:
            eng = self._shared_engine()
            with self._uploader_lock:  # exit only with nothing left (see _kick_uploader)
                if self._closed or eng is None or not self._backlog:
                    self._uploader = None
                    return
            with self._lock:
                self._drain_locked()  # retires earlier uploads (and whatever else finished)
                busy = eng.stats["queued_stores"] > 0
                if not busy:
                    key, _ = self._backlog.popitem(last=False)
            if busy:  # the shared tier is still writing: let it (and the caller's stores) go first
                time.sleep(0.005)
                continue
            sslot = eng.acquire_slot(0.5)
            if sslot is None:
                with self._lock:
                    self._backlog[key] = None
                    self._backlog.move_to_end(key, last=False)
                continue
            try:
                header = read_page(self.local.mapper.path_for(key), self.local.expectation(key), sslot.view)
            except (PageError, OSError) as exc:  # evicted since, or damaged: nothing to upload
                eng.release_slot(sslot)
                log.debug("tierstore: not uploading %s to the shared tier: %s", key.hex()[:16], exc)
                continue
            sums = [e.checksum for e in header.sections]  # of the raw sections, whatever the codec
            with self._lock:
                self._uploads.add(eng.submit_store(key, sslot, header.meta.token_count, sums=sums))
                self.m_shared.add("backlog_uploads")

    def confirm_page(self, key: bytes, nbytes: int, seconds: float | None = None) -> None:
        """The caller checked an unverified page and it matched: count the hit in the tier that
        served it (``discard_page``'s rule). Until then a page loaded with ``verify=False`` is
        neither a hit nor a failure in the tier metrics."""
        if self.local is not None:
            self.m_local.hit(self.tokens_per_page, nbytes, seconds)
        elif self._shared is not None:
            self.m_shared.hit(self.tokens_per_page, nbytes, seconds)

    def discard_page(self, key: bytes, reason: str) -> None:
        """The caller found an unverified page damaged: remove it from the tier that served it
        (by ``submit_load``'s rule: the local tier if there is one, else the shared one)."""
        key = bytes(key)
        if self.local is not None:
            self.local.discard_page(key, reason)
            if self.index is not None:
                self.index.defer("forget", self._relpath(key))
            self.m_local.failure("checksum")
            return
        eng = self._shared_engine()
        if eng is not None:
            eng.discard_page(key, reason)
            self.m_shared.failure("checksum")

    def contains(self, key: bytes) -> bool:
        key = bytes(key)
        if self.host is not None and self.host.contains(self.scope, key):
            return True
        if self.local is not None and self.local.contains(key):
            return True
        eng = self._shared_engine()
        if eng is None:
            return False
        try:
            return self._runner.call(lambda: eng.contains(key), self.shared_deadline_s)
        except PageTimeout as exc:
            self.m_shared.failure("timeout")
            self.health.mark_down(str(exc))
            return False

    def flush(self, timeout: float | None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        ok = True
        if self.local is not None:
            ok = self._admit_sync(timeout) and ok
            left = None if end is None else max(end - time.monotonic(), 0.0)
            ok = self.local.flush(left) and ok
        eng = self._shared.get() if self._shared else None
        if eng is not None:
            left = None if end is None else max(end - time.monotonic(), 0.0)
            if self.health.up:
                ok = eng.flush(left) and ok
        with self._lock:
            self._drain_locked()
        if self.index is not None:
            left = None if end is None else max(end - time.monotonic(), 0.0)
            ok = self.index.sync(left) and ok
            self.m_local.set_capacity(self._idx("used_bytes"), self.config.local_max_bytes)
        return ok

    def close(self, timeout: float | None = None) -> None:
        if timeout is None:
            timeout = self.config.flush_timeout_s
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.flush(timeout)
        uploader = self._uploader
        if uploader is not None:
            uploader.join(min(timeout, 1.0))  # it stops at its next page (self._closed)
        with self._admit_cv:
            self._admit_stop = True
            self._admit_cv.notify_all()
        if self._admitter is not None:
            self._admitter.join(timeout)
        if self.local is not None:
            self.local.close(timeout)
            with self._lock:
                self._drain_locked()
        eng = self._shared.get() if self._shared else None
        if eng is not None:
            eng.close(min(timeout, self.shared_deadline_s) if self.health.up else 0.05)
        if self.index is not None and self._own_index:
            self.index.close()

    def __enter__(self) -> TierChain:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tiers": self.metrics.snapshot(), "shared_up": self.health.up}
        # the keys an IOEngine's stats have that callers log (front = the engine callers fill)
        front = self.local if self.local is not None else (self._shared.get() if self._shared else None)
        if front is not None:
            fs = front.stats
            for k in ("io_mode", "odirect_reason", "codec", "staging_slots", "free_slots", "pinned"):
                out[k] = fs.get(k)
        if self.local is not None:
            out["local_engine"] = self.local.stats
        eng = self._shared.get() if self._shared else None
        if eng is not None:
            out["shared_engine"] = eng.stats
        return out

    # shim until merge: PageStore.settle over confirm_page/discard_page (the lead drops it)
    def settle(self, result: IOResult, ok: bool, reason: str = "") -> None:
        """The caller's verdict on an unverified load: ``ok`` counts the hit, not ``ok`` removes
        the damaged file, on a short-lived thread (a hung mount must not stall the caller)."""
        if ok:
            self.confirm_page(result.key, result.nbytes, result.seconds)
            return
        key = bytes(result.key)
        threading.Thread(target=self.discard_page, args=(key, reason or "checksum mismatch"),
                         name="tierstore-discard", daemon=True).start()
