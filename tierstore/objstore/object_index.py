"""ObjectIndex: which pages one (bucket prefix, namespace, group, rank) holds, from listings.

Contract: ``contains(object_key)`` answers from memory (never a request): True when the last
listing of the rank's prefix had the object or this process stored it since (``add``), False
otherwise, including before the first listing has finished (a hint: a load verifies, and a
miss only costs a recompute). A background thread lists the prefix (``ObjectClient.list_keys``,
1,000 keys a request) at start and then every ``refresh_s`` (0: once); a listing replaces the
set, keeping what was added while it ran (a page this process stored is never forgotten by a
listing that raced with its store). ``discard`` forgets a key (a damaged object removed).

Failure policy: a listing that fails (the endpoint down, a timeout) is logged at debug and
changes nothing; the next refresh tries again. Threading: ``contains``, ``add`` and
``discard`` may be called from any thread (a set lookup is atomic under the GIL; changes in
place, O(1), under a lock; a listing swaps in a new set under it); the
listing runs on this object's daemon thread, stopped by ``close``.
"""

from __future__ import annotations

import logging
import threading

from tierstore.errors import PageError
from tierstore.objstore.client import ObjectClient

log = logging.getLogger(__name__)


class ObjectIndex:
    """Object keys under one prefix, from listings plus this process's stores."""

    def __init__(self, client: ObjectClient, prefix: str, refresh_s: float) -> None:
        self.client = client
        self.prefix = prefix
        self.refresh_s = refresh_s
        self._keys: set[str] = set()  # replaced by a listing, added to in place (O(1))
        self._added: set[str] = set()  # stored while a listing ran
        self._listing = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.listed = threading.Event()  # the first listing finished (or failed)
        self.listings = 0
        self._thread = threading.Thread(target=self._loop, name="tierstore-object-index", daemon=True)
        self._thread.start()

    def contains(self, object_key: str) -> bool:
        return object_key in self._keys

    def add(self, object_key: str) -> None:
        with self._lock:
            if self._listing:
                self._added.add(object_key)
            self._keys.add(object_key)

    def discard(self, object_key: str) -> None:
        with self._lock:
            self._added.discard(object_key)
            self._keys.discard(object_key)

    def __len__(self) -> int:
        return len(self._keys)

    def refresh(self) -> None:
        """List the prefix once and replace the set (module docstring)."""
        with self._lock:
            self._listing = True
            self._added = set()
        try:
            found = {info.key for info in self.client.list_keys(self.prefix)}
        except PageError as exc:
            log.debug("tierstore: listing s3://%s/%s failed: %s", self.client.location.bucket, self.prefix, exc)
            with self._lock:
                self._listing = False
            return
        with self._lock:
            self._keys = found | self._added
            self._listing = False
            self.listings += 1

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.refresh()
            self.listed.set()
            if self.refresh_s <= 0 or self._stop.wait(self.refresh_s):
                return

    def close(self) -> None:
        self._stop.set()
