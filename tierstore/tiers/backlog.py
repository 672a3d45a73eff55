"""SharedBacklog: pages a chain stored locally that the shared tier did not take, uploaded later.

Contract: ``add(key)`` remembers a key (at most ``SHARED_BACKLOG_MAX``, in memory; the oldest
are dropped first and counted as ``failures["backlog_full"]``). While the shared tier is up
and the backlog is not empty, one uploader thread reads the local file, verified, into a
shared staging slot: through the local rank directory's fd without following a symlink, the
file opened O_NOFOLLOW|O_NONBLOCK and read only if regular with one link
(``rank_dir.RankDir``, ``page_io.open_page``, ``page_read.read_page_fd``), its MAC verified when the local engine
has a fleet key (a page without a valid tag is never uploaded), and stores it there, one page at a time
and only while the shared engine has no store waiting in its queue (the caller's stores go
first). A page evicted or damaged since is skipped; an upload that fails is not retried (the
shared tier counts the failure). A restart forgets the backlog (those pages stay local-only
until stored again). ``drain`` (the chain's) is called between pages so finished uploads are
retired even when nobody polls.

Threading: ``add``/``kick`` from any thread, never blocking: ``kick`` is called by the shared
tier's health callback with the health lock held. The uploader thread takes the backlog lock
alone, and calls ``drain`` and the tiers without it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from tierstore.errors import PageError
from tierstore.format.header import PageHeader
from tierstore.fs.mapper import fanout
from tierstore.rootstore.engine import IOEngine
from tierstore.rootstore.page_io import open_page
from tierstore.rootstore.page_read import read_page_fd
from tierstore.rootstore.rank_dir import RankDir
from tierstore.tiers.local import LocalTier
from tierstore.tiers.shared import SharedTier

log = logging.getLogger(__name__)

SHARED_BACKLOG_MAX = 100_000  # keys (about 10 MB of memory at most)


class SharedBacklog:
    """Uploads local pages the shared tier missed; see the module docstring."""

    def __init__(self, source: LocalTier, target: SharedTier, drain: Callable[[], None]) -> None:
        self.source = source
        self.target = target
        self._drain = drain
        self._keys: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._dirs: RankDir | None = None  # the source's rank directory (opened at first upload)
        target.on_health(lambda up: self.kick() if up else None)

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def busy(self) -> bool:
        """Keys are waiting or the uploader is running."""
        with self._lock:
            return bool(self._keys) or (self._thread is not None and self._thread.is_alive())

    def flush(self, end: float | None) -> bool:
        """Wait (until the monotonic time ``end``; None: no bound) for the uploads while the
        target answers, then for its stores (``TierChain.flush``); False if time ran out. A
        target that is down is not waited for: its keys stay for when it is up."""
        while self.busy and self.target.available and (end is None or time.monotonic() < end):
            time.sleep(0.01)
        if self.busy and self.target.available:
            return False
        return self.target.flush(None if end is None else max(end - time.monotonic(), 0.0))

    def add(self, key: bytes, front: bool = False) -> None:
        with self._lock:
            self._keys[key] = None
            self._keys.move_to_end(key, last=not front)
            while len(self._keys) > SHARED_BACKLOG_MAX:
                self._keys.popitem(last=False)
                self.target.metrics.failure("backlog_full")
        if self.target.available:
            self.kick()

    def kick(self) -> None:
        """Start the uploader unless it runs. It exits only under the lock after seeing an
        empty backlog, so a key added before this call is never stranded."""
        with self._lock:
            if self._closed or not self._keys or (self._thread is not None and self._thread.is_alive()):
                return
            self._thread = threading.Thread(target=self._loop, name="tierstore-shared-upload", daemon=True)
            self._thread.start()

    def close(self, timeout: float) -> None:
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            thread.join(timeout)  # it stops at its next page
        if self._dirs is not None and (thread is None or not thread.is_alive()):
            self._dirs.close()

    def _next(self) -> bytes | None:
        """The next key to upload, or None when the uploader should stop (and has stopped)."""
        while True:
            eng = self.target.engine() if self.target.available else None
            with self._lock:
                if self._closed or eng is None or not self._keys:
                    self._thread = None
                    return None
                if eng.stats["queued_stores"] == 0:
                    key, _ = self._keys.popitem(last=False)
                    return key
            time.sleep(0.005)  # the shared tier is still writing: let it (and the caller's stores) go first

    def _loop(self) -> None:
        while True:
            self._drain()  # retires earlier uploads (and whatever else finished)
            key = self._next()
            if key is None:
                return
            slot = self.target.acquire_slot(0.5)
            if slot is None:
                self.add(key, front=True)
                continue
            src = self.source.engine()
            assert src is not None
            try:
                header = self._read_local(src, key, slot.view)
            except (PageError, OSError) as exc:  # evicted since, damaged or unsafe: nothing to upload
                self.target.release_slot(slot)
                log.debug("tierstore: not uploading %s to the shared tier: %s", key.hex()[:16], exc)
                continue
            sums = [e.checksum for e in header.sections]  # of the raw sections, whatever the codec
            self.target.submit_store(key, slot, header.meta.token_count, sums=sums)
            self.target.metrics.add("backlog_uploads")

    def _read_local(self, src: IOEngine, key: bytes, out: memoryview) -> PageHeader:
        """Read and verify the local page of ``key`` into ``out`` (see the module docstring)."""
        if self._dirs is None:
            self._dirs = RankDir(src.root, src.mapper.dir_parts)
        path = src.mapper.final_path(key)
        dir_fd = self._dirs.fanout(fanout(key), where=path, key=key)
        try:
            fd, st = open_page(os.path.basename(path), key, dir_fd=dir_fd, where=path)
        finally:
            os.close(dir_fd)
        try:
            return read_page_fd(fd, st, path, src.expectation(key), out, mac=src.mac,
                                         sealer=src.sealer)
        finally:
            os.close(fd)
