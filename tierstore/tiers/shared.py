"""SharedTier: the shared export (``root``) as a tier of a chain, guarded by deadlines.

Contract (``EngineTier`` plus):
- Deadlines: every shared operation (load, store, ``contains``, touch) has the
  ``shared_deadline_s`` deadline (a lone root, the tier named ``root``: ``deadline_s``; the
  engine's own for loads and stores, a ``DeadlineRunner`` for the rest). A timeout marks the tier down (``health``): from then on it is not
  ``available``, so the chain skips it at once (no call blocks), until a probe (``stat`` of a
  fresh name under the root, under the deadline) succeeds again.
- Background open: the engine is built in a thread, so a mount that hangs at start-up does not
  hang the constructor; until it is open the tier is not available. Its staging slots, layout
  and file names are there from the constructor on (the pool is made first and handed to the
  engine): a lone root that has not answered yet still lends slots, and refuses each job at
  once as ``down``, so an engine starts while the export hangs and serves misses.
- LRU stamp: a hit refreshes the file's mtime in the background, at most once per
  ``shared_touch_interval_s`` per page, and so does a hit on a faster tier of the chain
  (``stamp_hit``); ``tierstore gc`` evicts by it. The stamp is an
  fd-based ``utime`` (futimens) on the page opened like a load opens it (``touch_page``: the
  fan-out directory through the rank directory's fd without following a symlink, the file
  O_NOFOLLOW|O_NONBLOCK and only if regular with one link), never a path-based ``utime``: a
  hard-linked page or a symlinked directory never changes an outside file's mtime.
- Failure kinds of loads: ``unsafe`` (the entry under the page's name, or a directory on the
  way, is not what tierstore made) is a miss of this tier, never a reason to mark it down;
  ``mac`` (no valid tag under a fleet key) is bad content, removed by the engine that read it.
  Only ``timeout`` marks the tier down. With ``max_bytes`` and
  ``gc_interval_s`` set, the process's gc daemon for the root is started here.
- ``on_health`` registers a callback called with the new state when the tier goes down or up
  (the backlog uploader starts on "up"); it runs with the health lock held and must not block.
- Up gauge (``TierMetrics.set_up``, exported as ``tierstore_tier_up``): the tier's
  ``available`` (health up and engine open), set to 0 in the constructor before the open starts
  (a root that hangs at open reads 0 from the start), then again when the open ends, when the
  constructor returns and on every health transition; ``close`` withdraws it (``drop_up``).

Threading: as ``EngineTier``. Threads: ``tierstore-shared-open`` (once), the health probe
(while down), deadline threads for ``contains`` and touches (bounded: a hung mount cannot pile
them up).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierstore.config import TierStoreConfig
from tierstore.errors import TRANSIENT_ERRNOS, PageError, PageMissing, PageTimeout, PageUnsafe
from tierstore.format.identity import Namespace
from tierstore.fs.deadline import DeadlineRunner, Health, probe_root
from tierstore.fs.mapper import FileMapper, fanout
from tierstore.metrics import TierMetrics
from tierstore.rootstore.engine import IOEngine, frame_geometry, staging_pool
from tierstore.rootstore.page_io import open_page, read_error
from tierstore.rootstore.rank_dir import RankDir
from tierstore.rootstore.staging import StagingSlot
from tierstore.store import IOResult
from tierstore.tiers.tier import ENGINE_KWARGS, EngineTier, TierJob

log = logging.getLogger(__name__)

_TOUCHED_MAX = 100_000  # pages whose last touch is remembered (then the memory starts over)


# Roots whose open has not answered yet in this process: when the first tier began waiting. A
# model's groups open one tier each, one after another: they share one deadline per root, so a
# hung export delays the start by one deadline, not groups x deadline (3 groups at 2 s: 6.05 s).
_UNANSWERED: dict[Path, float] = {}
_UNANSWERED_LOCK = threading.Lock()


def _open_wait_s(root: Path, deadline_s: float) -> float:
    """How long a new tier on ``root`` waits for its open: what is left of the deadline that
    began when the first tier of a root that has not answered yet began waiting."""
    now = time.monotonic()
    with _UNANSWERED_LOCK:
        since = _UNANSWERED.setdefault(root.absolute(), now)
    return max(since + deadline_s - now, 0.0)


def _root_answered(root: Path) -> None:
    """An engine on ``root`` opened: later tiers on it wait their whole deadline again."""
    with _UNANSWERED_LOCK:
        _UNANSWERED.pop(root.absolute(), None)


class SharedTier(EngineTier):
    """The shared export: health, deadlines, background open, touch-on-hit; see module docstring."""

    def __init__(self, config: TierStoreConfig, namespace: Namespace, group_index: int, rank: int,
                 metrics: TierMetrics, *, name: str = "shared", deadline_s: float | None = None,
                 **engine_kwargs: Any) -> None:
        # name "root": a lone root (a chain of one, tiers/factory.py), with its own deadline
        super().__init__(name, None, metrics, namespace.groups[group_index].tokens_per_chunk)
        self.root = Path(config.root)
        self.deadline_s = deadline_s if deadline_s is not None else config.shared_deadline_s
        self.touch_interval_s = config.shared_touch_interval_s
        self._listeners: list[Callable[[bool], None]] = []
        self._up_token = object()  # this tier's entry in metrics' up gauge
        self._up_lock = threading.Lock()  # read the state and publish it as one step
        self._up_closed = False  # closed: the gauge entry is withdrawn for good
        # one of the root's healths in this process: the first to find it down marks the others
        self.health = Health(name, self._probe, self.deadline_s, on_change=self._health_changed, root=self.root)
        self._stat_runner = DeadlineRunner("shared-stat", max_inflight=4)
        self._touch_runner = DeadlineRunner("shared-touch", max_inflight=2)
        self._touched: dict[bytes, float] = {}
        self._to_touch: dict[bytes, None] = {}  # pages to stamp, in order (the touch threads drain it)
        self._draining = 0  # touch threads draining it (at most 2; under _touch_lock)
        self._touch_lock = threading.Lock()
        self._opened = threading.Event()
        # the touch's own directory fds (the engine's are its own): no symlink followed, and the
        # engine's directory (a head slice's h<start>-<count>, not r<rank>: FileMapper says which)
        self._mapper = FileMapper(self.root, namespace.digest, group_index, rank, engine_kwargs.get("rank_dir"))
        self._dirs = RankDir(self.root, self._mapper.dir_parts)
        kwargs = {k: v for k, v in engine_kwargs.items() if k in ENGINE_KWARGS}
        self._layout = kwargs.get("layout") or namespace.groups[group_index].layout
        geometry = frame_geometry(namespace, group_index, config, rank=rank, head_start=kwargs.get("head_start", 0),
                                  head_count=kwargs.get("head_count", 0), rank_dir=kwargs.get("rank_dir"),
                                  layout=kwargs.get("layout"))
        kwargs["staging"] = self._pool = staging_pool(geometry, config, kwargs.pop("staging_slots", None),
                                                      bool(kwargs.pop("pin", False)))
        self.open_error: BaseException | None = None  # why the engine could not be built (logged)
        metrics.set_up(self._up_token, False)  # not serving until the engine is open
        self._open_args = (config, namespace, group_index, rank, kwargs)
        self._reopening = threading.Lock()  # one reopen at a time (a probe may outlive its deadline)
        wait_s = _open_wait_s(self.root, self.deadline_s)  # before the open: its success clears the entry
        threading.Thread(target=self._open, name="tierstore-shared-open", daemon=True,
                         args=self._open_args).start()
        if not self._opened.wait(wait_s):
            self.health.mark_down(f"opening {self.root} took longer than {self.deadline_s:.3f} s")
        self._publish_up()  # the state the constructor returns with (the open thread's may come later)

    def _open(self, config: TierStoreConfig, namespace: Namespace, group_index: int, rank: int,
              kwargs: dict[str, Any]) -> None:
        """Build the engine (the open thread, then the health probe's reopens). Failure policy:
        an error with an errno of ``TRANSIENT_ERRNOS`` (EIO on a soft mount while its server
        restarts, ESTALE) marks the tier down, and the probe loop reopens it once the root
        answers; any other error is the user's to fix (``open_error``: a lone root raises it)."""
        try:
            self._engine = IOEngine(config.root, namespace, group_index, rank=rank, config=config,
                                    deadline_s=self.deadline_s, tier_name=self.name, **kwargs)
            self.open_error = None
            _root_answered(self.root)
        except Exception as exc:
            self.open_error = exc
            if self.open_failed_transiently:
                log.warning("tierstore %s tier could not be opened (%s); down until its root answers, then "
                            "opened again", self.name, exc)
                self.health.mark_down(f"opening failed: {exc}")
            else:
                log.warning("tierstore %s tier could not be opened: %s", self.name, exc)
        finally:
            self._opened.set()
            self._publish_up()

    @property
    def open_failed_transiently(self) -> bool:
        """The last open failed with an error the file server may not repeat (``_open``)."""
        exc = self.open_error
        return isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS

    # ------------------------------------------------------------------ health
    def on_health(self, callback: Callable[[bool], None]) -> None:
        self._listeners.append(callback)

    def _health_changed(self, up: bool) -> None:
        self._publish_up()
        for callback in self._listeners:
            callback(up)

    def _publish_up(self) -> None:
        """Set the up gauge to ``available`` now. The state is read under ``_up_lock``, so the
        publish after the last change (open finished, down, up) leaves the value that holds."""
        with self._up_lock:
            if not self._up_closed:
                self.metrics.set_up(self._up_token, self.available)

    def _probe(self) -> None:
        probe_root(self.root)
        if self._opened.is_set() and self._engine is None and self.open_failed_transiently:
            if not self._reopening.acquire(blocking=False):
                raise PageTimeout(f"the {self.name} engine is still reopening")
            try:
                self._open(*self._open_args)  # the root answers: open again, on the probe's thread
            finally:
                self._reopening.release()
        if self.engine() is None:
            raise PageTimeout(f"the {self.name} engine is still opening ({self.open_error or 'not answered yet'})")

    def engine(self) -> IOEngine | None:
        return self._engine if self._opened.is_set() else None

    @property
    def available(self) -> bool:
        return self.health.up and self.engine() is not None

    # the facade a caller uses before the engine is open: the same pool, layout and names
    @property
    def layout(self) -> Any:
        return self._layout

    @property
    def mapper(self) -> Any:
        return self._mapper

    @property
    def pinned(self) -> bool:
        return self._pool.pinned

    @property
    def free_slots(self) -> int:
        eng = self.engine()
        return eng.free_slots if eng is not None else self._pool.free_count

    def acquire_slot(self, timeout: float | None = 0) -> StagingSlot | None:
        eng = self.engine()
        return eng.acquire_slot(timeout) if eng is not None else self._pool.acquire(timeout)

    def release_slot(self, slot: StagingSlot) -> None:
        eng = self.engine()
        if eng is not None:
            eng.release_slot(slot)
        else:
            self._pool.release(slot)

    def refuse(self, key: bytes) -> PageError:
        self.metrics.failure("down")
        return PageTimeout(f"{self.name} tier is down ({self.health.reason or 'still opening'}); skipped", key=key)

    # ------------------------------------------------------------------ EngineTier hooks
    def _note_timeout(self, r: IOResult) -> None:
        if not r.ok and r.error is not None and r.error.kind == "timeout":
            self.health.mark_down(str(r.error))

    def on_load(self, r: IOResult) -> None:
        self._note_timeout(r)
        if r.ok:
            self._touch(r.key)

    def on_store(self, r: IOResult, job: TierJob) -> None:
        self._note_timeout(r)

    def contains(self, key: bytes) -> bool:
        eng = self.engine()
        if eng is None or not self.health.up:
            return False
        try:
            return self._stat_runner.call(lambda: eng.contains(key), self.deadline_s)
        except PageTimeout as exc:
            self.metrics.failure("timeout")
            self.health.mark_down(str(exc))
            return False

    def stamp_hit(self, key: bytes) -> None:
        """A faster tier (host memory, the local disk) served ``key``: refresh the shared copy's
        LRU stamp as a hit here would (rate-limited per page, on the touch threads, never on the
        request path), so gc keeps the fleet's hottest pages, not the ones only a new node reads.
        A page the export does not hold costs one failed open on a touch thread."""
        if self.health.up:
            self._touch(key)

    def _touch(self, key: bytes) -> None:
        """Stamp ``key``'s page soon: queued for the touch threads (at most 2, ``fire``), so a
        stamp is never lost because two were still in flight; only a hung mount (the queue past
        ``_TOUCHED_MAX``) drops them."""
        now = time.monotonic()
        with self._touch_lock:
            last = self._touched.get(key)
            if last is not None and now - last < self.touch_interval_s:
                return
            if len(self._touched) > _TOUCHED_MAX:
                self._touched.clear()
            self._touched[key] = now
            if len(self._to_touch) < _TOUCHED_MAX:
                self._to_touch[key] = None
            start = self._draining < 2 and self.engine() is not None  # else a running drainer takes it
            self._draining += start
        if start and not self._touch_runner.fire(self._touch_queued):
            with self._touch_lock:  # two touch threads stuck in a hung mount
                self._draining -= 1

    def _touch_queued(self) -> None:
        """On a touch thread: stamp the queued pages until none is left."""
        eng = self.engine()
        assert eng is not None  # started only once the engine is open
        while True:
            with self._touch_lock:
                if not self._to_touch:  # under the lock: a key queued after this is seen by _touch
                    self._draining -= 1
                    return
                key = next(iter(self._to_touch))
                del self._to_touch[key]
            path = eng.mapper.final_path(key)
            try:
                touch_page(self._dirs, key, path)
            except PageMissing:
                pass  # evicted since: nothing to stamp
            except PageUnsafe as exc:
                self.metrics.failure("unsafe")
                log.debug("tierstore: not touching %s: %s", path, exc)
            except Exception as exc:  # noqa: BLE001 - a stamp is best effort; the drainer goes on
                log.debug("tierstore: touching %s failed: %s", path, exc)

    def close(self, timeout: float | None = None) -> None:
        with self._up_lock:
            self._up_closed = True
            self.metrics.drop_up(self._up_token)
        eng = self.engine()
        if eng is not None:
            eng.close(min(timeout or self.deadline_s, self.deadline_s) if self.health.up else 0.05)
        self._dirs.close(timeout=0.05)  # a touch's open hung in a dead mount must not hold shutdown


def touch_page(dirs: RankDir, key: bytes, path: str) -> None:
    """Set the page file's mtime to now through an fd: the fan-out directory opened from the
    rank directory's fd (``RankDir.fanout``, no symlink followed), the file opened as a load
    opens it (``page_io.open_page``: O_NOFOLLOW|O_NONBLOCK, regular, one link). Raises
    ``PageMissing`` (gone), ``PageUnsafe`` (a link, a FIFO, a hard link: nothing touched) or
    ``PageIOError``."""
    dir_fd = dirs.fanout(fanout(key), where=path, key=key)
    try:
        fd, _ = open_page(os.path.basename(path), key, dir_fd=dir_fd, where=path)
    finally:
        os.close(dir_fd)
    try:
        os.utime(fd)
    except OSError as exc:
        raise read_error(exc, "read", path, key) from exc
    finally:
        os.close(fd)


