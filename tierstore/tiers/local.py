"""LocalTier: the local-disk tier of a chain, an ``IOEngine`` on ``local_root`` under a cap.

Contract (``EngineTier`` plus):
- Capacity: every store passes ``LocalAdmission`` (a ``LocalIndex`` reservation, evicting
  least-recently-used pages) before its engine sees it; a completed store commits its
  reservation with the file's size, a failed one releases it. The capacity gauge is published
  at most once a second and at every ``flush``.
- Recency: a hit refreshes the page in the index; a miss or a damaged page forgets it (the
  engine already removed the damaged file: the tier never unlinks one itself).
- A sqlite failure of the index (e.g. disk full) is counted (``failure("index")``) and logged,
  never raised: the page is then stored or served without bookkeeping.

Threading: as ``EngineTier``; index updates are deferred to the index's bookkeeping thread.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tierstore.config import TierStoreConfig
from tierstore.errors import BAD_CONTENT_KINDS, ConfigError
from tierstore.format.identity import Namespace
from tierstore.fs.mounts import is_network, mount_of
from tierstore.index import page_index
from tierstore.index.local_index import LocalIndex
from tierstore.metrics import TierMetrics
from tierstore.rootstore.engine import IOEngine
from tierstore.rootstore.staging import StagingSlot
from tierstore.store import IOResult
from tierstore.tiers.admission import LocalAdmission
from tierstore.tiers.tier import EngineTier, TierJob

log = logging.getLogger(__name__)


def refuse_network_local_root(local_root: str | os.PathLike[str]) -> None:
    """Raise ``ConfigError`` when ``local_root`` lies on a network file system (mounts.py).

    The local tier's sqlite index relies on POSIX locks and on writes being seen in order,
    which NFS and FUSE mounts do not give (a corrupt or locked index), and its LRU cap assumes
    nobody else writes there. Checked where the tier opens, never in config validation (which
    must not touch the file system); an unknown mount table (not Linux) passes."""
    mount = mount_of(local_root)
    if mount is not None and is_network(mount):
        raise ConfigError(
            f'setting "local_root" {os.fspath(local_root)!r} is on a network file system ({mount.fstype} '
            f"{mount.source} mounted at {mount.mount_point}): the local tier's sqlite index breaks there. "
            'Point "local_root" at a local disk (NVMe, a local SSD or an emptyDir), put the shared '
            'export in "root", or unset "local_root" to run without a local tier')


class LocalTier(EngineTier):
    """The local disk: engine + index admission; see the module docstring."""

    def __init__(self, config: TierStoreConfig, namespace: Namespace, group_index: int, rank: int,
                 metrics: TierMetrics, index: LocalIndex | None = None, **engine_kwargs: Any) -> None:
        assert config.local_root
        refuse_network_local_root(config.local_root)
        engine = IOEngine(config.local_root, namespace, group_index, rank=rank, config=config, tier_name="local",
                          **engine_kwargs)
        super().__init__("local", engine, metrics, namespace.groups[group_index].tokens_per_chunk)
        self.config = config
        try:
            self.index = index if index is not None else LocalIndex(config.local_root, config.local_max_bytes)
        except (sqlite3.Error, OSError) as exc:
            engine.close(0.1)
            raise ConfigError(f"cannot open the local tier's index under {config.local_root}: {exc}; "
                              'free space there, fix its permissions, or unset "local_root"') from exc
        self._own_index = index is None
        if self.index.on_evict is None:
            root = config.local_root

            def on_evict(victims: list[Any]) -> None:
                metrics.evicted(len(victims), sum(v.size for v in victims))
                for v in victims:  # lookups stop answering HIT for evicted pages at once
                    page_index.note_removed_file(root, v.path)

            self.index.on_evict = on_evict
        self._prefix = len(str(Path(config.local_root) / "x")) - 1
        self._header_lens: dict[int, int] = {}
        self._capacity_at = 0.0
        self._admission = LocalAdmission(self, self.index, self.file_size_estimate)
        self.publish_capacity()

    # ------------------------------------------------------------------ index
    def index_failed(self, op: str, exc: sqlite3.Error) -> None:
        self.metrics.failure("index")
        log.warning("tierstore local index %s failed: %s", op, exc)

    def publish_capacity(self) -> None:
        self._capacity_at = time.monotonic()
        try:
            used = self.index.used_bytes()
            pages = self.index.count()  # residency gauge (tierstore_tier_resident_pages)
        except sqlite3.Error as exc:
            self.index_failed("used_bytes", exc)
            return
        self.metrics.set_capacity(used, self.config.local_max_bytes, pages=pages)

    def relpath(self, key: bytes) -> str:
        """The page's path relative to local_root (the local index's key)."""
        return str(self.mapper.path_for(key))[self._prefix:]

    def file_size_estimate(self, key: bytes) -> int:
        """Upper bound of a page file's size (exact for codec none)."""
        n = self._header_lens.get(len(key))
        if n is None:  # the engine's own header and layout (a head slice's at TP > 1)
            eng = self.engine()
            assert eng is not None
            n = self._header_lens[len(key)] = eng.files.header_len(len(key)) + eng.layout.nbytes
        # zstd frames of incompressible data can be slightly larger than the raw bytes
        slack = 0 if self.config.codec == "none" else 64 * len(self.layout.sections) + 4096
        return n + slack

    # ------------------------------------------------------------------ EngineTier hooks
    def admit(self, job: TierJob, slot: StagingSlot, sums: Sequence[int] | None) -> None:
        self._admission.submit(job, slot, sums)

    def on_load(self, r: IOResult) -> None:
        if r.ok:
            self.index.defer("touch", self.relpath(r.key))
        elif r.error is not None and (r.error.kind == "missing" or r.error.kind in BAD_CONTENT_KINDS):
            self.forget(r.key)  # a damaged copy was removed by the engine: a good one may be promoted

    def on_store(self, r: IOResult, job: TierJob) -> None:
        size: int | None = None
        if r.ok:
            size = self.file_size_estimate(r.key)  # exact for codec none
            if self.config.codec != "none":
                try:
                    size = os.stat(self.mapper.path_for(r.key)).st_size
                except OSError:
                    size = None
        if size is None:
            self.index.defer("release", job.reservation)
        else:
            self.index.defer("commit", job.reservation, self.relpath(r.key), size)
        if time.monotonic() - self._capacity_at > 1.0:  # the gauge, at most once a second
            self.publish_capacity()

    def forget(self, key: bytes) -> None:
        self.index.defer("forget", self.relpath(key))

    # ------------------------------------------------------------------ lifetime
    def flush(self, timeout: float | None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if end is None else max(end - time.monotonic(), 0.0)

        ok = self._admission.sync(timeout)
        ok = super().flush(left()) and ok
        self.finish_completed()  # the completed stores into the index (on_store) before it syncs
        ok = self.index.sync(left()) and ok
        self.publish_capacity()
        return ok

    def close(self, timeout: float | None = None) -> None:
        self._admission.close(timeout)
        super().close(timeout)
        self.finish_completed()
        if self._own_index:
            self.index.close()
