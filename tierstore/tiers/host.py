"""Host-memory tier: an LRU of verified page buffers, bounded by ``host_bytes``.

Contract: ``put`` copies the page (callers keep their buffer); ``get`` returns the stored
``bytes`` (immutable, so a reader can never see a half-replaced page) and refreshes its
recency. Pages are only ever put after a verified load or from the page being stored, so
the host tier holds no unverified bytes. Keys are ``(scope, key)`` where scope names the
(namespace, group, rank) so one ``HostTier`` can serve every group of a process and the cap
holds for the whole process. A page larger than the cap is not kept.

Threading: thread-safe (one lock); copies happen outside the lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from tierstore.metrics import TierMetrics


class HostTier:
    def __init__(self, cap_bytes: int, metrics: TierMetrics | None = None) -> None:
        self.cap_bytes = cap_bytes
        self.metrics = metrics
        self._pages: OrderedDict[tuple[str, bytes], bytes] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self._publish_capacity()

    def _publish_capacity(self) -> None:
        if self.metrics is not None:
            self.metrics.set_capacity(self._used, self.cap_bytes)

    def get(self, scope: str, key: bytes) -> bytes | None:
        with self._lock:
            data = self._pages.get((scope, key))
            if data is not None:
                self._pages.move_to_end((scope, key))
            return data

    def contains(self, scope: str, key: bytes) -> bool:
        with self._lock:
            return (scope, key) in self._pages

    def put(self, scope: str, key: bytes, page: bytes | memoryview) -> bool:
        """Keep a copy of ``page``; False if it does not fit at all."""
        n = len(page)
        if n > self.cap_bytes:
            return False
        data = bytes(page)
        evicted = evicted_bytes = 0
        with self._lock:
            old = self._pages.pop((scope, key), None)
            if old is not None:
                self._used -= len(old)
            while self._used + n > self.cap_bytes and self._pages:
                _, victim = self._pages.popitem(last=False)
                self._used -= len(victim)
                evicted += 1
                evicted_bytes += len(victim)
            self._pages[(scope, key)] = data
            self._used += n
            used = self._used
        if self.metrics is not None:
            if evicted:
                self.metrics.evicted(evicted, evicted_bytes)
            self.metrics.set_capacity(used, self.cap_bytes)
        return True

    def discard(self, scope: str, key: bytes) -> None:
        with self._lock:
            old = self._pages.pop((scope, key), None)
            if old is not None:
                self._used -= len(old)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def __len__(self) -> int:
        with self._lock:
            return len(self._pages)
