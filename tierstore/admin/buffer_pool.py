"""BufferPool: page buffers for fsck's read threads under one memory budget.

Contract: ``acquire(nbytes)`` returns a buffer of exactly ``nbytes``; the bytes allocated in
total (idle buffers included) stay within ``budget``, except that a single request larger
than the budget is served once it is alone. ``hold``/``unhold`` count transient memory (a
compressed payload) against the same budget.

Threading: thread-safe; ``acquire`` and ``hold`` block until the bytes are available.
"""

from __future__ import annotations

import threading


class BufferPool:
    """Page buffers shared by the read threads, at most ``budget`` bytes allocated in total
    (free buffers included); a request larger than the budget waits until it is alone.
    Threading: thread-safe; ``acquire`` blocks until the bytes are available."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.allocated = 0
        self.peak = 0
        self._free: dict[int, list[bytearray]] = {}
        self._cond = threading.Condition()

    def acquire(self, nbytes: int) -> bytearray:
        with self._cond:
            while True:
                free = self._free.get(nbytes)
                if free:
                    return free.pop()
                if self.allocated + nbytes <= self.budget or self.allocated == 0:
                    self._grow(nbytes)
                    return bytearray(nbytes)
                if not self._drop_free():
                    self._cond.wait()

    def hold(self, nbytes: int) -> None:
        """Count ``nbytes`` of transient memory (a compressed payload) until ``unhold``."""
        with self._cond:
            while self.allocated + nbytes > self.budget and self.allocated > 0:
                if not self._drop_free():
                    self._cond.wait()
            self._grow(nbytes)

    def unhold(self, nbytes: int) -> None:
        with self._cond:
            self.allocated -= nbytes
            self._cond.notify_all()

    def release(self, buf: bytearray) -> None:
        with self._cond:
            self._free.setdefault(len(buf), []).append(buf)
            self._cond.notify_all()

    def _grow(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)

    def _drop_free(self) -> bool:
        """Free every idle buffer (of other sizes): room for a waiting request. False if none."""
        dropped = sum(len(b) for bufs in self._free.values() for b in bufs)
        self._free.clear()
        self.allocated -= dropped
        return dropped > 0
